"""The sampler: Triton kernels (interpreted on the CPU) against the torch reference, and
both against independent computations written here from the definitions.

Interpreter runs use a few rows and vocabularies of a few hundred tokens; 1100 tokens
where a row must span two blocks (the CPU launch config walks rows 1024 at a time).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from aioserve.kernels.sampling import (
    SAMPLING_EPS,
    make_sampling_batch,
    masks,
    sample,
    sampler,
    uniform,
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

INF = float("inf")

# (temperature, top_k, top_p, min_p) per row: every mask alone, together, and none.
MIXED_ROWS = [
    (1.0, -1, 1.0, 0.0),
    (0.7, 5, 1.0, 0.0),
    (1.3, -1, 0.8, 0.0),
    (1.0, -1, 1.0, 0.1),
    (0.5, 40, 0.9, 0.05),
    (2.0, 1, 1.0, 0.0),
    (1.0, 0, 0.3, 0.0),  # top_k 0: no top-k
    (0.0, 3, 0.5, 0.5),  # greedy: masks ignored
]


def _mixed_batch(device, num_rows=None, **kwargs):
    num_rows = len(MIXED_ROWS) if num_rows is None else num_rows
    rows = [MIXED_ROWS[i % len(MIXED_ROWS)] for i in range(num_rows)]
    temperature, top_k, top_p, min_p = (list(column) for column in zip(*rows, strict=True))
    return make_sampling_batch(
        num_rows,
        device=device,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        **kwargs,
    )


def _select_rows(batch, rows):
    """The batch of just `rows` (a list of row indices), in that order."""
    index = torch.tensor(rows, device=batch.temperature.device)
    per_row = {
        field: getattr(batch, field)[index]
        for field in (
            "temperature",
            "top_k",
            "top_p",
            "min_p",
            "seeds",
            "steps",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        )
    }
    greedy = per_row["temperature"] < SAMPLING_EPS
    return dataclasses.replace(
        batch, **per_row, all_greedy=bool(greedy.all()), all_random=not bool(greedy.any())
    )


def _logits(num_rows, vocab_size, device, seed=0, scale=3.0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab_size, generator=generator) * scale
    return logits.to(device=device, dtype=dtype)


# ---------------------------------------------------------------------------------------
# Independent computations, straight from the definitions (float64, sorts, loops).
# ---------------------------------------------------------------------------------------


def _expected_keep(logits_row, temperature, top_k, top_p, min_p):
    """Which tokens survive min-p, top-k and top-p, by the definitions in float64."""
    s = logits_row.double() / temperature
    probs = torch.softmax(s, dim=0)
    keep = probs >= min_p * probs.max()
    vocab_size = s.numel()
    if 0 < top_k < vocab_size:
        kth = torch.sort(s, descending=True).values[top_k - 1]
        keep &= s >= kth
    if top_p < 1.0:
        p = torch.where(keep, probs, 0.0)
        p = p / p.sum()
        strictly_above = (p[None, :] * (p[None, :] > p[:, None])).sum(dim=1)
        keep &= strictly_above < top_p
    return keep


def _expected_distribution(logits_row, temperature, top_k, top_p, min_p):
    keep = _expected_keep(logits_row, temperature, top_k, top_p, min_p)
    probs = torch.softmax(logits_row.double() / temperature, dim=0) * keep
    return probs / probs.sum(), keep


def _penalized_by_loop(logits, counts, prompt_mask, presence, frequency, repetition, biases):
    out = logits.double().clone()
    num_rows, vocab_size = logits.shape
    for row in range(num_rows):
        for token, value in biases[row]:
            out[row, token] += value
        for token in range(vocab_size):
            x = out[row, token].item()
            count = int(counts[row, token])
            if count > 0 or bool(prompt_mask[row, token]):
                x = x / repetition[row] if x > 0 else x * repetition[row]
            x -= frequency[row] * count
            x -= presence[row] * (1.0 if count > 0 else 0.0)
            out[row, token] = x
    return out


# ---------------------------------------------------------------------------------------
# Masks
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab_size", [257, 1100])
def test_masks_match_the_definitions_on_both_paths(vocab_size, device, triton_backend):
    batch = _mixed_batch(device)
    logits = _logits(len(MIXED_ROWS), vocab_size, device, seed=vocab_size)
    args = (logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p)
    reference = apply_sampling_masks_reference(*args)
    triton_out = apply_sampling_masks_triton(*args)
    assert torch.equal(triton_out, reference)
    for row, (temperature, top_k, top_p, min_p) in enumerate(MIXED_ROWS):
        if temperature < SAMPLING_EPS:
            assert torch.equal(reference[row], logits[row].float())
            continue
        keep = _expected_keep(logits[row].cpu(), temperature, top_k, top_p, min_p)
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
    assert torch.equal(kept[2], _expected_keep(row.cpu(), 1.0, -1, 0.7, 0.0))


# ---------------------------------------------------------------------------------------
# Bias and penalties
# ---------------------------------------------------------------------------------------


def test_bias_and_penalties_match_a_direct_computation(device, triton_backend):
    num_rows, vocab_size = 4, 300
    generator = torch.Generator().manual_seed(7)
    logits = _logits(num_rows, vocab_size, device, seed=1, dtype=torch.float16)
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

    expected = _penalized_by_loop(
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
    logits = _logits(num_rows, vocab_size, device, seed=3)
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
# Sampling
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_greedy_is_the_first_argmax(dtype, device, triton_backend):
    num_rows, vocab_size = 3, 1100
    logits = _logits(num_rows, vocab_size, device, seed=5, dtype=dtype)
    logits[1, 1050] = 50.0  # the maximum in the second block
    logits[2, 7] = logits[2, 1030] = 50.0  # tied maxima in two blocks: the first wins
    batch = make_sampling_batch(num_rows, device=device, temperature=0.0)
    expected = torch.argmax(logits.float(), dim=-1)
    assert expected[2] == 7
    for path in (sample_reference, sample_triton):
        out = path(logits, batch)
        assert out.logprobs is None
        assert out.token_ids.dtype == torch.int64
        assert torch.equal(out.token_ids, expected)


def test_paths_draw_identical_tokens(device, triton_backend):
    num_rows = 2 * len(MIXED_ROWS)
    logits = _logits(num_rows, 300, device, seed=11)
    original = logits.clone()
    seeds = [0, 1, -1, 2**62, -(2**63), 12345, 7, 7, 99, 3, 4, 5, 6, 8, 9, 10]
    for step in (0, 1000):
        batch = _mixed_batch(device, num_rows, seeds=seeds, steps=step)
        reference = sample_reference(logits, batch).token_ids
        assert torch.equal(sample_triton(logits, batch).token_ids, reference)
    assert torch.equal(logits, original)  # the sampler leaves its input alone


def test_paths_agree_on_a_two_block_vocabulary(device, triton_backend):
    logits = _logits(len(MIXED_ROWS), 1100, device, seed=13, scale=2.0)
    batch = _mixed_batch(device, seeds=list(range(100, 100 + len(MIXED_ROWS))), steps=5)
    reference = sample_reference(logits, batch).token_ids
    assert torch.equal(sample_triton(logits, batch).token_ids, reference)


def test_draws_stay_in_the_mask_and_vary_with_seed_and_step(device):
    num_rows = 64
    logits = _logits(1, 500, device, seed=17).expand(num_rows, -1)
    for knobs in ({"top_k": 3}, {"top_p": 0.6}, {"min_p": 0.3}):
        by_seed = make_sampling_batch(num_rows, device=device, seeds=list(range(num_rows)), **knobs)
        by_step = make_sampling_batch(num_rows, device=device, steps=list(range(num_rows)), **knobs)
        masked = apply_sampling_masks_reference(
            logits, by_seed.temperature, by_seed.top_k, by_seed.top_p, by_seed.min_p
        )
        kept = masked[0] > -INF
        assert 1 < int(kept.sum()) < 500
        for batch in (by_seed, by_step):
            tokens = sample_reference(logits, batch).token_ids
            assert kept[tokens].all()
            assert len(set(tokens.tolist())) > 1
            assert torch.equal(tokens, sample_reference(logits, batch).token_ids)


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_a_row_draws_the_same_alone_and_in_a_batch(path, device, request):
    if path == "triton":
        request.getfixturevalue("triton_backend")
    num_rows, vocab_size = 6, 200
    logits = _logits(num_rows, vocab_size, device, seed=19)
    batch = make_sampling_batch(
        num_rows,
        device=device,
        temperature=[0.8, 1.0, 0.0, 1.5, 0.6, 1.0],
        top_k=[-1, 20, -1, -1, 5, 50],
        top_p=[1.0, 0.9, 1.0, 0.7, 1.0, 0.95],
        min_p=[0.0, 0.0, 0.0, 0.02, 0.1, 0.0],
        seeds=[3, 1, 4, 1, 5, 9],
        steps=[0, 2, 6, 5, 3, 5],
    )
    together = sample(logits, batch).token_ids
    for row in (1, 3):
        alone = sample(logits[row : row + 1], _select_rows(batch, [row])).token_ids
        assert alone.item() == together[row].item()
    order = [5, 3, 1, 4, 2, 0]
    shuffled = sample(logits[order], _select_rows(batch, order)).token_ids
    assert torch.equal(shuffled, together[order])


def test_paths_agree_when_every_row_has_a_small_top_k(device, triton_backend):
    # The reference then samples within the top-k tokens only.
    logits = _logits(5, 600, device, seed=59)
    batch = make_sampling_batch(
        5,
        device=device,
        temperature=[1.0, 0.7, 1.5, 1.0, 0.9],
        top_k=[50, 1, 20, 599, 7],
        top_p=[1.0, 1.0, 0.6, 0.9, 0.95],
        min_p=[0.0, 0.0, 0.0, 0.01, 0.2],
        seeds=[8, 9, 10, 11, 12],
        steps=4,
    )
    reference = sample_reference(logits, batch).token_ids
    assert torch.equal(sample_triton(logits, batch).token_ids, reference)


def _general_and_top_k_draws(s, top_k, top_p, min_p, device):
    num_rows = s.shape[0]
    row_max = s.amax(-1, keepdim=True)
    top_k = torch.tensor(top_k, dtype=torch.int32, device=device)
    top_p = torch.tensor(top_p, device=device)
    min_p = torch.tensor(min_p, device=device)
    keys = uniform._row_key_reference(
        torch.arange(num_rows, device=device), torch.full((num_rows,), 2, device=device)
    )
    keep = masks._keep_mask_reference(s, row_max, top_k, top_p, min_p)
    general = sampler._race_reference(s, row_max, keep, keys)
    within = sampler._sample_within_top_k_reference(s, row_max, top_k, top_p, min_p, keys)
    return general, within


def test_the_top_k_shortcut_matches_the_general_path(device):
    generator = torch.Generator().manual_seed(61)
    num_rows = 256
    s = _logits(num_rows, 2000, device, seed=61, scale=1.0)
    top_k = torch.randint(1, 30, (num_rows,), generator=generator).tolist()
    top_p = [1.0 if i % 3 == 0 else 0.5 + 0.5 * i / num_rows for i in range(num_rows)]
    min_p = [0.0 if i % 2 else 0.05 for i in range(num_rows)]
    general, within = _general_and_top_k_draws(s, top_k, top_p, min_p, device)
    assert torch.equal(within, general)


def test_the_top_k_shortcut_steps_aside_for_ties_past_k(device):
    s = torch.tensor([[4.0, 3.0, 2.0, 2.0, 2.0, 1.0], [4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    # k = 3 in row 0 ends inside a three-way tie: all of it is kept, not just 3 tokens.
    _, within = _general_and_top_k_draws(s.to(device), [3, 3], [1.0, 1.0], [0.0, 0.0], device)
    assert within is None
    _, within = _general_and_top_k_draws(s[1:].to(device), [3], [1.0], [0.0], device)
    assert within is not None


def test_dense_and_sparse_races_agree(device):
    logits = _logits(8, 3000, device, seed=23)
    s = logits / 0.9
    row_max = s.amax(-1, keepdim=True)
    keys = uniform._row_key_reference(
        torch.arange(8, device=device), torch.full((8,), 3, device=device)
    )
    candidates = s > row_max - sampler._RACE_CUTOFF
    candidates[0, :] = False
    candidates[0, logits[0].argmax()] = True  # a row with one candidate
    candidates[1] &= torch.rand(3000, generator=torch.Generator().manual_seed(0)) < 0.5
    dense = sampler._race_dense_reference(s, row_max, candidates, keys)
    sparse = sampler._race_sparse_reference(s, row_max, candidates, keys)
    assert torch.equal(dense, sparse)
    assert dense[0] == logits[0].argmax()


def test_the_race_cutoff_skips_only_tokens_that_cannot_win(device):
    # The dense race over every token must pick the same winners as over the candidates.
    logits = _logits(16, 400, device, seed=29, scale=6.0)
    s = logits / 0.5
    row_max = s.amax(-1, keepdim=True)
    rows = torch.arange(16, device=device)
    keys = uniform._row_key_reference(rows, torch.zeros_like(rows))
    candidates = s > row_max - sampler._RACE_CUTOFF
    assert not candidates.all()  # the cutoff does drop tokens here
    everything = torch.ones_like(candidates)
    assert torch.equal(
        sampler._race_dense_reference(s, row_max, everything, keys),
        sampler._race_dense_reference(s, row_max, candidates, keys),
    )


def _chi_square(counts, expected_probs, draws):
    kept = expected_probs > 0
    expected = expected_probs[kept] * draws
    return float(((counts[kept] - expected) ** 2 / expected).sum()), int(kept.sum()) - 1


# Configurations for the statistical test on a 10-token vocabulary (tokens 2 and 7 tie).
STAT_LOGITS = [2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 1.0, 0.25, -2.0]
STAT_CONFIGS = [
    (1.0, -1, 1.0, 0.0),
    (0.5, 4, 1.0, 0.0),
    (1.5, -1, 0.8, 0.0),
    (1.0, -1, 1.0, 0.2),
    (0.8, 6, 0.9, 0.05),
]


@pytest.mark.parametrize("config", STAT_CONFIGS)
def test_draw_frequencies_match_the_distribution(config, device):
    draws = 20_000
    temperature, top_k, top_p, min_p = config
    logits = torch.tensor(STAT_LOGITS, device=device).expand(draws, -1)
    batch = make_sampling_batch(
        draws,
        device=device,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seeds=2024,
        steps=list(range(draws)),
    )
    tokens = sample_reference(logits, batch).token_ids.cpu()
    _assert_frequencies(tokens, config, draws)


def _assert_frequencies(tokens, config, draws):
    probs, keep = _expected_distribution(torch.tensor(STAT_LOGITS), *config)
    counts = torch.bincount(tokens, minlength=len(STAT_LOGITS)).double()
    assert counts[~keep].sum() == 0, "a masked token was drawn"
    statistic, degrees = _chi_square(counts, probs, draws)
    # The draws are a fixed function of the seeds, so this cannot flake; the bound is
    # the chi-square quantile at p = 1e-6 for up to 9 degrees of freedom.
    assert statistic < 45.0, (statistic, degrees, counts.tolist())


def test_uniforms_are_uniform_and_independent():
    # 64 consecutive steps of one seed, 4096 consecutive token ids.
    keys = uniform._row_key_reference(torch.full((64,), 77), torch.arange(64))
    u = uniform._uniform_reference(keys[:, None], torch.arange(4096)).double()
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 2e-3
    histogram = torch.histc(u.flatten(), bins=16, min=0, max=1)
    expected = u.numel() / 16
    assert float(((histogram - expected) ** 2 / expected).sum()) < 60.0
    # Neighbouring token ids, and neighbouring steps, are uncorrelated (|r| ~ 1/sqrt(n)).
    for a, b in ((u[:, :-1], u[:, 1:]), (u[:-1], u[1:])):
        r = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]
        assert abs(r.item()) < 0.01


# ---------------------------------------------------------------------------------------
# Logprobs
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab_size", [300, 1100])
def test_logprobs_match_log_softmax(vocab_size, device, triton_backend):
    num_rows, n = 4, 5
    logits = _logits(num_rows, vocab_size, device, seed=31)
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
    logits = _logits(3, 200, device, seed=37)
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
    logits = _logits(num_rows, GPU_VOCAB, device, seed=41, scale=4.0)
    batch = _mixed_batch(device, num_rows, seeds=list(range(num_rows)), steps=3, num_logprobs=20)
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
    logits = _logits(16, GPU_VOCAB, device, seed=53, dtype=torch.bfloat16)
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
    logits = _logits(num_rows, GPU_VOCAB, device, seed=43, dtype=torch.bfloat16)
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
    temperature, top_k, top_p, min_p = config
    padded = STAT_LOGITS + [-INF] * (4096 - len(STAT_LOGITS))  # a vocabulary wider than 10
    logits = torch.tensor(padded, device=device).expand(draws, -1).contiguous()
    batch = make_sampling_batch(
        draws,
        device=device,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seeds=2024,
        steps=list(range(draws)),
    )
    tokens = sample_triton(logits, batch).token_ids.cpu()
    assert tokens.max() < len(STAT_LOGITS)
    _assert_frequencies(tokens, config, draws)


@pytest.mark.gpu
def test_gpu_batch_invariance_at_scale(triton_backend):
    device = torch.device("cuda")
    logits = _logits(48, GPU_VOCAB, device, seed=47, dtype=torch.bfloat16)
    batch = _mixed_batch(device, 48, seeds=list(range(48)), steps=9)
    together = sample_triton(logits, batch).token_ids
    for row in (0, 13, 47):
        alone = sample_triton(logits[row : row + 1], _select_rows(batch, [row])).token_ids
        assert alone.item() == together[row].item()
