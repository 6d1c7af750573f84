"""The time a model step spends in the model's forward pass (--collect-detailed-traces model).

vLLM V0 timed its model runner's forward with CUDA events (`model_forward_time`, in
milliseconds, turned into seconds in the request's span). Here a `ForwardTimer` times the
calls that run the model in a step on the model thread:

- a generative model (`ModelRunner`): `ModelStep.forward_and_logits` (the layers and the
  output head, or the one graph of a one-row step), `ModelStep.forward` and
  `ModelStep.logits` where the runner calls them apart (a padded decode step, prompt
  logprobs), and `DecodeGraphs.run` (a decode step replayed from its CUDA/HIP graph, with
  the copy of its few inputs into the graph's buffers);
- a pooling model (`PoolingRunner`): the encoder's forward.

A call made inside another timed call (the forward inside forward_and_logits) is not
counted twice. The timer counts only between `arm` and `take`, which the engine calls
around each step (engine/step_timing.py): warm-up, compilation and graph capture are never
timed. On the CPU it reads time.perf_counter; on a GPU it records a pair of timing events
around each call, read once the step is done.

`install_forward_timer` wraps those methods on the runner's own objects, so that a server
without the flag runs the very same calls as before, at no cost.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch

Mark = float | torch.cuda.Event
"""A point in time: time.perf_counter() on the CPU, a recorded timing event on a GPU."""


def mark(events: bool) -> Mark:
    """Now: a timing event recorded on the current stream if `events`, else perf_counter()."""
    if not events:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def elapsed(intervals: list[tuple[Mark, Mark]]) -> float:
    """The intervals' total, in seconds; the device's work up to the last one must be
    queued already (it is waited for)."""
    if not intervals:
        return 0.0
    if isinstance(intervals[0][0], float):
        return sum(end - start for start, end in intervals)
    intervals[-1][1].synchronize()
    return sum(start.elapsed_time(end) for start, end in intervals) / 1000.0


class ForwardTimer:
    """The forward passes of one step at a time, timed on the model thread."""

    def __init__(self, device: torch.device) -> None:
        self._events = device.type != "cpu"
        self._armed = False
        self._open: Mark | None = None  # the start of the timed call now running
        self._intervals: list[tuple[Mark, Mark]] = []

    def arm(self) -> None:
        """A step begins: its forward passes are timed from now."""
        self._armed, self._open, self._intervals = True, None, []

    def take(self) -> list[tuple[Mark, Mark]]:
        """The step ends: the intervals it spent in forward passes; timing stops."""
        self._armed = False
        intervals, self._intervals = self._intervals, []
        return intervals

    def timed(self, call: Callable[..., Any]) -> Callable[..., Any]:
        """`call`, timed when a step is armed and no timed call is running already."""

        @functools.wraps(call)
        def timed_call(*args: Any, **kwargs: Any) -> Any:
            if not self._armed or self._open is not None:
                return call(*args, **kwargs)
            self._open = mark(self._events)
            try:
                return call(*args, **kwargs)
            finally:
                self._intervals.append((self._open, mark(self._events)))
                self._open = None

        return timed_call


def install_forward_timer(runner: object, device: torch.device) -> ForwardTimer | None:
    """A ForwardTimer around the calls of `runner` that run its model (see the module's
    docstring); None for a runner without a model (the tests' stand-in)."""
    timer = ForwardTimer(device)
    model_step = getattr(runner, "model_step", None)
    if model_step is not None:  # a ModelRunner
        for name in ("forward_and_logits", "forward", "logits"):
            setattr(model_step, name, timer.timed(getattr(model_step, name)))
        graphs = getattr(runner, "decode_graphs", None)
        if graphs is not None:
            graphs.run = timer.timed(graphs.run)
        return timer
    model = getattr(runner, "model", None)
    if isinstance(model, torch.nn.Module):  # a PoolingRunner
        model.forward = timer.timed(model.forward)
        return timer
    return None
