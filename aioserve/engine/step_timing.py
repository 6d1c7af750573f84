"""--collect-detailed-traces: each step's model times, added to the requests that ran in it.

vLLM's flag (model, worker, all; it needs --otlp-traces-endpoint) was filled by its V0
engine (vLLM 0.9.2): the driver worker timed each step, and the engine added the step's
figures to every sequence group scheduled in it (`seq_group.metrics.model_forward_time`,
`.model_execute_time`), which its request span then reported as
gen_ai.latency.time_in_model_forward and gen_ai.latency.time_in_model_execute, in seconds
(the forward was timed in milliseconds by CUDA events and divided by 1000; the execute in
seconds by perf_counter). vLLM 0.32 declares the flag and the attribute names but no
longer fills them. Here, as in V0:

- model: the time of the step's forward passes (runner/forward_timer.py: the model's
  layers and its output head);
- worker: the time of the whole `execute` of the step on the model thread: the slot and
  input copies to the device, the forward, prompt logprobs, the sampler and the copies of
  its results back. On a GPU, where `execute` only queues that work, two timing events
  around it measure the device's span from the step's first work to its last.

A request's figures are the sums over the steps it had a sequence in (a request with n
samples counts each step once), in RequestMetrics.model_forward_time and
.model_execute_time (seconds; None when not collected), which server/tracing.py puts in
the span. Where V0's execute also built the step's inputs, here that host work is
`runner.prepare`, on the event loop while the step before runs, and is not counted.

Without the flag the engine makes no StepTimer and runs each step as before; the timing
events and clock reads are made only for the flag's modules.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from aioserve.runner.forward_timer import ForwardTimer, Mark, elapsed, install_forward_timer, mark

if TYPE_CHECKING:
    from aioserve.engine.outputs import RequestMetrics


@dataclass
class StepTiming:
    """What one step's timers recorded on the model thread, read once the step is done."""

    forward: list[tuple[Mark, Mark]] | None  # None: not collected
    execute: tuple[Mark, Mark] | None

    def add_to(self, requests: Iterable[RequestMetrics]) -> None:
        """Add the step's times, in seconds, to each of the requests that ran in it."""
        forward = None if self.forward is None else elapsed(self.forward)
        execute = None if self.execute is None else elapsed([self.execute])
        for metrics in requests:
            if forward is not None:
                metrics.model_forward_time = (metrics.model_forward_time or 0.0) + forward
            if execute is not None:
                metrics.model_execute_time = (metrics.model_execute_time or 0.0) + execute


class StepTimer:
    """Runs steps on the model thread, timing what --collect-detailed-traces asks for."""

    def __init__(self, runner: Any, device: torch.device, *, forward: bool, execute: bool) -> None:
        self._events = device.type != "cpu"
        self.forward: ForwardTimer | None = None
        if forward:
            self.forward = install_forward_timer(runner, device)
        self.execute = execute

    def run(self, runner: Any, prepared: Any) -> tuple[Any, StepTiming]:
        """On the model thread: `runner.execute(prepared)` and its timing."""
        forward = self.forward
        if forward is not None:
            forward.arm()
        started = mark(self._events) if self.execute else None
        try:
            output = runner.execute(prepared)
        finally:
            intervals = forward.take() if forward is not None else None
        execute = (started, mark(self._events)) if started is not None else None
        return output, StepTiming(intervals, execute)


def step_timer(
    runner: Any, device: torch.device, *, forward: bool, execute: bool
) -> StepTimer | None:
    """The StepTimer of the modules asked for; None when neither is (nothing is timed)."""
    if not (forward or execute):
        return None
    return StepTimer(runner, device, forward=forward, execute=execute)
