"""paged_attention: the torch reference against a naive softmax(QK^T)V over un-paged K/V,
the Triton kernels against the reference, and batch invariance.

Every batch is built so that paging matters: physical blocks are shuffled, cache slots
that belong to no sequence (block 0 among them) hold NaN, and block-table entries past a
sequence's blocks hold an out-of-range block id, so reading anything the kernels must not
read shows up. The caches come in the layouts the kernels take (kv_cache.empty_kv_cache):
slot-major, as a GPU's pool is stored; head-major; and the CPU's, dim-major keys with
head-major values, which bfloat16 decodes weigh in place, and float32 ones on a CPU
without AVX-512 (decode_in_pool.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from aioserve.kernels import attention_reference, decode_in_pool, kv_cache
from aioserve.kernels.attention import paged_attention
from aioserve.kernels.attention_reference import PREFILL_ALIGN, paged_attention_reference
from aioserve.kernels.decode_groups import DECODE_GROUP
from aioserve.kernels.kv_cache import empty_kv_cache, stored_order, torch_path_layouts

_TOLERANCE = {
    torch.float32: dict(atol=2e-5, rtol=1e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
_INVALID_BLOCK = 2**30


@dataclass
class Batch:
    """One model step's attention inputs, plus the un-paged keys/values behind them."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    scale: float
    max_query_len: int
    max_seq_len: int
    keys: list[torch.Tensor]  # per sequence [seq_len, Hkv, D]
    values: list[torch.Tensor]

    def args(self) -> tuple:
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            self.query_start_loc,
            self.seq_lens,
            self.block_tables,
            self.scale,
            self.max_query_len,
            self.max_seq_len,
        )


def make_batch(
    seqs: list[tuple[int, int]],
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    extra_table_columns: int = 1,
    layout: str = "slot-major",
) -> Batch:
    """A batch of sequences given as (query_len, seq_len) pairs, its caches stored as
    `layout` says (one of LAYOUTS' ids)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(seq_len / block_size) for _, seq_len in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    # Block 0 belongs to no sequence: a load that falls back to block 0 reads NaN.
    physical = 1 + torch.randperm(num_blocks - 1, generator=gen)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    value_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    block_tables = torch.full(
        (len(seqs), max(blocks_per_seq) + extra_table_columns), _INVALID_BLOCK, dtype=torch.int32
    )
    keys, values, queries = [], [], []
    used = 0
    for b, (query_len, seq_len) in enumerate(seqs):
        blocks = physical[used : used + blocks_per_seq[b]]
        used += blocks_per_seq[b]
        block_tables[b, : len(blocks)] = blocks.int()
        k = torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(dtype)
        positions = torch.arange(seq_len)
        key_cache[blocks[positions // block_size], positions % block_size] = k
        value_cache[blocks[positions // block_size], positions % block_size] = v
        keys.append(k.to(device))
        values.append(v.to(device))
        queries.append(torch.randn(query_len, num_q_heads, head_size, generator=gen).to(dtype))
    key_layout, value_layout = _CACHE_LAYOUTS[layout]
    key_cache = empty_kv_cache(*cache_shape, dtype, key_cache.device, key_layout).copy_(key_cache)
    value_cache = empty_kv_cache(*cache_shape, dtype, value_cache.device, value_layout).copy_(
        value_cache
    )
    query_lens = torch.tensor([q for q, _ in seqs])
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = query_lens.cumsum(0)
    return Batch(
        query=torch.cat(queries).to(device),
        key_cache=_to_device(key_cache, device),
        value_cache=_to_device(value_cache, device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor([s for _, s in seqs], dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        scale=head_size**-0.5,
        max_query_len=max(q for q, _ in seqs),
        max_seq_len=max(s for _, s in seqs),
        keys=keys,
        values=values,
    )


def _to_device(cache: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The cache on `device` in the same layout (`Tensor.to` keeps a permuted view's strides
    only where it can)."""
    if cache.device == device:
        return cache
    order = stored_order(cache)
    return cache.permute(order).to(device).permute([order.index(dim) for dim in range(4)])


