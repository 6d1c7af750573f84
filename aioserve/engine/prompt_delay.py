"""--scheduler-delay-factor: waiting prompts held back while requests run, as vLLM V0's.

vLLM 0.9.2's V0 scheduler (`Scheduler._passed_delay`, vllm/core/scheduler.py) applies "a
delay (of delay factor multiplied by previous prompt latency) before scheduling next
prompt", so that prompts arriving one after another while others decode start together,
in fewer prompt steps, instead of one step each. With a factor F > 0 a waiting prompt is
admitted into a step only when

- nothing is running (no delay then: the device would idle), or
- the oldest waiting request (by arrival; a preempted one counts from its arrival too) has
  waited longer than F times the last prompt latency.

The rule is checked before each admission of the step, against the oldest request still
waiting, so that a prompt that arrived just now does not start beside an old one that
passed the delay. The last prompt latency is V0's: from the `schedule()` of the latest
step that admitted prompts to the first `schedule()` after that step's results were
recorded. Without asynchronous scheduling (the CPU's default) that is V0's measure, from
one scheduling to the next, the step's execution and output processing included; with it,
the step scheduled in between does not cut the measure short. Until a prompt step has
been measured the latency is 0: a waiting prompt then starts at the next step.

Where it differs from V0: V0's chunked-prefill scheduler took the sequences it scheduled
out of its running queue before it looked at the waiting one, so "nothing is running"
held whenever every running sequence fit in the step, and the delay only applied when
some did not. Here it means what it says: no request was running when the step began.

A factor of 0 (the default) makes no PromptDelay: the scheduler runs as without the flag.
The clock is injectable (time.monotonic, the requests' arrival clock, by default), so that
tests step time by hand.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aioserve.engine.request import Request


class PromptDelay:
    """The scheduler's record of prompt steps, and the rule that holds prompts back."""

    def __init__(self, factor: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not factor > 0:
            raise ValueError(f"the delay factor must be greater than 0, got {factor!r}")
        self.factor = factor
        self.clock = clock
        self.last_prompt_latency = 0.0
        self._prompt_step: object | None = None  # the latest step that admitted prompts
        self._prompt_step_at = 0.0  # when it was scheduled
        self._prompt_step_done = False  # its results are recorded

    def step_begins(self) -> float:
        """At the start of `schedule()`: now, by the clock; the latency of the last prompt
        step is taken if its results came in since."""
        now = self.clock()
        if self._prompt_step_done:
            self.last_prompt_latency = now - self._prompt_step_at
            self._prompt_step, self._prompt_step_done = None, False
        return now

    def admits(self, now: float, waiting: Iterable[Request], running: bool) -> bool:
        """Whether a waiting prompt may start now, given the requests still waiting and
        whether any request was running when the step began."""
        if not running:
            return True
        oldest = min(request.arrival_time for request in waiting)
        return now - oldest > self.factor * self.last_prompt_latency

    def prompts_admitted(self, step: object, now: float) -> None:
        """The step scheduled at `now` admitted prompts: its latency is measured next."""
        self._prompt_step, self._prompt_step_at, self._prompt_step_done = step, now, False

    def step_recorded(self, step: object) -> None:
        """A step's results were recorded (`Scheduler.update`)."""
        if step is self._prompt_step:
            self._prompt_step_done = True


def prompt_delay(factor: float, clock: Callable[[], float] = time.monotonic) -> PromptDelay | None:
    """The PromptDelay of --scheduler-delay-factor `factor`; None for 0 (no delay)."""
    return PromptDelay(factor, clock) if factor > 0 else None
