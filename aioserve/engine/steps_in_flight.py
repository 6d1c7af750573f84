"""A model step between its launch and its result, as the engine loop keeps track of it.

The loop queues each prepared step on the model thread (`run_timed`) and keeps a
`StepInFlight` until the step's tokens are recorded: with asynchronous scheduling two of
them at once (async_engine.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

from aioserve.engine.scheduler import SchedulerOutput
from aioserve.engine.structured_outputs.step_masks import StepMasks
from aioserve.runner.model_runner import ModelRunner, PreparedStep, StepOutput


@dataclass
class ExecutedStep:
    """A step back from the model thread, with when it started and ended there."""

    output: StepOutput
    started: float
    ended: float


@dataclass
class StepInFlight:
    index: int  # in launch order
    scheduled: SchedulerOutput
    future: asyncio.Future  # of an ExecutedStep
    started: threading.Event  # set by the model thread as it begins the step
    masks: StepMasks | None  # its structured-output masks, filled before it samples


def run_timed(
    runner: ModelRunner, prepared: PreparedStep, started_event: threading.Event
) -> ExecutedStep:
    """On the model thread: run the step, noting when it started and ended."""
    started = time.monotonic()
    started_event.set()
    output = runner.execute(prepared)
    return ExecutedStep(output, started, time.monotonic())
