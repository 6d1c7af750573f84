"""The sampler's masks, penalties and logprobs: Triton kernels (interpreted on the CPU)
against the torch reference, and both against independent computations
(tests/kernels/sampling_references.py); and the compiled runs on a GPU.

Interpreter runs use a few rows and vocabularies of a few hundred tokens; 1100 tokens
where a row must span two blocks (the CPU launch config walks rows 1024 at a time).
"""

from __future__ import annotations

import pytest
import torch

from aioserve.kernels.sampling import (
    SAMPLING_EPS,
    make_sampling_batch,
    masks,
)
from aioserve.kernels.sampling.logprobs import compute_logprobs_reference, compute_logprobs_triton
from aioserve.kernels.sampling.masks import (
    apply_sampling_masks_reference,
    apply_sampling_masks_triton,
)
from aioserve.kernels.sampling.penalties import (
    apply_bias_and_penalties_reference,
    apply_bias_and_penalties_triton,
)
from aioserve.kernels.sampling.sampler import sample_reference, sample_triton
from tests.kernels.sampling_references import (
    INF,
    MIXED_ROWS,
    STAT_CONFIGS,
    STAT_LOGITS,
    assert_frequencies,
    expected_keep,
    frequency_batch,
    mixed_batch,
    penalized_by_loop,
    random_logits,
    select_rows,
)

# ---------------------------------------------------------------------------------------
# Masks
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab_size", [257, 1100])
def test_masks_match_the_definitions_on_both_paths(vocab_size, device, triton_backend):
    batch = mixed_batch(device)
    logits = random_logits(len(MIXED_ROWS), vocab_size, device, seed=vocab_size)
    args = (logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p)
    reference = apply_sampling_masks_reference(*args)
    triton_out = apply_sampling_masks_triton(*args)
    assert torch.equal(triton_out, reference)
    for row, (temperature, top_k, top_p, min_p) in enumerate(MIXED_ROWS):
        if temperature < SAMPLING_EPS:
            assert torch.equal(reference[row], logits[row].float())
            continue
        keep = expected_keep(logits[row].cpu(), temperature, top_k, top_p, min_p)
        assert torch.equal(reference[row].cpu() > -INF, keep), f"row {row}"
        scaled = logits[row].float() / temperature
        assert torch.equal(reference[row][keep], scaled[keep])


def test_mask_ties_at_the_boundary_are_kept(device, triton_backend):
    # Values with exact ties where top-k's k-th value and top-p's threshold fall.
    row = torch.tensor([3.0, 1.0, 2.0, 2.0, 2.0, 0.0, -1.0, 1.0], device=device)
    logits = torch.stack([row, row, row])
    temperature = torch.ones(3, device=device)
    top_k = torch.tensor([3, 2, -1], dtype=torch.int32, device=device)
    top_p = torch.tensor([1.0, 1.0, 0.7], device=device)
    min_p = torch.zeros(3, device=device)
    args = (logits, temperature, top_k, top_p, min_p)
    reference = apply_sampling_masks_reference(*args)
    assert torch.equal(apply_sampling_masks_triton(*args), reference)
    kept = (reference > -INF).cpu()
    expected_top_k = torch.tensor([1, 0, 1, 1, 1, 0, 0, 0], dtype=torch.bool)
    assert torch.equal(kept[0], expected_top_k)  # the 3rd largest (2.0) is tied 3 ways
    assert torch.equal(kept[1], expected_top_k)
    # top_p 0.7: mass above 2.0 is ~0.41 < 0.7, so every 2.0 stays; above 1.0 it's ~0.97.
    assert torch.equal(kept[2], expected_top_k)
    assert torch.equal(kept[2], expected_keep(row.cpu(), 1.0, -1, 0.7, 0.0))


