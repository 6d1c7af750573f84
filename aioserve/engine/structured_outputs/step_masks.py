"""Each step's structured-output masks, from the matchers of its constrained sequences.

The engine plans a step's masks when it launches the step (`StepMasks.plan`) and fills
them once every token sampled before the step has reached the matchers: at once when no
step is in flight, else right after the step before it has returned its tokens — while
this step's forward pass runs, so that with asynchronous scheduling the device does not
wait for the host. A matcher that allows no token at all is a dead end: its row allows
every token (the sample is dropped) and the engine ends the request.

A request that reasons first (`SamplingParams.reasoning_end`) keeps its constraint closed
until its output text contains the end of its reasoning (`ReasoningGate`): until then its
rows allow every token and its tokens do not reach the matcher. The gate is checked when
the masks are filled, so a step planned before the reasoning ended is still constrained
from the token after it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from aioserve.engine.request import Request
from aioserve.engine.scheduler import SchedulerOutput
from aioserve.runner.step_plan import TokenBitmask

logger = logging.getLogger("aioserve")


@dataclass
class StepMasks:
    bitmask: TokenBitmask
    requests: list[Request]  # the sequence of each row of `bitmask`

    @classmethod
    def plan(cls, output: SchedulerOutput, vocab_size: int) -> StepMasks | None:
        """The masks the step needs (None: no sampling row is constrained), set on its plan."""
        rows, requests = [], []
        sampling_row = 0
        for chunk in output.chunks:
            if not chunk.samples:
                continue
            if chunk.request.matcher is not None:
                rows.append(sampling_row)
                requests.append(chunk.request)
            sampling_row += 1
        if not rows:
            return None
        masks = cls(TokenBitmask(rows, vocab_size), requests)
        output.plan.token_bitmask = masks.bitmask
        return masks

    def fill(self) -> list[Request]:
        """Fill every row and hand the masks to the runner; returns the dead ends."""
        dead_ends = []
        for words, request in zip(self.bitmask.words, self.requests, strict=True):
            if request.status.is_finished or request.reasoning_gate is not None:
                words.fill(-1)  # its sample will be dropped, or it is still reasoning
                continue
            try:
                request.matcher.fill_bitmask(words)
            except Exception:  # the request's own failure: it ends, the engine goes on
                logger.exception("request %s: its structured output failed", request.request_id)
                words.fill(0)
            if not words.any():
                words.fill(-1)
                dead_ends.append(request)
        self.bitmask.set_ready()
        return dead_ends

    def abandon(self) -> None:
        """The step will never get its masks (the engine stops): its sampling fails."""
        self.bitmask.abandon()


class ReasoningGate:
    """Holds a constraint back until the output's reasoning ends with `marker`."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self._scanned = 0  # how much of the text has been searched

    def ended(self, text: str) -> bool:
        start = max(0, self._scanned - len(self.marker) + 1)
        self._scanned = len(text)
        return text.find(self.marker, start) >= 0


def advance_constraint(request: Request, token_ids: list[int], text: Callable[[], str]) -> bool:
    """Take a constrained sequence's new tokens: open its reasoning gate once `text()` (its
    output so far) ends the reasoning, else advance its matcher. False when a token breaks
    the constraint."""
    gate = request.reasoning_gate
    if gate is not None:
        if gate.ended(text()):
            request.reasoning_gate = None  # the tokens that ended it are reasoning
        return True
    matcher = request.matcher
    try:
        return all(matcher.accept(token_id) for token_id in token_ids)
    except Exception:  # the request's own failure: it ends, the engine goes on
        logger.exception("request %s: its structured output failed", request.request_id)
        return False
