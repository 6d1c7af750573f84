"""--kv-cache-metrics on the block pool, against a brute-force tracker written here.

The reference watches the KV cache manager from the outside only: which blocks each
allocation put in a request's table, which of them came from a prefix-cache hit, and a
clock the test advances. It applies vLLM 0.32's rule (kv_cache_metrics.py + block_pool.py):
a block taken from the free queue is sampled by one draw; a hit on a sampled block is an
access (the last four kept); with prefix caching on, taking a sampled block again evicts it,
giving (lifetime, idle, reuse gaps).
"""

from __future__ import annotations

import random

import pytest

from aioserve.engine.kv_cache_manager import KVCacheManager
from aioserve.engine.kv_residency import BlockResidencyTracker, ResidencySample
from aioserve.engine.request import Request
from aioserve.engine.sampling_params import SamplingParams

BLOCK_SIZE = 4


class Clock:
    def __init__(self) -> None:
        self.ns = 1_000_000_000

    def __call__(self) -> int:
        return self.ns


class Draws:
    """The tracker's random draws, recorded so that the reference sees the same ones."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.log: list[float] = []

    def __call__(self) -> float:
        draw = self.rng.random()
        self.log.append(draw)
        return draw


class Reference:
    def __init__(self, rate: float, caching: bool) -> None:
        self.rate, self.caching = rate, caching
        self.records: dict[int, tuple[int, list[int]]] = {}  # block -> (born, accesses)
        self.samples: list[ResidencySample] = []

    def taken(self, block: int, now: int, draw: float) -> None:
        if self.caching and block in self.records:
            born, accesses = self.records.pop(block)
            last = accesses[-1] if accesses else born
            kept = accesses[-4:]
            gaps = tuple((b - a) / 1e9 for a, b in zip(kept, kept[1:], strict=False))
            self.samples.append(ResidencySample((now - born) / 1e9, (now - last) / 1e9, gaps))
        if draw < self.rate:
            self.records[block] = (now, [])

    def hit(self, block: int, now: int) -> None:
        if block in self.records:
            self.records[block][1].append(now)


def _request(request_id: str, prompt: list[int]) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=64),
        seed=0,
        eos_token_ids=frozenset(),
        max_tokens=64,
    )


def _run(seed: int, rate: float, caching: bool, steps: int = 400):
    rng = random.Random(seed)
    clock, draws = Clock(), Draws(seed)
    tracker = BlockResidencyTracker(rate, clock=clock, rng=draws)
    kv = KVCacheManager(24, BLOCK_SIZE, enable_prefix_caching=caching, residency=tracker)
    reference = Reference(rate, caching)
    prefixes = [[rng.randrange(1, 5) for _ in range(12)] for _ in range(3)]
    running: dict[str, Request] = {}
    observed: list[ResidencySample] = []
    for step in range(steps):
        clock.ns += rng.randrange(1, 5_000_000)
        action = rng.random()
        if action < 0.45 and len(running) < 5:
            prompt = rng.choice(prefixes)[: rng.randrange(5, 13)] + [rng.randrange(1, 9)] * 3
            request = _request(f"r{step}", prompt)
            cached = kv.find_cached_prefix(request)
            before = len(draws.log)
            if not kv.allocate(request, request.num_tokens - len(cached) * BLOCK_SIZE, cached):
                continue
            for block in cached:
                reference.hit(block, clock.ns)
            new_blocks = kv.block_table(request.request_id)[len(cached) :]
            assert len(draws.log) - before == len(new_blocks)
            for block, draw in zip(new_blocks, draws.log[before:], strict=True):
                reference.taken(block, clock.ns, draw)
            request.num_computed_tokens = request.num_tokens
            kv.cache_full_blocks(request, request.num_tokens)
            running[request.request_id] = request
        elif action < 0.75 and running:  # a decode step of one request
            request = running[rng.choice(sorted(running))]
            request.output_token_ids.append(rng.randrange(1, 9))
            table = list(kv.block_table(request.request_id))
            before = len(draws.log)
            if not kv.allocate(request, 1):
                continue
            new_blocks = kv.block_table(request.request_id)[len(table) :]
            for block, draw in zip(new_blocks, draws.log[before:], strict=True):
                reference.taken(block, clock.ns, draw)
            request.num_computed_tokens += 1
            kv.cache_full_blocks(request, request.num_computed_tokens)
        elif running:
            kv.free(running.pop(rng.choice(sorted(running))))
        if rng.random() < 0.3:
            observed += tracker.drain()
    observed += tracker.drain()
    for request in running.values():
        kv.free(request)
    assert kv.num_free_blocks == kv.num_blocks
    return observed, reference, tracker


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("rate", [1.0, 0.35])
def test_sampled_residencies_match_a_brute_force_tracker(seed, rate):
    observed, reference, tracker = _run(seed, rate, caching=True)
    assert observed == reference.samples
    assert len(observed) > 5
    if rate == 1.0:
        assert any(sample.reuse_gaps for sample in observed)  # prefix hits were seen
    assert max(len(sample.reuse_gaps) for sample in observed) <= 3
    assert tracker.num_tracked == len(reference.records) <= 24


def test_without_prefix_caching_nothing_is_observed_as_in_vllm():
    observed, reference, tracker = _run(0, 1.0, caching=False)
    assert observed == reference.samples == []
    assert 0 < tracker.num_tracked <= 24  # bounded by the pool: a block keeps one record


def test_the_sample_rate_is_the_share_of_allocations_followed():
    tracker = BlockResidencyTracker(0.25, rng=random.Random(7).random)
    for block in range(4000):
        tracker.allocated(block)
    assert 0.22 < tracker.num_tracked / 4000 < 0.28


def test_resetting_the_prefix_cache_forgets_records_and_pending_samples():
    clock = Clock()
    tracker = BlockResidencyTracker(1.0, clock=clock)
    kv = KVCacheManager(2, BLOCK_SIZE, enable_prefix_caching=True, residency=tracker)
    first = _request("a", [1, 2, 3, 4, 5])
    assert kv.allocate(first, 5)
    kv.free(first)
    second = _request("b", [6, 7, 8, 9, 10])
    assert kv.allocate(second, 5)  # takes both blocks back: two evictions
    kv.free(second)
    assert tracker.num_tracked == 2
    assert kv.reset_prefix_cache()
    assert tracker.num_tracked == 0 and tracker.drain() == []


def test_one_sampled_block_life_in_seconds():
    clock = Clock()
    tracker = BlockResidencyTracker(1.0, clock=clock)
    tracker.allocated(3)
    for step_ms in (10, 30, 60, 100, 150):  # five hits: the last four are kept
        clock.ns += step_ms * 1_000_000
        tracker.accessed(3)
    clock.ns += 500_000_000
    tracker.evicted(3)
    tracker.evicted(3)  # no record left: nothing more
    (sample,) = tracker.drain()
    assert sample.lifetime == pytest.approx(0.85)
    assert sample.idle == pytest.approx(0.5)
    assert sample.reuse_gaps == pytest.approx((0.06, 0.1, 0.15))


@pytest.mark.parametrize("rate", [0.0, -0.1, 1.5])
def test_a_rate_outside_zero_to_one_is_refused(rate):
    with pytest.raises(ValueError, match="sample rate"):
        BlockResidencyTracker(rate)
