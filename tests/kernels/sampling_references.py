"""Shared by the sampler tests: batches of mixed settings, random logits, and what the
sampler must compute, written here straight from the definitions (float64, sorts, loops)."""

from __future__ import annotations

import dataclasses

import torch

from aioserve.kernels.sampling import (
    SAMPLING_EPS,
    make_sampling_batch,
)

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


def mixed_batch(device, num_rows=None, **kwargs):
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


def select_rows(batch, rows):
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


def random_logits(num_rows, vocab_size, device, seed=0, scale=3.0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab_size, generator=generator) * scale
    return logits.to(device=device, dtype=dtype)


# ---------------------------------------------------------------------------------------
# Independent computations, straight from the definitions (float64, sorts, loops).
# ---------------------------------------------------------------------------------------


def expected_keep(logits_row, temperature, top_k, top_p, min_p):
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


def expected_distribution(logits_row, temperature, top_k, top_p, min_p):
    keep = expected_keep(logits_row, temperature, top_k, top_p, min_p)
    probs = torch.softmax(logits_row.double() / temperature, dim=0) * keep
    return probs / probs.sum(), keep


def penalized_by_loop(logits, counts, prompt_mask, presence, frequency, repetition, biases):
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


def chi_square(counts, expected_probs, draws):
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


def frequency_batch(config, draws: int, device: torch.device):
    """A batch of `draws` rows with one STAT_CONFIGS setting, each row its own draw."""
    temperature, top_k, top_p, min_p = config
    return make_sampling_batch(
        draws,
        device=device,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seeds=2024,
        steps=list(range(draws)),
    )


def assert_frequencies(tokens, config, draws):
    probs, keep = expected_distribution(torch.tensor(STAT_LOGITS), *config)
    counts = torch.bincount(tokens, minlength=len(STAT_LOGITS)).double()
    assert counts[~keep].sum() == 0, "a masked token was drawn"
    statistic, degrees = chi_square(counts, probs, draws)
    # The draws are a fixed function of the seeds, so this cannot flake; the bound is
    # the chi-square quantile at p = 1e-6 for up to 9 degrees of freedom.
    assert statistic < 45.0, (statistic, degrees, counts.tolist())