@pytest.mark.parametrize("first_tokens", [1, 8, 256])
def test_top_p_where_a_limit_equals_the_mass_above_a_value_exactly(first_tokens, monkeypatch):
    # Values that are powers of two have masses (2**40 e) that add up exactly, so a limit
    # can equal the mass above a value: a token whose mass above is the limit is dropped,
    # one below it kept. Two rows built so, then random ones, against the definition in
    # Python's integers; the thresholds found among each row's largest values, by bins
    # (one value looked at first: none found there), or some each way.
    monkeypatch.setattr(masks, "_TOP_P_FIRST_TOKENS", first_tokens)
    gen = torch.Generator().manual_seed(3)
    num_rows, vocab_size = 64, 40
    e = 2.0 ** -torch.randint(0, 5, (num_rows, vocab_size), generator=gen).float()
    e[:, 0] = 1.0
    keep = torch.rand((num_rows, vocab_size), generator=gen) < 0.8
    keep[:, 0] = True
    top_p = torch.randint(1, 16, (num_rows,), generator=gen).float() / 16
    keep[:2, 4:] = False
    e[0, :4], top_p[0] = torch.tensor([1.0, 0.5, 0.5, 0.125]), 0.5  # limit: the mass above 0.5
    e[1, :4], top_p[1] = torch.tensor([1.0, 0.5, 0.25, 0.25]), 0.75  # and above 0.25
    keep[:2, :4] = True
    keep[0, 3] = False
    kept = masks._top_p_keep_reference(e, keep, top_p)
    assert kept[0, :4].tolist() == [True, False, False, False]
    assert kept[1, :4].tolist() == [True, True, False, False]
    for row in range(num_rows):
        values = torch.where(keep[row], e[row], 0.0).tolist()
        mass = [int(value * 2**40) for value in values]
        limit = float(sum(mass)) * float(top_p[row])
        expected = [
            k and float(sum(m for m, v in zip(mass, values, strict=True) if v > value)) < limit
            for value, k in zip(values, keep[row].tolist(), strict=True)
        ]
        assert (kept[row] & keep[row]).tolist() == expected, f"row {row}"


@pytest.mark.parametrize("splits", [None, 7])
def test_radix_select_finds_the_references_thresholds_on_hard_rows(splits, device, triton_backend):
    # The kernels' thresholds come from 8 radix passes a row; the reference's from torch's
    # topk and a sort. Rows with many exact ties, banned (-inf) tokens, negative and tiny
    # logits (probabilities near 0, whose bits need every digit), and k and p at their
    # extremes, over a vocabulary that spans several of the kernels' histogram blocks; the
    # rows whole in one program each, and split over 3 (7 asked; tiles of 128 tokens).
    gen = torch.Generator().manual_seed(7)
    vocab_size, num_rows = 300, 12
    tied = torch.randint(-4, 5, (4, vocab_size), generator=gen).float() * 0.5
    spread = torch.randn((4, vocab_size), generator=gen) * 30.0
    banned = torch.randn((4, vocab_size), generator=gen)
    banned[torch.rand((4, vocab_size), generator=gen) < 0.6] = -INF
    logits = torch.cat([tied, spread, banned]).to(device)
    top_k = torch.tensor([1, 2, 150, 299, 5, 1, 300, 64, 3, 7, 0, 119], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.3, 0.99, 0.5, 1e-6, 0.9, 0.999, 0.2, 1.0, 0.6, 0.75, 0.05])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.0, 0.0, 0.2, 0.0, 0.0, 0.0])
    temperature = torch.tensor([1.0, 0.7, 1.3, 1.0, 2.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0, 3.0])
    args = [t.to(device) for t in (temperature, top_k, top_p, min_p)]
    reference = apply_sampling_masks_reference(logits, *args)
    assert torch.equal(apply_sampling_masks_triton(logits, *args, splits=splits), reference)
    for row in range(num_rows):
        keep = expected_keep(
            logits[row].cpu(),
            float(temperature[row]),
            int(top_k[row]),
            float(top_p[row]),
            float(min_p[row]),
        )
        assert torch.equal(reference[row].cpu() > -INF, keep), f"row {row}"


# ---------------------------------------------------------------------------------------
# Bias and penalties
# ---------------------------------------------------------------------------------------


