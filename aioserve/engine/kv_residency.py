"""--kv-cache-metrics: how long sampled KV blocks live, sit idle and wait to be reused.

vLLM 0.32's block-residency sampling, on aioserve's block pool (kv_cache_manager.py):

- each time a block is taken from the free queue it is sampled with probability
  --kv-cache-metrics-sample (a fresh draw per allocation; an unsampled allocation leaves
  nothing behind, a sampled one starts a record at that moment);
- each prefix-cache hit that shares a sampled block is an access: the record keeps the
  times of its last four accesses;
- with prefix caching on, a sampled block taken again from the free queue is evicted: its
  record becomes one observation (lifetime: allocation to eviction; idle: last access, or
  the allocation if none, to eviction; reuse gaps: between consecutive kept accesses) just
  before the new allocation is sampled. With prefix caching off vLLM never evicts, so
  there are no observations either;
- resetting the prefix cache forgets every record and the observations not yet reported.

The engine drains the observations with each step's statistics (stats.py); the server
turns them into vLLM's three histograms (server/observability_metrics.py).
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

ACCESSES_KEPT = 4
"""Accesses a record remembers (vLLM's ring buffer): at most three reuse gaps."""


@dataclass(frozen=True)
class ResidencySample:
    """One sampled block's residency, reported when it was evicted. Seconds."""

    lifetime: float
    idle: float
    reuse_gaps: tuple[float, ...]


class _Record:
    __slots__ = ("born", "last_access", "accesses")

    def __init__(self, now: int) -> None:
        self.born = now
        self.last_access = now
        self.accesses: deque[int] = deque(maxlen=ACCESSES_KEPT)


class BlockResidencyTracker:
    """Samples block allocations and turns sampled evictions into ResidencySamples.

    `clock` (nanoseconds) and `rng` (a draw in [0, 1)) are there for tests."""

    def __init__(
        self,
        sample_rate: float,
        *,
        clock: Callable[[], int] = time.monotonic_ns,
        rng: Callable[[], float] = random.random,
    ) -> None:
        if not 0 < sample_rate <= 1:
            raise ValueError(f"the sample rate must be in (0, 1], got {sample_rate}")
        self.sample_rate = sample_rate
        self._clock = clock
        self._rng = rng
        self._records: dict[int, _Record] = {}
        self._samples: list[ResidencySample] = []

    @property
    def num_tracked(self) -> int:
        """Blocks with a record now (at most the pool's size)."""
        return len(self._records)

    def allocated(self, block_id: int) -> None:
        if self._rng() < self.sample_rate:
            self._records[block_id] = _Record(self._clock())

    def accessed(self, block_id: int) -> None:
        record = self._records.get(block_id)
        if record is not None:
            now = self._clock()
            record.last_access = now
            record.accesses.append(now)

    def evicted(self, block_id: int) -> None:
        record = self._records.pop(block_id, None)
        if record is None:
            return
        now = self._clock()
        accesses = record.accesses
        gaps = tuple((b - a) / 1e9 for a, b in zip(accesses, list(accesses)[1:], strict=False))
        self._samples.append(
            ResidencySample((now - record.born) / 1e9, (now - record.last_access) / 1e9, gaps)
        )

    def reset(self) -> None:
        self._records.clear()
        self._samples.clear()

    def drain(self) -> list[ResidencySample]:
        """The observations since the last drain."""
        samples, self._samples = self._samples, []
        return samples
