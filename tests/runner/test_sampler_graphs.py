"""The sampler's race compiled for the CPU (runner/sampler_graphs.py): the same winners as
the eager race, bit for bit, for any row count, with and without the masks' keep tensor,
over a vocabulary that is not a whole number of vectors; refused calls and the sampler's
whole pipeline included. Every test runs under inference mode, as the runner samples, and
checks that the compiled graph, not the eager fallback, took its calls."""

from __future__ import annotations

import logging

import pytest
import torch

from aioserve.kernels.sampling import make_sampling_batch, uniform
from aioserve.kernels.sampling.race import RACE_CUTOFF, race_reference
from aioserve.kernels.sampling.sampler import sample_reference
from aioserve.runner.sampler_graphs import compile_race
from tests.kernels.sampling_references import random_logits

VOCAB = 1031  # a tail past the last 16-lane vector


@pytest.fixture(autouse=True)
def _inference_mode():
    with torch.inference_mode():
        yield


def _compiled_takes(race, s, row_max, keep, keys) -> bool:
    return race.graphs[keep is not None].guard_check(s, row_max, keep, keys)


@pytest.fixture(scope="module")
def race():
    compiled = compile_race(VOCAB)
    assert compiled is not None
    return compiled


def _race_inputs(num_rows: int, seed: int, temperature: float = 1.0):
    s = random_logits(num_rows, VOCAB, torch.device("cpu"), seed=seed, scale=5.0) / temperature
    rows = torch.arange(num_rows)
    keys = uniform._row_key_reference(rows * 7919 + seed, torch.full_like(rows, 3))
    return s, s.amax(-1, keepdim=True), keys


@pytest.mark.parametrize("num_rows", [1, 3, 64])
def test_the_compiled_race_draws_the_eager_winners(race, num_rows):
    s, row_max, keys = _race_inputs(num_rows, seed=num_rows)
    assert (s <= row_max - RACE_CUTOFF).any()  # some tokens are past the cutoff
    expected = race_reference(s, row_max, None, keys, None)
    assert _compiled_takes(race, s, row_max, None, keys)
    assert torch.equal(race(s, row_max, None, keys), expected)
    # The same rows drawn by the dense eager race, without gathering candidates.
    everything = torch.ones_like(s, dtype=torch.bool)
    assert torch.equal(race_reference(s, row_max, everything, keys, None), expected)


def test_the_compiled_race_honours_the_keep_mask(race):
    s, row_max, keys = _race_inputs(8, seed=11, temperature=0.7)
    keep = torch.rand(8, VOCAB, generator=torch.Generator().manual_seed(1)) < 0.6
    keep[0] = False  # nothing kept: token 0, as the Triton kernel gives
    keep[1] = False
    keep[1, 17] = True  # one token kept, not the best
    s[1, 17] = row_max[1] - 3.0
    keep[2, VOCAB - 1] = True  # the last token, in the tail, kept
    assert _compiled_takes(race, s, row_max, keep, keys)
    winners = race(s, row_max, keep, keys)
    assert torch.equal(winners, race_reference(s, row_max, keep, keys, None))
    assert winners[0] == 0 and winners[1] == 17
    assert keep[torch.arange(2, 8), winners[2:]].all()


def test_a_call_its_guards_refuse_runs_the_eager_race(race, caplog):
    s, row_max, keys = _race_inputs(4, seed=5)
    s64, max64 = s.double(), row_max.double()
    assert not _compiled_takes(race, s64, max64, None, keys)
    with caplog.at_level(logging.WARNING, logger="aioserve"):
        winners = race(s64, max64, None, keys)
    assert torch.equal(winners, race_reference(s64, max64, None, keys, None))
    assert "the compiled race refuses torch.float64 scaled logits" in caplog.text


@pytest.mark.parametrize(
    "settings",
    [
        {},  # no mask: the unmasked graph
        {"min_p": 1e-12},  # a mask that keeps nearly every token: the masked graph
    ],
)
def test_the_sampler_draws_the_same_tokens_with_it(race, settings):
    logits = random_logits(16, VOCAB, torch.device("cpu"), seed=23, scale=3.0)
    temperature = [0.0 if row % 4 == 0 else 0.6 + 0.1 * row for row in range(16)]
    batch = make_sampling_batch(
        16, temperature=temperature, seeds=list(range(16)), steps=5, **settings
    )
    calls = []

    def recording(s, row_max, keep, keys):
        calls.append((keep is not None, _compiled_takes(race, s, row_max, keep, keys)))
        return race(s, row_max, keep, keys)

    eager = sample_reference(logits, batch)
    compiled = sample_reference(logits, batch, recording)
    assert calls == [(bool(settings), True)]  # the random rows, in one race
    assert torch.equal(compiled.token_ids, eager.token_ids)


def test_a_later_start_reads_the_filed_graphs_back(race, caplog):
    with caplog.at_level(logging.INFO, logger="aioserve"):
        again = compile_race(VOCAB)
    assert again is not None
    assert "read the compiled graphs of the sampler's race" in caplog.text
    s, row_max, keys = _race_inputs(2, seed=2)
    assert torch.equal(again(s, row_max, None, keys), race(s, row_max, None, keys))
