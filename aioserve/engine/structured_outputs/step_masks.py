"""Each step's structured-output masks, from the matchers of its constrained sequences.

The engine plans a step's masks when it launches the step (`StepMasks.plan`) and fills
them once every token sampled before the step has reached the matchers: at once when no
step is in flight, else right after the step before it has returned its tokens — while
this step's forward pass runs, so that with asynchronous scheduling the device does not
wait for the host. A matcher that allows no token at all is a dead end: its row allows
every token (the sample is dropped) and the engine ends the request.
"""

from __future__ import annotations

from dataclasses import dataclass

from aioserve.engine.request import Request
from aioserve.engine.scheduler import SchedulerOutput
from aioserve.runner.step_plan import TokenBitmask


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
            if request.status.is_finished:
                words.fill(-1)  # its sample will be dropped
                continue
            request.matcher.fill_bitmask(words)
            if not words.any():
                words.fill(-1)
                dead_ends.append(request)
        self.bitmask.set_ready()
        return dead_ends

    def abandon(self) -> None:
        """The step will never get its masks (the engine stops): its sampling fails."""
        self.bitmask.abandon()


def accept_tokens(request: Request, token_ids: list[int]) -> bool:
    """Advance a constrained sequence's matcher; False when a token breaks the constraint."""
    matcher = request.matcher
    return all(matcher.accept(token_id) for token_id in token_ids)
