"""A model step between its launch and its result, as the engine loop keeps track of it.

The loop queues each prepared step on the model thread (`run_timed`) and keeps a
`StepInFlight` until the step's tokens are recorded: with asynchronous scheduling two of
them at once (engine_loop.py). `StepWaiter` waits for each in turn.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from aioserve.engine.scheduler import SchedulerOutput
from aioserve.engine.step_observation import StepObservation
from aioserve.engine.step_timing import StepTimer, StepTiming
from aioserve.engine.structured_outputs.step_masks import StepMasks
from aioserve.runner.model_runner import ModelRunner, PreparedStep, StepOutput


@dataclass
class ExecutedStep:
    """A step back from the model thread, with when it started and ended there."""

    output: StepOutput
    started: float
    ended: float
    timing: StepTiming | None = None  # --collect-detailed-traces (step_timing.py)


# How long the engine loop may go on from one finished step to the next without letting the
# event loop's other tasks (the requests' consumers, the HTTP handlers) run.
RUN_AHEAD_S = 0.01


@dataclass
class StepInFlight:
    index: int  # in launch order
    scheduled: SchedulerOutput
    future: Future  # of an ExecutedStep, from the model thread
    started: threading.Event  # set by the model thread as it begins the step
    masks: StepMasks | None  # its structured-output masks, filled before it samples
    observed: StepObservation | None = None  # the observability flags' view of it


def run_timed(
    runner: ModelRunner,
    prepared: PreparedStep,
    started_event: threading.Event,
    timer: StepTimer | None = None,
) -> ExecutedStep:
    """On the model thread: run the step, noting when it started and ended, and with a
    `timer` (--collect-detailed-traces) what it measures."""
    started = time.monotonic()
    started_event.set()
    if timer is None:
        output = runner.execute(prepared)
        return ExecutedStep(output, started, time.monotonic())
    output, timing = timer.run(runner, prepared)
    return ExecutedStep(output, started, time.monotonic(), timing)


class StepWaiter:
    """Waits for the steps in flight, letting the event loop's other tasks run meanwhile,
    except when the step is done already: then the device is waiting for the host, and the
    consumers wait instead, up to `run_ahead_s` after they last had their turn. Their
    outputs meanwhile merge (output_stream.py), so that a host that cannot keep up with the
    steps builds and delivers one output per request for several steps, not one per step.
    """

    def __init__(self, run_ahead_s: float = RUN_AHEAD_S) -> None:
        self.run_ahead_s = run_ahead_s
        self._others_ran = time.monotonic()

    async def result(self, step: StepInFlight) -> ExecutedStep:
        """The step's result (or its error, raised)."""
        future = step.future
        if not future.done() or time.monotonic() - self._others_ran >= self.run_ahead_s:
            await asyncio.wrap_future(future)
            self._others_ran = time.monotonic()
        return future.result()
