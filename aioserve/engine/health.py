"""The engine's judgement of its own health: which step failures kill it, and what a stall is.

Failures. A step that fails while it is prepared or run is taken to be its requests'
fault: they end with the error and the engine goes on. It is the engine's, and the engine
dies, when the error says the device or the process is broken (a device error such as a
CUDA illegal memory access, which leaves the context unusable; MemoryError, SystemError,
EngineDeadError, the model thread gone), or when `MAX_FAILED_STEPS_IN_A_ROW` steps fail one
after the other with no step completing between them: each failure ends its requests, so
the next step carries others, and the fault is not theirs. A step launched before a
failure was handled may fail because of it (with asynchronous scheduling it may decode
tokens the failed step never sampled): it does not count.

Stalls. While the engine loop has work it goes round once per step. It is stalled when it
has not gone round for longer than `LoopClock.limit` (or the model thread has run one step
that long): `STALL_STEPS` times the longest of the last steps, at least `floor`
(`STALL_FLOOR_S`), since a step may be slow, but not twenty times slower than its peers.
An idle engine, parked until a request comes, is healthy however long it waits.
"""

from __future__ import annotations

from collections import deque

import torch

from aioserve.engine.model_thread import ModelThreadLost

MAX_FAILED_STEPS_IN_A_ROW = 3
STALL_FLOOR_S = 30.0
STALL_STEPS = 20
_RECENT_STEPS = 64


class EngineDeadError(RuntimeError):
    """The engine stopped after an error that was not one request's; no request can run."""


# Errors after which no step can be trusted, whichever requests were in it.
_FATAL_STEP_ERRORS: tuple[type[BaseException], ...] = (
    EngineDeadError,
    ModelThreadLost,
    MemoryError,
    SystemError,
    *((torch.AcceleratorError,) if hasattr(torch, "AcceleratorError") else ()),
)


def death_message(error: BaseException) -> str:
    """What the requests of an engine that died of `error` are told."""
    return str(error) if isinstance(error, EngineDeadError) else f"the engine died: {error!r}"


class StepFailures:
    """Numbers the steps as they are launched and decides whose fault a failed one is."""

    def __init__(self) -> None:
        self.launched = 0  # the next step's index
        self.in_a_row = 0
        self._fresh_from = 0  # steps launched before this may fail because of the last failure

    def launch(self) -> int:
        """The index of a step being launched."""
        index = self.launched
        self.launched += 1
        return index

    def completed(self) -> None:
        self.in_a_row = 0

    def failed(self, index: int, error: BaseException, what: str) -> None:
        """Count the failure of step `index`; raise EngineDeadError if it is the engine's."""
        if index >= self._fresh_from:
            self.in_a_row += 1
            self._fresh_from = self.launched
        if isinstance(error, _FATAL_STEP_ERRORS) or not isinstance(error, Exception):
            raise EngineDeadError(f"{what}: {error!r}") from error
        if self.in_a_row >= MAX_FAILED_STEPS_IN_A_ROW:
            raise EngineDeadError(
                f"{self.in_a_row} model steps in a row failed, the last with {error!r}"
            ) from error


class LoopClock:
    """When the engine loop last went round, and how long it may go without."""

    def __init__(self, floor: float = STALL_FLOOR_S) -> None:
        self.floor = floor
        self.parked = True  # waiting for work, or not running: not a stall
        self.last_tick = 0.0
        self.step_seconds: deque[float] = deque(maxlen=_RECENT_STEPS)

    @property
    def limit(self) -> float:
        return max(self.floor, STALL_STEPS * max(self.step_seconds, default=0.0))

    def stall(self, now: float, step_started: float | None) -> str | None:
        """What is stalled at `now` (the model thread busy since `step_started`), if anything."""
        limit = self.limit
        if step_started is not None and now - step_started > limit:
            return (
                f"a model step has run for {now - step_started:.1f} s (the limit is {limit:.1f} s)"
            )
        if not self.parked and now - self.last_tick > limit:
            return (
                f"the engine loop has not gone round for {now - self.last_tick:.1f} s "
                f"(the limit is {limit:.1f} s)"
            )
        return None
