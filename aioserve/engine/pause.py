"""Pausing generation: vLLM 0.32's pause_generation, resume_generation and is_paused, which
RL frameworks call on a server around pushing new weights into it.

A pause stops the scheduler from starting requests; what becomes of those in flight is
the pause's mode (vLLM's PauseMode):

    "abort"  they end now with finish_reason "abort" (the engine aborts them, then pauses)
    "wait"   the running ones go on to their end; the pause is complete once they have
    "keep"   nothing is scheduled at all: running and waiting requests stay where they are

In every mode a request that arrives while paused is queued, not refused, and waits with
the requests that were waiting (or preempted) until the resume, as in vLLM; the engine
loop parks meanwhile, so the engine stays healthy. A pause is complete once nothing it
lets run is left and no step is in flight: the loop, parking, settles the pauses waiting
for that (`completion`). What follows (vLLM's `clear_cache`) is the engine's:
async_engine.py.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from typing import Literal, get_args

from aioserve.engine.scheduler import Scheduler

logger = logging.getLogger("aioserve")

PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[str, ...] = get_args(PauseMode)


class PauseState(enum.Enum):
    """vLLM's scheduler pause states."""

    UNPAUSED = "unpaused"
    PAUSED_NEW = "paused_new"  # "abort" and "wait": the running requests go on, none start
    PAUSED_ALL = "paused_all"  # "keep": nothing is scheduled


class Pause:
    """The engine's pause state, and the pauses waiting to be complete."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self.state = PauseState.UNPAUSED
        self._completions: list[asyncio.Future[None]] = []

    @property
    def paused(self) -> bool:
        return self.state is not PauseState.UNPAUSED

    def begin(self, mode: PauseMode) -> None:
        """Pause (again) in `mode`: no request starts until `end`."""
        self._set(PauseState.PAUSED_ALL if mode == "keep" else PauseState.PAUSED_NEW)

    def end(self) -> None:
        """Resume: the queued requests may start again."""
        self._set(PauseState.UNPAUSED)

    def _set(self, state: PauseState) -> None:
        logger.info("setting pause state to %s", state.name)  # vLLM's scheduler's line
        self.state = state
        self._scheduler.admitting = state is PauseState.UNPAUSED

    def has_work(self) -> bool:
        """Whether the loop has a step to schedule: the scheduler's unfinished requests,
        less those the pause holds back."""
        scheduler = self._scheduler
        if self.state is PauseState.UNPAUSED:
            return scheduler.has_unfinished()
        return self.state is PauseState.PAUSED_NEW and bool(scheduler.running)

    def completion(self) -> asyncio.Future[None]:
        """A future done when the loop next parks (or stops): the pause is then complete.
        The caller wakes the loop, which may be parked already."""
        future = asyncio.get_running_loop().create_future()
        self._completions.append(future)
        return future

    def settle(self) -> None:
        """The loop parks or stops: every pause waiting is complete."""
        completions, self._completions = self._completions, []
        for future in completions:
            if not future.done():  # its caller may have gone (a cancelled handler)
                future.set_result(None)
