"""The sampler's draws: greedy and seeded random sampling on both paths, batch invariance,
the top-k shortcut and the race between tokens, and the statistics of the draws.
"""

from __future__ import annotations

import pytest
import torch

from aioserve.kernels.sampling import (
    make_sampling_batch,
    masks,
    race,
    sample,
    sampler,
    uniform,
)
from aioserve.kernels.sampling.masks import (
    apply_sampling_masks_reference,
)
from aioserve.kernels.sampling.sampler import sample_reference, sample_triton
from tests.kernels.sampling_references import (
    INF,
    MIXED_ROWS,
    STAT_CONFIGS,
    STAT_LOGITS,
    assert_frequencies,
    frequency_batch,
    mixed_batch,
    random_logits,
    select_rows,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_greedy_is_the_first_argmax(dtype, device, triton_backend):
    num_rows, vocab_size = 3, 1100
    logits = random_logits(num_rows, vocab_size, device, seed=5, dtype=dtype)
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


@pytest.mark.parametrize("vocab_size", [100, 3 * 1024, 3 * 1024 + 17])
def test_the_first_argmax_in_chunks_is_argmaxs_first_index(vocab_size):
    # Maxima in a chunk, in the tail, tied across chunks or with the tail, NaN and all -inf.
    x = torch.randn(9, vocab_size, generator=torch.Generator().manual_seed(vocab_size))
    last = vocab_size - 1
    x[1, 1500 % vocab_size] = 9.0
    x[2, last] = 9.0
    x[3, 5] = x[3, last] = 9.0
    x[4, last] = x[4, 2100 % vocab_size] = 9.0
    x[5, 1030 % vocab_size] = float("nan")
    x[6, 3] = x[6, last] = float("nan")
    x[7] = float("-inf")
    x[8, last] = float("nan")
    expected = [torch.argmax(torch.nan_to_num(row, nan=float("inf"))).item() for row in x]
    assert race.first_argmax(x).tolist() == expected
    assert race.first_argmax(x.t().contiguous().t()).tolist() == expected  # strided rows


def test_paths_draw_identical_tokens(device, triton_backend):
    num_rows = 2 * len(MIXED_ROWS)
    logits = random_logits(num_rows, 300, device, seed=11)
    original = logits.clone()
    seeds = [0, 1, -1, 2**62, -(2**63), 12345, 7, 7, 99, 3, 4, 5, 6, 8, 9, 10]
    for step in (0, 1000):
        batch = mixed_batch(device, num_rows, seeds=seeds, steps=step)
        reference = sample_reference(logits, batch).token_ids
        assert torch.equal(sample_triton(logits, batch).token_ids, reference)
    assert torch.equal(logits, original)  # the sampler leaves its input alone


def test_paths_agree_on_a_two_block_vocabulary(device, triton_backend):
    logits = random_logits(len(MIXED_ROWS), 1100, device, seed=13, scale=2.0)
    batch = mixed_batch(device, seeds=list(range(100, 100 + len(MIXED_ROWS))), steps=5)
    reference = sample_reference(logits, batch).token_ids
    assert torch.equal(sample_triton(logits, batch).token_ids, reference)


def test_draws_stay_in_the_mask_and_vary_with_seed_and_step(device):
    num_rows = 64
    logits = random_logits(1, 500, device, seed=17).expand(num_rows, -1)
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
    logits = random_logits(num_rows, vocab_size, device, seed=19)
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
        alone = sample(logits[row : row + 1], select_rows(batch, [row])).token_ids
        assert alone.item() == together[row].item()
    order = [5, 3, 1, 4, 2, 0]
    shuffled = sample(logits[order], select_rows(batch, order)).token_ids
    assert torch.equal(shuffled, together[order])


def test_paths_agree_when_every_row_has_a_small_top_k(device, triton_backend):
    # The reference then samples within the top-k tokens only.
    logits = random_logits(5, 600, device, seed=59)
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
    general = race.race_reference(s, row_max, keep, keys, None)
    within = sampler._sample_within_top_k_reference(s, row_max, top_k, top_p, min_p, keys)
    return general, within


def test_the_top_k_shortcut_matches_the_general_path(device):
    generator = torch.Generator().manual_seed(61)
    num_rows = 256
    s = random_logits(num_rows, 2000, device, seed=61, scale=1.0)
    top_k = torch.randint(1, 30, (num_rows,), generator=generator).tolist()
    top_p = [1.0 if i % 3 == 0 else 0.5 + 0.5 * i / num_rows for i in range(num_rows)]
    min_p = [0.0 if i % 2 else 0.05 for i in range(num_rows)]
    general, within = _general_and_top_k_draws(s, top_k, top_p, min_p, device)
    assert torch.equal(within, general)


def test_the_top_k_shortcut_keeps_ties_past_k_and_steps_aside_for_too_many(device):
    s = torch.tensor([[4.0, 3.0, 2.0, 2.0, 2.0, 1.0], [4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    # k = 3 in row 0 ends inside a three-way tie: all of it is kept, not just 3 tokens.
    general, within = _general_and_top_k_draws(s.to(device), [3, 3], [1.0, 1.0], [0.0, 0.0], device)
    assert within is not None and torch.equal(within, general)
    # A tie at the k-th value wider than the room topk takes past k: the general path.
    wide = torch.zeros(1, 200)
    wide[0, 0] = 1.0
    _, within = _general_and_top_k_draws(wide.to(device), [3], [1.0], [0.0], device)
    assert within is None


def test_dense_and_sparse_races_agree(device):
    logits = random_logits(8, 3000, device, seed=23)
    s = logits / 0.9
    row_max = s.amax(-1, keepdim=True)
    keys = uniform._row_key_reference(
        torch.arange(8, device=device), torch.full((8,), 3, device=device)
    )
    candidates = s > row_max - race.RACE_CUTOFF
    candidates[0, :] = False
    candidates[0, logits[0].argmax()] = True  # a row with one candidate
    candidates[1] &= torch.rand(3000, generator=torch.Generator().manual_seed(0)) < 0.5
    dense = race.race_dense_reference(s, row_max, candidates, keys)
    sparse = race.race_sparse_reference(s, row_max, candidates, keys)
    assert torch.equal(dense, sparse)
    assert dense[0] == logits[0].argmax()


def test_the_race_cutoff_skips_only_tokens_that_cannot_win(device):
    # The dense race over every token must pick the same winners as over the candidates.
    logits = random_logits(16, 400, device, seed=29, scale=6.0)
    s = logits / 0.5
    row_max = s.amax(-1, keepdim=True)
    rows = torch.arange(16, device=device)
    keys = uniform._row_key_reference(rows, torch.zeros_like(rows))
    candidates = s > row_max - race.RACE_CUTOFF
    assert not candidates.all()  # the cutoff does drop tokens here
    everything = torch.ones_like(candidates)
    assert torch.equal(
        race.race_dense_reference(s, row_max, everything, keys),
        race.race_dense_reference(s, row_max, candidates, keys),
    )


@pytest.mark.parametrize("config", STAT_CONFIGS)
def test_draw_frequencies_match_the_distribution(config, device):
    draws = 20_000
    logits = torch.tensor(STAT_LOGITS, device=device).expand(draws, -1)
    tokens = sample_reference(logits, frequency_batch(config, draws, device)).token_ids.cpu()
    assert_frequencies(tokens, config, draws)


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