# make_batch's layouts: (keys, values) as kv_cache.empty_kv_cache names them.
_CACHE_LAYOUTS = {
    "slot-major": ("slot_major", "slot_major"),
    "head-major": ("head_major", "head_major"),
    "cpu": torch_path_layouts(torch.bfloat16),
}
LAYOUTS = pytest.mark.parametrize("layout", list(_CACHE_LAYOUTS))


def naive_attention(batch: Batch, sliding_window: int = 0) -> torch.Tensor:
    """Row by row softmax(q K^T * scale) V in float64, from the un-paged keys/values; with a
    `sliding_window` W > 0, the row at position p over keys p - W + 1 .. p only."""
    num_q_heads = batch.query.shape[1]
    out = torch.zeros(batch.query.shape, dtype=torch.float64, device=batch.query.device)
    starts = batch.query_start_loc.tolist()
    for b, seq_len in enumerate(batch.seq_lens.tolist()):
        group = num_q_heads // batch.keys[b].shape[1]
        keys = batch.keys[b].double().repeat_interleave(group, dim=1)  # [seq_len, Hq, D]
        values = batch.values[b].double().repeat_interleave(group, dim=1)
        query_len = starts[b + 1] - starts[b]
        for i in range(query_len):
            position = seq_len - query_len + i
            first = max(0, position + 1 - sliding_window) if sliding_window else 0
            q = batch.query[starts[b] + i].double()  # [Hq, D]
            scores = torch.einsum("hd,khd->hk", q, keys[first : position + 1]) * batch.scale
            out[starts[b] + i] = torch.einsum(
                "hk,khd->hd", scores.softmax(-1), values[first : position + 1]
            )
    return out


# (query_len, seq_len): decodes, full prefills and prefill chunks over a cached prefix,
# with lengths that cross block boundaries at every block size used below.
MIXED = [(1, 17), (5, 5), (1, 1), (7, 40), (1, 33), (3, 20), (1, 16)]


@pytest.mark.parametrize(
    "num_q_heads, num_kv_heads, head_size, block_size",
    [(2, 2, 64, 16), (8, 2, 64, 8), (8, 1, 128, 32), (6, 2, 80, 1)],
)
@LAYOUTS
def test_reference_matches_naive(device, num_q_heads, num_kv_heads, head_size, block_size, layout):
    batch = make_batch(
        MIXED,
        num_q_heads,
        num_kv_heads,
        head_size,
        block_size,
        torch.float32,
        device,
        layout=layout,
    )
    out = paged_attention_reference(*batch.args())
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), naive_attention(batch), atol=1e-5, rtol=1e-5)


