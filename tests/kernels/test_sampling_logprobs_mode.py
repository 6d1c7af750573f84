"""The sampler's logprobs modes (vLLM's --logprobs-mode), on both paths (the Triton kernels
interpreted on the CPU, and the torch reference), against an independent float64
computation written here: raw logprobs or logits, or the logits the draw saw (bias, bans,
penalties and bitmask for every row; temperature, min-p, top-k and top-p for random rows,
dropped tokens at -inf) and their log-softmax; the sampled token's value, its rank and the
top n of each row, over the values the mode reports. The draw is the same in every mode.
"""

from __future__ import annotations

import pytest
import torch

from aioserve.kernels.sampling import LOGPROBS_MODES, SAMPLING_EPS, make_sampling_batch
from aioserve.kernels.sampling.logprobs import compute_logprobs_reference, compute_logprobs_triton
from aioserve.kernels.sampling.sampler import sample_reference, sample_triton
from tests.kernels.sampling_references import (
    INF,
    expected_keep,
    penalized_by_loop,
    random_logits,
)

VOCAB = 300
NUM_TOP = 6
# (temperature, top_k, top_p, min_p, presence, frequency, repetition, bias) per row.
ROWS = [
    (0.0, -1, 1.0, 0.0, 0.5, 0.3, 1.2, {5: 8.0, 7: -INF}),  # greedy: processors only
    (0.7, 5, 1.0, 0.0, 0.0, 0.0, 1.0, {0: 3.0}),  # 5 kept: the 6th listed at -inf
    (1.3, -1, 0.8, 0.0, 0.4, 0.2, 1.1, {}),
    (1.0, -1, 1.0, 0.1, 0.0, 0.0, 1.0, {}),  # with a bitmask (below)
    (0.5, 40, 0.9, 0.05, 1.0, 0.5, 1.3, {11: -2.0, 12: 4.0}),
    (2.0, 1, 1.0, 0.0, 0.0, 0.0, 1.0, {}),  # one token kept
    (0.0, 3, 0.5, 0.5, 0.0, 0.0, 1.0, {}),  # greedy with a bitmask: masks ignored
    (1.0, -1, 1.0, 0.0, 0.0, 0.0, 1.0, {}),  # nothing processed
]
BITMASK_ROWS = [3, 6]


