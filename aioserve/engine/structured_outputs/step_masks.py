"""Each step's structured-output masks, from the matchers of its constrained sequences.

The engine plans a step's masks when it launches the step (`StepMasks.plan`) and fills
them once every token sampled before the step has reached the matchers: at once when no
step is in flight, else right after the step before it has returned its tokens — while
this step's forward pass runs, so that with asynchronous scheduling the device does not
wait for the host. A matcher that allows no token at all is a dead end: its row allows
every token (the sample is dropped) and the engine ends the request.

A sequence with drafts (speculative decoding, which schedules synchronously, so that its
matcher has taken every token before) samples one row a position: row j + 1 allows what
the constraint allows after drafts 0..j, found by advancing the matcher through them and
rolling it back. A row's draw is kept only while the draws before it equal the drafts, so
a draft its own row refuses ends the walk: the rows after it are never kept, and allow
every token. (A row after a draft that is a dead end allows every token too: its draw, if
kept, breaks the constraint and the engine ends the request with that error.)

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
from typing import TYPE_CHECKING

import numpy as np

from aioserve.engine.request import Request
from aioserve.engine.scheduler import SchedulerOutput
from aioserve.runner.step_plan import TokenBitmask

if TYPE_CHECKING:  # the backends load with the first constraint (compiler.py)
    from aioserve.engine.structured_outputs.matchers import Matcher

logger = logging.getLogger("aioserve")


@dataclass
class StepMasks:
    bitmask: TokenBitmask
    requests: list[Request]  # the constrained sequences, in batch order
    drafts: list[list[int]]  # each one's drafts: its rows are its first and one a draft

    @classmethod
    def plan(cls, output: SchedulerOutput, vocab_size: int) -> StepMasks | None:
        """The masks the step needs (None: no sampling row is constrained), set on its plan."""
        rows, requests, drafts = [], [], []
        sampling_row = 0
        for chunk in output.chunks:
            if not chunk.samples:
                continue
            num_rows = 1 + len(chunk.drafts)
            if chunk.request.matcher is not None:
                rows.extend(range(sampling_row, sampling_row + num_rows))
                requests.append(chunk.request)
                drafts.append(chunk.drafts)
            sampling_row += num_rows
        if not rows:
            return None
        masks = cls(TokenBitmask(rows, vocab_size), requests, drafts)
        output.plan.token_bitmask = masks.bitmask
        return masks

    def fill(self) -> list[Request]:
        """Fill every row and hand the masks to the runner; returns the dead ends."""
        dead_ends = []
        first = 0
        for request, drafts in zip(self.requests, self.drafts, strict=True):
            rows = self.bitmask.words[first : first + 1 + len(drafts)]
            first += len(rows)
            if request.status.is_finished or request.reasoning_gate is not None:
                rows.fill(-1)  # its sample will be dropped, or it is still reasoning
                continue
            try:
                request.matcher.fill_bitmask(rows[0])
                if rows[0].any():
                    fill_draft_rows(request.matcher, rows, drafts)
            except Exception:  # the request's own failure: it ends, the engine goes on
                logger.exception("request %s: its structured output failed", request.request_id)
                rows[0].fill(0)
            if not rows[0].any():
                rows.fill(-1)
                dead_ends.append(request)
        self.bitmask.set_ready()
        return dead_ends

    def abandon(self) -> None:
        """The step will never get its masks (the engine stops): its sampling fails."""
        self.bitmask.abandon()


def fill_draft_rows(matcher: Matcher, rows: np.ndarray, drafts: list[int]) -> None:
    """Fill rows 1.. of a sequence with drafts (row 0 is filled): row j + 1 from the matcher
    advanced by drafts 0..j, as far as each draft is allowed by its own row; then the
    matcher is rolled back to where it was."""
    accepted = 0
    try:
        for j, draft in enumerate(drafts):
            if not allows(rows[j], draft) or not matcher.accept(draft):
                break
            accepted += 1
            matcher.fill_bitmask(rows[j + 1])
            if not rows[j + 1].any():
                rows[j + 1].fill(-1)  # a dead end after the drafts (see above)
                break
    finally:
        if accepted:
            matcher.rollback(accepted)
    rows[accepted + 1 :].fill(-1)


def allows(words: np.ndarray, token_id: int) -> bool:
    """Whether a bitmask row allows `token_id` (bit t % 32 of word t // 32)."""
    return bool((int(words[token_id // 32]) >> (token_id % 32)) & 1)


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