@LAYOUTS
def test_reference_decodes_in_several_groups_match_naive(device, layout):
    # More decode rows than one DECODE_GROUP, with prefills between them and lengths that
    # differ from group to group.
    seqs = [(1, 3 + 7 * i) if i % 5 else (4, 9 + i) for i in range(2 * DECODE_GROUP + 5)]
    batch = make_batch(seqs, 4, 2, 64, 8, torch.float32, device, layout=layout)
    out = paged_attention_reference(*batch.args())
    torch.testing.assert_close(out.double(), naive_attention(batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "seq_lens",
    [[29], [16], [1], [3 + 5 * i for i in range(DECODE_GROUP + 3)], [32, 32, 32]],
    ids=["one-mid-block", "one-full-block", "one-token", "two-groups", "whole-blocks"],
)
@LAYOUTS
def test_reference_decode_only_steps_match_naive(device, seq_lens, layout):
    # Steps of decodes only: consecutive query rows (read and written as slices) and, alone,
    # a group of one cut to its length; the NaN in the free slots past it must not leak.
    seqs = [(1, n) for n in seq_lens]
    batch = make_batch(seqs, 6, 2, 64, 16, torch.float32, device, layout=layout)
    out = paged_attention_reference(*batch.args())
    torch.testing.assert_close(out.double(), naive_attention(batch), atol=1e-5, rtol=1e-5)


def test_reference_half_precision_matches_naive(device):
    batch = make_batch(MIXED, 4, 1, 64, 16, torch.float16, device)
    out = paged_attention_reference(*batch.args())
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double(), naive_attention(batch), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("seqs", [MIXED, [(1, 5 + 9 * i) for i in range(DECODE_GROUP + 3)]])
@LAYOUTS
def test_reference_bfloat16_matches_naive(device, seqs, layout):
    # bfloat16 multiplies in bfloat16 (float32 accumulation; decode groups' scores rounded
    # to bfloat16 and the probabilities too before the product with V, as transformers'
    # eager attention does): within 2e-2 of float64 on the same inputs, the tolerance the
    # Triton kernels are held to in bfloat16.
    batch = make_batch(seqs, 8, 2, 64, 16, torch.bfloat16, device, layout=layout)
    out = paged_attention_reference(*batch.args())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), naive_attention(batch), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fresh_prompt_reads_the_steps_keys_not_the_pool(device, dtype):
    # A prompt with nothing cached before it attends the keys and values its layer has just
    # written (new_kv) instead of gathering them back; a chunk over a cached prefix and the
    # decodes still read the pool. bfloat16 prompts of 128 rows and more go through the
    # products, the rest through SDPA.
    seqs = [(1, 37), (300, 300), (20, 50), (160, 160), (9, 9)]
    batch = make_batch(seqs, 8, 2, 64, 16, dtype, device, layout="cpu")
    expected = paged_attention_reference(*batch.args())
    new_keys = torch.cat([k[s - q :] for (q, s), k in zip(seqs, batch.keys, strict=True)])
    new_values = torch.cat([v[s - q :] for (q, s), v in zip(seqs, batch.values, strict=True)])
    for b, (query_len, seq_len) in enumerate(seqs):
        if query_len == seq_len:  # what the fresh prompts would gather is now NaN
            blocks = batch.block_tables[b, : -(-seq_len // 16)].long()
            batch.key_cache[blocks] = float("nan")
            batch.value_cache[blocks] = float("nan")
    out = paged_attention_reference(*batch.args(), new_kv=(new_keys, new_values))
    assert torch.equal(out, expected)


@pytest.mark.parametrize(
    "dtype, layout, avx512, in_pool",
    [
        (torch.bfloat16, "cpu", True, True),
        (torch.float32, "cpu", False, True),
        (torch.float32, "cpu", True, False),  # float32 gathers on AVX-512 (decode_in_pool.py)
        (torch.float16, "cpu", False, False),  # computed in float32: not the pool's dtype
        (torch.bfloat16, "head-major", False, False),  # a key block's slots are not one run
    ],
)
def test_decodes_weigh_the_pool_in_place_where_its_layout_allows(
    device, monkeypatch, dtype, layout, avx512, in_pool
):
    monkeypatch.setattr(kv_cache, "_has_avx512", lambda: avx512)
    # In the CPU's layout with the pool in the compute dtype, each group of decodes is two
    # embedding_bags, its scores' and its values', over the pool's rows; otherwise the
    # decodes gather and no bag runs. Prefill rows between the decodes change neither.
    seqs = [(1, 5 + 9 * i) if i % 4 else (3, 9 + i) for i in range(2 * DECODE_GROUP + 3)]
    batch = make_batch(seqs, 8, 2, 64, 16, dtype, device, layout=layout)
    bags = []
    weighted_sums = decode_in_pool._weighted_sums

    def recording_bag(table, rows, offsets, weights):
        bags.append((offsets.numel(), rows.numel() // offsets.numel()))  # (bags, length)
        return weighted_sums(table, rows, offsets, weights)

    monkeypatch.setattr(decode_in_pool, "_weighted_sums", recording_bag)
    out = paged_attention_reference(*batch.args())
    lengths = torch.tensor([n for q, n in seqs if q == 1]).numpy()
    expected = []
    for group in decode_in_pool.group_decodes(lengths, 16, 8, 64):
        longest = int(lengths[group].max())  # the value bags stop at the longest's length
        blocks = -(-longest // 16)
        expected += [(len(group) * 8 * blocks, 64), (len(group) * 8, longest)]
    assert bags == (expected if in_pool else [])
    torch.testing.assert_close(out.double(), naive_attention(batch), **_TOLERANCE[dtype])


@pytest.mark.parametrize("block_size", [16, 8, 1])
def test_reference_prefill_attends_in_padded_shapes(device, monkeypatch, block_size):
    # Prefill SDPA sees query and key lengths rounded up to PREFILL_ALIGN (so that bfloat16
    # builds a bounded set of kernels, see the module), and the padding changes no row:
    # full prompts and chunks over a cached prefix, lengths on both sides of the alignment,
    # NaN in the cache slots past every sequence.
    seqs = [(1, 9), (17, 17), (16, 16), (5, 37), (31, 47), (2, 33)]
    batch = make_batch(seqs, 8, 2, 64, block_size, torch.bfloat16, device)
    lengths = []
    sdpa = attention_reference.F.scaled_dot_product_attention

    def recording_sdpa(query, key, value, **kwargs):
        if kwargs.get("enable_gqa") is not None:  # prefill calls pass it, decode calls do not
            lengths.append((query.shape[-2], key.shape[-2]))
        return sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(attention_reference.F, "scaled_dot_product_attention", recording_sdpa)
    out = paged_attention_reference(*batch.args())
    assert lengths == [(32, 32), (16, 16), (16, 48), (32, 48), (16, 48)]
    assert all(n % PREFILL_ALIGN == 0 for pair in lengths for n in pair)
    torch.testing.assert_close(out.double(), naive_attention(batch), **_TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("seq_lens", [[300], [29, 3, 17, 40]], ids=["one-stream", "padded"])
def test_an_all_decode_step_weighed_in_the_pool_is_what_the_general_way_writes(device, seq_lens):
    # Every row decodes, as one group in the step's order: the group's result is returned
    # as it is (ReferencePlan.bags_of_every_row). Written into `out`, the same step goes the
    # general way, group by group: the same bits, and both within bfloat16's tolerance of
    # naive attention (shorter sequences' padding masked in the scores).
    batch = make_batch(
        [(1, n) for n in seq_lens], 8, 2, 64, 16, torch.bfloat16, device, layout="cpu"
    )
    plan = attention_reference.plan_reference_attention(
        batch.query_start_loc.cpu().numpy(),
        batch.seq_lens.cpu().numpy(),
        batch.block_tables.cpu().numpy(),
        16,
        batch.query.device,
    )
    alone = paged_attention_reference(*batch.args(), plan=plan)
    assert plan.bags_of_every_row(batch.query, batch.key_cache, batch.value_cache) is not None
    out = torch.empty_like(batch.query)
    assert paged_attention_reference(*batch.args(), out=out, plan=plan) is out
    assert torch.equal(alone, out)
    torch.testing.assert_close(alone.double(), naive_attention(batch), **_TOLERANCE[torch.bfloat16])


def test_a_step_with_a_prefill_or_padding_rows_takes_the_general_way(device):
    plan_of = attention_reference.plan_reference_attention
    for seqs, extra_rows in (([(1, 30), (4, 9)], 0), ([(1, 30), (1, 12)], 2)):
        batch = make_batch(seqs, 8, 2, 64, 16, torch.bfloat16, device, layout="cpu")
        query = torch.cat([batch.query, batch.query[:extra_rows]])
        plan = plan_of(
            batch.query_start_loc.cpu().numpy(),
            batch.seq_lens.cpu().numpy(),
            batch.block_tables.cpu().numpy(),
            16,
            query.device,
        )
        assert plan.bags_of_every_row(query, batch.key_cache, batch.value_cache) is None


def test_reference_writes_into_out_and_leaves_padding_rows(device):
    batch = make_batch(MIXED, 4, 2, 64, 16, torch.float32, device)
    num_tokens = batch.query.shape[0]
    padded_query = torch.cat([batch.query, torch.randn_like(batch.query[:3])])
    out = torch.full(padded_query.shape, 7.0, device=device)
    batch.query = padded_query
    result = paged_attention_reference(*batch.args(), out=out)
    assert result is out
    assert (out[num_tokens:] == 7.0).all()
    batch.query = padded_query[:num_tokens]
    torch.testing.assert_close(out[:num_tokens], paged_attention_reference(*batch.args()))


def test_block_table_narrower_than_max_seq_len_raises(device):
    batch = make_batch([(1, 33)], 2, 2, 64, 16, torch.float32, device, extra_table_columns=0)
    batch.max_seq_len = 49
    with pytest.raises(ValueError, match="max_seq_len"):
        paged_attention(*batch.args())


# Interpreter cases: GQA ratios 1, 4 and 8; head sizes 64, 128 and the padded 80; block
# sizes 1, 8, 16 and 32; float32 and float16 (bfloat16 tl.dot is broken in the interpreter).
TRITON_CASES = [
    (torch.float32, 2, 2, 64, 16),
    (torch.float16, 2, 2, 64, 16),
    (torch.float32, 4, 1, 128, 8),
    (torch.float16, 8, 2, 64, 32),
    (torch.float16, 8, 1, 128, 16),
    (torch.float32, 3, 1, 80, 1),
]


@pytest.mark.parametrize("dtype, num_q_heads, num_kv_heads, head_size, block_size", TRITON_CASES)
def test_triton_matches_reference(
    triton_backend, device, dtype, num_q_heads, num_kv_heads, head_size, block_size
):
    batch = make_batch(MIXED, num_q_heads, num_kv_heads, head_size, block_size, dtype, device)
    out = paged_attention(*batch.args())
    assert out.dtype == dtype
    assert not out.isnan().any()
    torch.testing.assert_close(out, paged_attention_reference(*batch.args()), **_TOLERANCE[dtype])


@pytest.mark.parametrize(
    "dtype, num_q_heads, num_kv_heads, head_size, block_size", TRITON_CASES[:3]
)
def test_triton_reads_a_head_major_cache(
    triton_backend, device, dtype, num_q_heads, num_kv_heads, head_size, block_size
):
    # The CPU's pool layout, through the kernels' strides.
    args = (MIXED, num_q_heads, num_kv_heads, head_size, block_size, dtype, device)
    batch = make_batch(*args, layout="head-major")
    out = paged_attention(*batch.args())
    assert out.dtype == dtype
    assert not out.isnan().any()
    torch.testing.assert_close(out, paged_attention_reference(*batch.args()), **_TOLERANCE[dtype])


def test_triton_decode_only_batch(triton_backend, device):
    batch = make_batch([(1, 9), (1, 40), (1, 1), (1, 16)], 4, 1, 64, 16, torch.float16, device)
    out = paged_attention(*batch.args())
    torch.testing.assert_close(
        out, paged_attention_reference(*batch.args()), **_TOLERANCE[torch.float16]
    )


def test_triton_writes_into_strided_out_and_leaves_padding_rows(triton_backend, device):
    batch = make_batch(MIXED, 4, 2, 64, 16, torch.float32, device)
    num_tokens, num_heads, head_size = batch.query.shape
    # A query that is a view into a wider (q|k|v-like) tensor, plus 3 padding rows.
    fused = torch.randn(num_tokens + 3, num_heads, 3 * head_size, device=device)
    fused[:num_tokens, :, :head_size] = batch.query
    expected = paged_attention_reference(*batch.args())
    batch.query = fused[:, :, :head_size]
    out_storage = torch.full((num_tokens + 3, num_heads, 2 * head_size), 7.0, device=device)
    out = out_storage[:, :, :head_size]
    result = paged_attention(*batch.args(), out=out)
    assert result.data_ptr() == out.data_ptr()
    assert (out_storage[num_tokens:] == 7.0).all()
    assert (out_storage[:, :, head_size:] == 7.0).all()
    torch.testing.assert_close(out[:num_tokens], expected, **_TOLERANCE[torch.float32])


def _alone_and_in_batch(dtype, device, block_size=16, layout="slot-major"):
    """Outputs of a prefill chunk and a decode, each alone and then inside a larger batch."""
    args = (4, 1, 64, block_size, dtype, device)
    singles = [
        make_batch([(6, 23)], *args, seed=10, layout=layout),
        make_batch([(1, 29)], *args, seed=11, layout=layout),
    ]
    alone = [paged_attention(*single.args()) for single in singles]

    # The same two sequences at batch positions 2 and 4 among others: other query offsets,
    # other physical blocks, another max_query_len and max_seq_len.
    mixed = make_batch([(1, 12), (9, 9), (6, 23), (1, 40), (1, 29), (3, 35)], *args, layout=layout)
    starts = mixed.query_start_loc.tolist()
    for index, single in zip((2, 4), singles, strict=True):
        mixed.query[starts[index] : starts[index + 1]] = single.query
        for i in range(math.ceil(int(single.seq_lens[0]) / block_size)):
            dst, src = int(mixed.block_tables[index, i]), int(single.block_tables[0, i])
            mixed.key_cache[dst] = single.key_cache[src]
            mixed.value_cache[dst] = single.value_cache[src]
    together = paged_attention(*mixed.args())
    return alone, [together[starts[2] : starts[3]], together[starts[4] : starts[5]]]


def test_triton_batch_invariance(triton_backend, device):
    alone, together = _alone_and_in_batch(torch.float16, device)
    for a, t in zip(alone, together, strict=True):
        assert torch.equal(a, t)


@LAYOUTS
def test_reference_batch_invariance_to_rounding(device, layout):
    alone, together = _alone_and_in_batch(torch.float32, device, layout=layout)
    for a, t in zip(alone, together, strict=True):
        torch.testing.assert_close(a, t, atol=1e-6, rtol=1e-6)


# Compiled on a GPU: bfloat16 too, longer contexts, several block sizes.
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "num_q_heads, num_kv_heads, head_size, block_size",
    [(8, 8, 64, 16), (32, 8, 128, 16), (16, 2, 128, 32), (12, 4, 96, 8), (8, 1, 256, 16)],
)
def test_gpu_triton_matches_reference(
    triton_backend, device, dtype, num_q_heads, num_kv_heads, head_size, block_size
):
    seqs = [(1, 1), (1, 300), (1, 1027), (130, 130), (77, 600), (1, 64), (200, 1100), (2, 2)]
    batch = make_batch(seqs, num_q_heads, num_kv_heads, head_size, block_size, dtype, device)
    out = paged_attention(*batch.args())
    torch.testing.assert_close(out, paged_attention_reference(*batch.args()), **_TOLERANCE[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_triton_batch_invariance(triton_backend, device, dtype):
    alone, together = _alone_and_in_batch(dtype, device)
    for a, t in zip(alone, together, strict=True):
        assert torch.equal(a, t)


def test_triton_split_decode_over_many_segments_matches_reference(triton_backend, device):
    # The interpreter's decode segments hold 32 keys: 150 keys are 5 segments, 33 are 2.
    seqs = [(1, 150), (1, 33), (1, 32), (1, 1), (1, 97)]
    for dtype in (torch.float32, torch.float16):
        batch = make_batch(seqs, 4, 2, 64, 16, dtype, device, seed=3)
        out = paged_attention(*batch.args())
        expected = paged_attention_reference(*batch.args())
        torch.testing.assert_close(out, expected, **_TOLERANCE[dtype])


def test_triton_split_decode_is_the_same_alone_and_at_batch_64(triton_backend, device):
    args = (2, 1, 32, 16, torch.float16, device)
    single = make_batch([(1, 150)], *args, seed=20)
    alone = paged_attention(*single.args())
    lengths = [1 + (37 * i) % 200 for i in range(64)]
    lengths[41] = 150
    batch = make_batch([(1, n) for n in lengths], *args, seed=21)
    batch.query[41] = single.query[0]
    for i in range(math.ceil(150 / 16)):
        dst, src = int(batch.block_tables[41, i]), int(single.block_tables[0, i])
        batch.key_cache[dst] = single.key_cache[src]
        batch.value_cache[dst] = single.value_cache[src]
    together = paged_attention(*batch.args())
    assert torch.equal(together[41], alone[0])