def test_bias_and_penalties_match_a_direct_computation(device, triton_backend):
    num_rows, vocab_size = 4, 300
    generator = torch.Generator().manual_seed(7)
    logits = random_logits(num_rows, vocab_size, device, seed=1, dtype=torch.float16)
    counts = torch.randint(0, 3, (num_rows, vocab_size), generator=generator, dtype=torch.int32)
    prompt_mask = torch.rand(num_rows, vocab_size, generator=generator) < 0.2
    presence = [0.5, 0.0, -1.0, 2.0]
    frequency = [0.1, 0.0, 0.7, -0.5]
    repetition = [1.3, 1.0, 0.8, 2.0]
    # Row 0 lists token 4 twice: both values apply. Row 2 bans two tokens.
    biases = [[(4, 2.0), (9, -1.5), (4, 0.5)], [], [(0, -INF), (299, -INF)], [(17, 3.0)]]
    batch = make_sampling_batch(
        num_rows,
        device=device,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        output_token_counts=counts.to(device),
        prompt_token_mask=prompt_mask.to(device),
    )
    width = max(len(b) for b in biases)
    batch.bias_token_ids = torch.full((num_rows, width), -1, dtype=torch.int64)
    batch.bias_values = torch.zeros((num_rows, width))
    for row, entries in enumerate(biases):
        for slot, (token, value) in enumerate(entries):
            batch.bias_token_ids[row, slot] = token
            batch.bias_values[row, slot] = value
    batch.bias_token_ids = batch.bias_token_ids.to(device)
    batch.bias_values = batch.bias_values.to(device)

    expected = penalized_by_loop(
        logits.float().cpu(), counts, prompt_mask, presence, frequency, repetition, biases
    )
    reference = apply_bias_and_penalties_reference(logits, batch)
    triton_out = apply_bias_and_penalties_triton(logits, batch)
    assert reference.dtype == triton_out.dtype == torch.float32
    torch.testing.assert_close(reference.cpu().double(), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(triton_out, reference)
    assert (reference[2, [0, 299]] == -INF).all()


@pytest.mark.parametrize("with_bias", [False, True])
def test_only_counts_or_only_bias(with_bias, device, triton_backend):
    num_rows, vocab_size = 2, 100
    logits = random_logits(num_rows, vocab_size, device, seed=3)
    counts = torch.zeros(num_rows, vocab_size, dtype=torch.int32, device=device)
    counts[0, 5] = 2
    counts[1, 6] = 1
    batch = make_sampling_batch(
        num_rows,
        device=device,
        presence_penalty=1.0,
        frequency_penalty=0.25,
        output_token_counts=None if with_bias else counts,
        logit_bias=[{3: 1.0}, {8: -INF}] if with_bias else None,
    )
    expected = logits.float().clone()
    if with_bias:
        expected[0, 3] += 1.0
        expected[1, 8] = -INF
    else:
        expected[0, 5] -= 1.0 + 0.5
        expected[1, 6] -= 1.0 + 0.25
    assert torch.equal(apply_bias_and_penalties_reference(logits, batch), expected)
    assert torch.equal(apply_bias_and_penalties_triton(logits, batch), expected)


# ---------------------------------------------------------------------------------------
# Logprobs
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab_size", [300, 1100])
def test_logprobs_match_log_softmax(vocab_size, device, triton_backend):
    num_rows, n = 4, 5
    logits = random_logits(num_rows, vocab_size, device, seed=31)
    logits[0, [10, 20, 30]] = 20.0  # three-way tie for the top: ids in order
    logits[1, [5, 900 % vocab_size]] = logits[1].max() + 1  # tie, possibly across blocks
    tokens = torch.tensor([20, 0, 17, vocab_size - 1], device=device)
    log_softmax = torch.log_softmax(logits.double(), dim=-1)
    for path in (compute_logprobs_reference, compute_logprobs_triton):
        out = path(logits, tokens, n)
        expected_sampled = log_softmax.gather(1, tokens[:, None]).squeeze(1)
        torch.testing.assert_close(
            out.sampled_logprob.double(), expected_sampled, atol=1e-5, rtol=0
        )
        rank = 1 + (logits > logits.gather(1, tokens[:, None])).sum(-1)
        assert torch.equal(out.sampled_rank, rank)
        assert out.sampled_rank[0] == 1  # tied with the top: nothing strictly higher
        order = torch.sort(-logits.double(), dim=-1, stable=True).indices[:, :n]
        assert torch.equal(out.top_token_ids, order)
        torch.testing.assert_close(
            out.top_logprobs.double(), log_softmax.gather(1, order), atol=1e-5, rtol=0
        )
        assert out.top_token_ids[0, :3].tolist() == [10, 20, 30]


def test_sample_returns_raw_logprobs(device, triton_backend):
    logits = random_logits(3, 200, device, seed=37)
    batch = make_sampling_batch(
        3,
        device=device,
        temperature=[0.0, 0.5, 1.0],
        top_k=[-1, 3, -1],
        seeds=[1, 2, 3],
        num_logprobs=0,
        logit_bias=[{0: 100.0}, {}, {}],
    )
    for path in (sample_reference, sample_triton):
        out = path(logits, batch)
        assert out.token_ids[0] == 0  # the bias decides the token ...
        raw = torch.log_softmax(logits.float(), dim=-1)
        expected = raw.gather(1, out.token_ids[:, None]).squeeze(1)
        # ... but logprobs are those of the unprocessed logits.
        torch.testing.assert_close(out.logprobs.sampled_logprob, expected, atol=1e-5, rtol=0)
        assert out.logprobs.top_token_ids.shape == (3, 0)


def test_empty_batch(device, triton_backend):
    logits = torch.empty(0, 50, device=device)
    batch = make_sampling_batch(0, device=device, num_logprobs=2)
    for path in (sample_reference, sample_triton):
        out = path(logits, batch)
        assert out.token_ids.shape == (0,)
        assert out.logprobs.top_token_ids.shape == (0, 2)


# ---------------------------------------------------------------------------------------
# Compiled on a GPU, at real vocabulary sizes.
# ---------------------------------------------------------------------------------------

GPU_VOCAB = 151_936


@pytest.mark.gpu
def test_gpu_large_vocab_paths_agree(triton_backend):
    device = torch.device("cuda")
    num_rows = 64
    # float32 logits: bfloat16's many exact ties would turn a last-bit difference in exp
    # (Triton's GPU exp is not torch's) into whole tie groups on the other side of a mask.
    logits = random_logits(num_rows, GPU_VOCAB, device, seed=41, scale=4.0)
    batch = mixed_batch(device, num_rows, seeds=list(range(num_rows)), steps=3, num_logprobs=20)
    triton_out = sample_triton(logits, batch)
    reference = sample_reference(logits, batch)
    # exp differs in the last bits, which can flip a near-tie: almost every row agrees.
    same = (triton_out.token_ids == reference.token_ids).float().mean().item()
    assert same >= 0.95
    greedy = batch.temperature < SAMPLING_EPS
    assert torch.equal(triton_out.token_ids[greedy], logits.argmax(-1)[greedy])
    masks = (batch.temperature, batch.top_k, batch.top_p, batch.min_p)
    kept_triton = apply_sampling_masks_triton(logits, *masks) > -INF
    kept_reference = apply_sampling_masks_reference(logits, *masks) > -INF
    assert (kept_triton != kept_reference).sum().item() <= 8
    lp_t, lp_r = triton_out.logprobs, compute_logprobs_reference(logits, triton_out.token_ids, 20)
    assert torch.equal(lp_t.top_token_ids, lp_r.top_token_ids)
    assert torch.equal(lp_t.sampled_rank, lp_r.sampled_rank)
    torch.testing.assert_close(lp_t.top_logprobs, lp_r.top_logprobs, atol=1e-4, rtol=0)


@pytest.mark.gpu
def test_gpu_bf16_greedy_and_logprobs(triton_backend):
    device = torch.device("cuda")
    logits = random_logits(16, GPU_VOCAB, device, seed=53, dtype=torch.bfloat16)
    batch = make_sampling_batch(16, device=device, temperature=0.0, num_logprobs=5)
    out = sample_triton(logits, batch)
    assert torch.equal(out.token_ids, logits.float().argmax(-1))  # first of tied maxima
    expected = compute_logprobs_reference(logits, out.token_ids, 5)
    assert torch.equal(out.logprobs.top_token_ids, expected.top_token_ids)
    torch.testing.assert_close(out.logprobs.top_logprobs, expected.top_logprobs, atol=1e-4, rtol=0)


@pytest.mark.gpu
def test_gpu_penalties_and_bias_are_exact(triton_backend):
    device = torch.device("cuda")
    num_rows = 32
    logits = random_logits(num_rows, GPU_VOCAB, device, seed=43, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(1)
    counts = torch.randint(0, 3, (num_rows, GPU_VOCAB), generator=generator, dtype=torch.int32)
    bias = [{i * 7: -INF, i * 11 + 1: 5.0} for i in range(num_rows)]
    batch = make_sampling_batch(
        num_rows,
        device=device,
        presence_penalty=0.3,
        frequency_penalty=0.2,
        repetition_penalty=1.2,
        output_token_counts=counts.to(device),
        prompt_token_mask=(torch.rand(num_rows, GPU_VOCAB, generator=generator) < 0.01).to(device),
        logit_bias=bias,
    )
    assert torch.equal(
        apply_bias_and_penalties_triton(logits, batch),
        apply_bias_and_penalties_reference(logits, batch),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("config", STAT_CONFIGS)
def test_gpu_draw_frequencies_match_the_distribution(config, triton_backend):
    device = torch.device("cuda")
    draws = 20_000
    padded = STAT_LOGITS + [-INF] * (4096 - len(STAT_LOGITS))  # a vocabulary wider than 10
    logits = torch.tensor(padded, device=device).expand(draws, -1).contiguous()
    tokens = sample_triton(logits, frequency_batch(config, draws, device)).token_ids.cpu()
    assert tokens.max() < len(STAT_LOGITS)
    assert_frequencies(tokens, config, draws)


@pytest.mark.gpu
def test_gpu_batch_invariance_at_scale(triton_backend):
    device = torch.device("cuda")
    logits = random_logits(48, GPU_VOCAB, device, seed=47, dtype=torch.bfloat16)
    batch = mixed_batch(device, 48, seeds=list(range(48)), steps=9)
    together = sample_triton(logits, batch).token_ids
    for row in (0, 13, 47):
        alone = sample_triton(logits[row : row + 1], select_rows(batch, [row])).token_ids
        assert alone.item() == together[row].item()
