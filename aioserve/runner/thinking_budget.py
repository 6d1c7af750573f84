"""Thinking budgets (vLLM's `thinking_token_budget`): the end of a thought forced once the
thought has used its tokens.

A sequence thinks from its last reasoning start marker (in its prompt or its output) until
the parser's own end marker written after it. Once a thought holds `budget` tokens, the
next tokens are forced: the forced end marker's tokens in order, continuing from a part
of it already written, until the thought has ended. That is vLLM 0.32's rule (its model
runner v2), which reads nothing but the sequence's tokens. So it runs on the model thread,
where each step's sampled tokens are appended before the next step samples: with async
scheduling the host learns a step's tokens only after it has planned the next.

A forced row has every logit but its token's set to -inf, so the sampler draws that token
whatever the request's settings; the raw logprobs stay the model's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from aioserve.runner.step_plan import NewSequence


@dataclass(frozen=True)
class ThinkingMarkers:
    """The token ids that delimit a thought."""

    start: tuple[int, ...]
    end: tuple[int, ...]  # forced once the budget is spent (e.g. "Time is up.</think>")
    natural_end: tuple[int, ...]  # the parser's end marker, which ends a thought ("</think>")


class Thought:
    """One sequence's tokens and where its markers were last seen, scanned as it grows."""

    def __init__(self, budget: int, tokens: list[int], markers: ThinkingMarkers) -> None:
        self.budget = budget
        self.tokens = tokens  # the prompt's, then each sampled one (appended by `record`)
        self.markers = markers
        self.last_start = -1  # where the last start marker begins; -1: none
        self.last_end = -1  # where the last natural end marker begins; -1: none
        self._scanned = 0  # every marker beginning before this was found

    def forced_token(self) -> int | None:
        """The token the next position must be, or None when the sequence samples freely."""
        self._scan()
        markers, tokens = self.markers, self.tokens
        if self.last_start < 0 or self.last_start <= self.last_end:
            return None
        if len(tokens) - (self.last_start + len(markers.start)) < self.budget:
            return None
        # Continue the forced end from the longest part of it the tokens end with.
        written = 0
        for length in range(1, len(markers.end)):
            if length <= len(tokens) and tuple(tokens[-length:]) == markers.end[:length]:
                written = length
        return markers.end[written]

    def _scan(self) -> None:
        tokens, start, end = self.tokens, self.markers.start, self.markers.natural_end
        count = len(tokens)
        for i in range(self._scanned, count):
            if tuple(tokens[i : i + len(start)]) == start:
                self.last_start = i
            if tuple(tokens[i : i + len(end)]) == end:
                self.last_end = i
        # A marker that begins in the last few tokens may not be whole yet: look again.
        self._scanned = max(self._scanned, count - max(len(start), len(end)) + 1)


@dataclass
class ThoughtRows:
    """One step's budgeted rows: the logits row of each and its sequence's thought."""

    rows: list[int]
    thoughts: list[Thought]


class ThinkingBudgets:
    """The runner's sequences that have a thinking budget."""

    def __init__(self, markers: ThinkingMarkers) -> None:
        self.markers = markers
        self._thoughts: dict[str, Thought] = {}

    # -- host, while the step is prepared ---------------------------------------------------

    def admit(self, seq: NewSequence) -> None:
        budget = seq.sampling.thinking_token_budget
        if budget is not None:
            tokens = [*seq.prompt_token_ids, *seq.output_token_ids]
            self._thoughts[seq.seq_id] = Thought(budget, tokens, self.markers)

    def forget(self, seq_id: str) -> None:
        self._thoughts.pop(seq_id, None)

    def plan_rows(self, seq_ids: Sequence[str], first_rows: Sequence[int]) -> ThoughtRows | None:
        """The budgeted sequences among a step's sampling ones (`first_rows[i]`: the logits
        row of `seq_ids[i]`, whose one row it is: a budgeted sequence drafts nothing)."""
        rows, thoughts = [], []
        for seq_id, row in zip(seq_ids, first_rows, strict=True):
            thought = self._thoughts.get(seq_id)
            if thought is not None:
                rows.append(row)
                thoughts.append(thought)
        return ThoughtRows(rows, thoughts) if rows else None

    # -- the model thread, in step order ----------------------------------------------------

    @staticmethod
    def apply(rows: ThoughtRows, logits: torch.Tensor) -> torch.Tensor:
        """`logits` with each forced row masked to its token: a new tensor where a row is
        forced, else `logits` itself."""
        forced = [(row, token) for row, thought in zip(rows.rows, rows.thoughts, strict=True)
                  if (token := thought.forced_token()) is not None]  # fmt: skip
        if not forced:
            return logits
        masked = logits.clone()
        index = torch.tensor([row for row, _ in forced], device=logits.device)
        tokens = torch.tensor([token for _, token in forced], device=logits.device)
        masked[index] = float("-inf")
        masked[index, tokens] = 0.0
        return masked

    @staticmethod
    def record(rows: ThoughtRows, token_ids: torch.Tensor) -> None:
        """Each budgeted row's sampled token onto its sequence's tokens."""
        sampled = token_ids[rows.rows].tolist()
        for thought, token in zip(rows.thoughts, sampled, strict=True):
            thought.tokens.append(token)
