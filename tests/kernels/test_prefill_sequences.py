"""Fresh prompts of one padded length attended in one SDPA call (prefill_sequences.py): the
bits each prompt gets alone, the attention a naive float64 softmax gives, and which
prompts a step batches."""

from __future__ import annotations

import pytest
import torch

from aioserve.kernels import dispatch, prefill_products
from aioserve.kernels.attention_reference import (
    paged_attention_reference,
    plan_reference_attention,
)
from aioserve.kernels.prefill_sequences import PrefillSequence, batch_prompts
from tests.kernels.test_attention import make_batch, naive_attention

BLOCK_SIZE = 16


def _new_kv(batch, seqs):
    """The step's new keys and values, as its layer has just written them."""
    keys = torch.cat([k[s - q :] for (q, s), k in zip(seqs, batch.keys, strict=True)])
    values = torch.cat([v[s - q :] for (q, s), v in zip(seqs, batch.values, strict=True)])
    return keys, values


def _plan(batch):
    return plan_reference_attention(
        batch.query_start_loc.cpu().numpy(),
        batch.seq_lens.cpu().numpy(),
        batch.block_tables.cpu().numpy(),
        BLOCK_SIZE,
        batch.query.device,
    )


# (query_len, seq_len): fresh prompts (query_len == seq_len) among decodes, a chunk over a
# cached prefix and prompts that need padding. The plan puts the decodes first.
ONE_RUN = [(32, 32), (32, 32), (32, 32), (1, 20)]
RUNS_APART = [(48, 48), (48, 48), (1, 37), (16, 16), (20, 50), (48, 48), (48, 48), (9, 9), (9, 9)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "seqs, batched",
    [(ONE_RUN, [[0, 1, 2]]), (RUNS_APART, [[0, 1], [5, 6]])],
    ids=["one-run", "runs-apart"],
)
def test_batched_prompts_get_the_bits_of_their_own_calls(device, dtype, seqs, batched):
    batch = make_batch(seqs, 6, 2, 64, BLOCK_SIZE, dtype, device, layout="cpu")
    alone = paged_attention_reference(*batch.args())  # every prompt from the pool, alone
    for b, (query_len, seq_len) in enumerate(seqs):
        if query_len == seq_len:  # what a fresh prompt would read from the pool is now NaN
            blocks = batch.block_tables[b, : -(-seq_len // BLOCK_SIZE)].long()
            batch.key_cache[blocks] = float("nan")
            batch.value_cache[blocks] = float("nan")
    plan = _plan(batch)
    new_kv = _new_kv(batch, seqs)
    together = paged_attention_reference(*batch.args(), plan=plan, new_kv=new_kv)

    # Prefill indices (the plan's prefills leave the decodes out) of each batch that ran.
    prefill_rows = [b for b, (q, _) in enumerate(seqs) if q > 1]
    ran = plan.prompt_batches(dtype, batch.key_cache.dtype, new_kv)
    assert [[prefill_rows[i] for i in b.members] for b in ran] == batched
    assert torch.equal(together, alone)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(
        together.double(), naive_attention(batch), atol=tolerance, rtol=tolerance
    )


def _prefill(start: int, rows: int, seq_len: int | None = None, window: int = 0):
    seq_len = rows if seq_len is None else seq_len
    return PrefillSequence(
        start=start,
        end=start + rows,
        blocks=torch.zeros(1, dtype=torch.int64),
        seq_len=seq_len,
        padded_query_len=-(-rows // 16) * 16,
        padded_seq_len=-(-seq_len // 16) * 16,
        window=window,
    )


def test_runs_of_fresh_unpadded_prompts_of_one_length_are_batched(monkeypatch):
    prefills = [
        _prefill(0, 256),
        _prefill(256, 256),
        _prefill(512, 256),
        _prefill(768, 128),  # another length: a run of its own
        _prefill(896, 128),
        _prefill(1024, 250),  # would need padding, as would the next
        _prefill(1274, 250),
        _prefill(1524, 256, seq_len=300),  # a chunk over a cached prefix
        _prefill(1780, 256),  # does not start where a prompt of the run ended
        _prefill(2036, 256, window=64),  # through a sliding window
        _prefill(2292, 256),
        _prefill(2588, 256),  # rows 2548-2587 are other sequences' decodes
    ]
    batches = batch_prompts(prefills, torch.bfloat16)
    assert [(b.members, b.first_row, b.length) for b in batches] == [
        ([0, 1, 2], 0, 256),
        ([3, 4], 768, 128),
    ]
    # Where bfloat16 prompts of 128 rows and more go through the products, none of these is
    # batched in bfloat16; in batch-invariant mode none is at all.
    monkeypatch.setattr(prefill_products, "cpu_fast_bf16_flag", lambda: "avx512_bf16")
    assert batch_prompts(prefills, torch.bfloat16) == []
    assert len(batch_prompts(prefills, torch.float32)) == 2
    monkeypatch.setattr(dispatch, "_batch_invariant", True)
    assert batch_prompts(prefills, torch.float32) == []


def test_prompts_are_not_batched_where_the_pool_rounds_what_it_stores(device):
    # A float16 step computes in float32, and an fp8 pool holds other values than the
    # step's new keys: each prompt then reads what the pool holds, on its own.
    seqs = [(32, 32), (32, 32)]
    batch = make_batch(seqs, 4, 2, 64, BLOCK_SIZE, torch.float32, device, layout="cpu")
    plan = _plan(batch)
    new_kv = _new_kv(batch, seqs)
    assert plan.prompt_batches(torch.float16, torch.float16, new_kv) == []
    assert _plan(batch).prompt_batches(torch.float32, torch.float8_e4m3fn, new_kv) == []
    assert _plan(batch).prompt_batches(torch.float32, torch.float32, None) == []
    assert len(_plan(batch).prompt_batches(torch.float32, torch.float32, new_kv)) == 1