def _bitmask(generator: torch.Generator) -> torch.Tensor:
    """[2, words] int32: random bits, token 0 always allowed."""
    words = -(-VOCAB // 32)
    bits = torch.randint(0, 2**32, (len(BITMASK_ROWS), words), generator=generator)
    bits[:, 0] |= 1
    return (bits - (bits >= 2**31).long() * 2**32).to(torch.int32)


def _allowed(bitmask: torch.Tensor) -> torch.Tensor:
    """[2, VOCAB] bool, bit by bit."""
    words = bitmask.long() & 0xFFFFFFFF
    tokens = torch.arange(VOCAB)
    return ((words[:, tokens // 32] >> (tokens % 32)) & 1).bool()


def _case(device, dtype, mode, num_logprobs=NUM_TOP):
    generator = torch.Generator().manual_seed(2025)
    logits = random_logits(len(ROWS), VOCAB, "cpu", seed=41, dtype=dtype)
    counts = (torch.rand(len(ROWS), VOCAB, generator=generator) < 0.05).int() * torch.randint(
        1, 4, (len(ROWS), VOCAB), generator=generator, dtype=torch.int32
    )
    prompt_mask = torch.rand(len(ROWS), VOCAB, generator=generator) < 0.05
    bitmask = _bitmask(generator)
    columns = list(zip(*ROWS, strict=True))
    batch = make_sampling_batch(
        len(ROWS),
        device=device,
        temperature=columns[0],
        top_k=columns[1],
        top_p=columns[2],
        min_p=columns[3],
        presence_penalty=columns[4],
        frequency_penalty=columns[5],
        repetition_penalty=columns[6],
        logit_bias=columns[7],
        output_token_counts=counts.to(device),
        prompt_token_mask=prompt_mask.to(device),
        seeds=[3, 1, 4, 1, 5, 9, 2, 6],
        steps=[0, 7, 2, 1, 8, 2, 8, 1],
        token_bitmask=bitmask.to(device),
        bitmask_rows=torch.tensor(BITMASK_ROWS, device=device),
        num_logprobs=num_logprobs,
        logprobs_mode=mode,
    )
    return logits.to(device), batch, (counts, prompt_mask, bitmask)


def _expected_values(logits, state, mode) -> torch.Tensor:
    """[rows, vocab] float64: what the mode reports, from the definitions."""
    if mode.startswith("raw_"):
        values = logits.double()
    else:
        counts, prompt_mask, bitmask = state
        columns = list(zip(*ROWS, strict=True))
        biases = [list(bias.items()) for bias in columns[7]]
        values = penalized_by_loop(logits, counts, prompt_mask, *columns[4:7], biases)
        allowed = _allowed(bitmask)
        for i, row in enumerate(BITMASK_ROWS):
            values[row][~allowed[i]] = -INF
        for row, (temperature, top_k, top_p, min_p, *_) in enumerate(ROWS):
            if temperature < SAMPLING_EPS:
                continue  # greedy: the processors only
            keep = expected_keep(values[row], temperature, top_k, top_p, min_p)
            values[row] = torch.where(keep, values[row] / temperature, -INF)
    if mode.endswith("_logprobs"):
        values = torch.log_softmax(values, dim=-1)
    return values


PATHS = {"reference": sample_reference, "triton": sample_triton}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode", LOGPROBS_MODES)
@pytest.mark.parametrize("path", PATHS)
def test_each_mode_reports_its_values_ranks_and_top_n(path, mode, dtype, device, triton_backend):
    logits, batch, state = _case(device, dtype, mode)
    out = PATHS[path](logits, batch)
    expected = _expected_values(logits.cpu(), state, mode)
    tokens = out.token_ids.cpu()
    lp = out.logprobs
    reported = expected.gather(1, tokens[:, None]).squeeze(1)
    assert torch.isfinite(reported).all()  # the sampled token is one the draw kept
    torch.testing.assert_close(lp.sampled_logprob.cpu().double(), reported, atol=1e-4, rtol=1e-5)
    assert torch.equal(lp.sampled_rank.cpu(), 1 + (expected > reported[:, None]).sum(-1))
    order = torch.sort(-expected, dim=-1, stable=True).indices[:, :NUM_TOP]
    assert torch.equal(lp.top_token_ids.cpu(), order)  # -inf ones last, by id
    torch.testing.assert_close(
        lp.top_logprobs.cpu().double(), expected.gather(1, order), atol=1e-4, rtol=1e-5
    )
    if mode.startswith("processed_"):
        # The processed logits the runner reads logprob_token_ids from: the same tokens
        # dropped, the same values (scaled random rows, untouched greedy ones).
        processed = _expected_values(logits.cpu(), state, "processed_logits")
        assert torch.equal(torch.isinf(out.processed.cpu()), torch.isinf(processed))
        torch.testing.assert_close(out.processed.cpu().double(), processed, atol=1e-4, rtol=1e-5)
    else:
        assert out.processed is None
    # Greedy rows take the first argmax of the processed logits in every mode.
    processed = _expected_values(logits.cpu(), state, "processed_logits")
    assert tokens[0] == processed[0].argmax() and tokens[6] == processed[6].argmax()
    if mode == "raw_logits":  # exactly the model's values, not a round trip
        assert torch.equal(
            lp.sampled_logprob.cpu(), logits.cpu().float().gather(1, tokens[:, None])[:, 0]
        )
    if mode == "processed_logprobs":
        # Row 1 keeps 5 tokens (top-k 5), all listed: their probabilities sum to 1.
        top = lp.top_logprobs.cpu()
        assert torch.isneginf(top[1, 5]) and torch.isfinite(top[1, :5]).all()
        assert abs(float(torch.logsumexp(top[1, :5].double(), -1))) < 1e-5
        assert torch.isneginf(top[5, 1:]).all() and top[5, 0] == 0.0  # top-k 1


@pytest.mark.parametrize("path", PATHS)
def test_the_draw_is_the_same_in_every_mode(path, device, triton_backend):
    logits, batch, _ = _case(device, torch.float32, "raw_logprobs", num_logprobs=-1)
    moded = {mode: _case(device, torch.float32, mode)[1] for mode in LOGPROBS_MODES}
    drawn = set()
    # Two steps, so that the random rows draw other tokens than the top one.
    for step in range(2):
        batch.steps = batch.steps + step
        baseline = PATHS[path](logits, batch).token_ids
        drawn.add(tuple(baseline.tolist()))
        for mode, other in moded.items():
            other.steps = batch.steps
            assert torch.equal(PATHS[path](logits, other).token_ids, baseline), (mode, step)
    assert len(drawn) > 1


def test_processed_greedy_rows_are_the_logits_when_nothing_processes_them(device, triton_backend):
    """Without bias, penalties or bitmasks, a mixed batch's greedy rows report the logits
    as they came (the Triton path copies them next to the masked random rows)."""
    logits = random_logits(3, 257, device, seed=9, dtype=torch.float16)
    batch = make_sampling_batch(
        3, device=device, temperature=[0.0, 0.8, 0.0], top_k=[-1, 4, -1], seeds=[1, 2, 3],
        num_logprobs=2, logprobs_mode="processed_logits",
    )  # fmt: skip
    for path in PATHS.values():
        out = path(logits, batch)
        assert torch.equal(out.processed[[0, 2]], logits[[0, 2]].float())
        assert int(torch.isfinite(out.processed[1]).sum()) == 4
        assert torch.equal(out.logprobs.top_logprobs[0], logits[0].float().topk(2).values)


@pytest.mark.parametrize("compute", [compute_logprobs_reference, compute_logprobs_triton])
def test_unnormalized_logprobs_are_the_logits_themselves(compute, device, triton_backend):
    """What prompt logprobs report in the logits modes: the float32 logits, ranked over."""
    logits = random_logits(3, 1100, device, seed=5, dtype=torch.float16)
    logits[0, [3, 900]] = logits[0].max() + 1  # a tie for the top, across blocks
    tokens = torch.tensor([900, 17, 1099], device=device)
    out = compute(logits, tokens, 4, normalized=False)
    x = logits.float()
    assert torch.equal(out.sampled_logprob, x.gather(1, tokens[:, None])[:, 0])
    assert torch.equal(out.sampled_rank, 1 + (x > x.gather(1, tokens[:, None])).sum(-1))
    order = torch.sort(-x.double(), dim=-1, stable=True).indices[:, :4]
    assert torch.equal(out.top_token_ids, order) and out.top_token_ids[0, :2].tolist() == [3, 900]
    assert torch.equal(out.top_logprobs, x.gather(1, order))


def test_an_unknown_mode_is_refused(device):
    logits, batch, _ = _case(device, torch.float32, "processed_logit")
    with pytest.raises(ValueError, match="logprobs mode 'processed_logit' is not one of"):
        sample_reference(logits, batch)
