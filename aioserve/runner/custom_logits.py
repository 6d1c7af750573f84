"""The runner's custom logits processors (`--logits-processors`): their view of the batch.

A processor (aioserve/logits_processor.py) sees the batch as vLLM's persistent batch: row
i of a step's logits is batch index i, and before each step it learns which requests left,
came and moved (`BatchUpdate`). The runner's rows are the step's sampling sequences in
plan order, so `plan_rows` (on the host, while the step is prepared) compares them with
the last sampling step's and writes the difference that way: a sequence that stopped
sampling (finished, preempted, or not scheduled) is removed; a new one takes a freed
index, else the next one past the end; then sequences trade places until each sits at its
row. A preempted sequence comes back as a new one.

On the model thread, in step order: `apply` hands each processor its update and the
step's logits, and `record` appends each row's sampled token to its sequence's output
list, the list every processor was given, so the next step's processors see it. On a GPU
that read of the sampled tokens waits for the step: a processor costs that sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aioserve.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
from aioserve.runner.step_plan import NewSequence


@dataclass(eq=False)  # compared and hashed by identity
class _Sequence:
    params: object  # the request's SamplingParams, which processors read (extra_args)
    prompt_token_ids: list[int] | None  # None: a prompt of embeddings
    output_token_ids: list[int]  # grows on the model thread as the sequence samples


@dataclass
class ProcessorRows:
    """One step's rows as the processors see them: the update to hand them before the
    step, and the output list of each row's sequence, in row order."""

    update: BatchUpdate | None
    outputs: list[list[int]]


class CustomLogitsProcessors:
    def __init__(self, processors: list[LogitsProcessor]) -> None:
        self.processors = processors
        self._argmax_invariant = [p.is_argmax_invariant() for p in processors]
        self._sequences: dict[str, _Sequence] = {}
        self._rows: list[_Sequence] = []  # batch index -> sequence, as processors last saw it

    # -- host, while the step is prepared ---------------------------------------------------

    def admit(self, seq: NewSequence) -> None:
        # A prompt of embeddings has no tokens (a prompt of tokens is never empty).
        prompt = list(seq.prompt_token_ids) or None
        self._sequences[seq.seq_id] = _Sequence(seq.params, prompt, list(seq.output_token_ids))

    def forget(self, seq_id: str) -> None:
        """A sequence leaving the runner: its index is freed at the next step."""
        self._sequences.pop(seq_id, None)

    def plan_rows(self, seq_ids: list[str]) -> ProcessorRows:
        """The update from the last sampling step's rows to `seq_ids`, this step's."""
        rows = [self._sequences[s] for s in seq_ids]
        layout = list(self._rows)
        # By identity: a sequence that left and came back (a preemption) is a new one.
        wanted = set(rows)
        removed = [i for i, seq in enumerate(layout) if seq is not None and seq not in wanted]
        for i in removed:
            layout[i] = None
        placed = set(layout)
        free = [i for i, seq in enumerate(layout) if seq is None][::-1]  # pop(): the lowest
        added = []
        for seq in rows:
            if seq in placed:
                continue
            index = free.pop() if free else len(layout)
            if index == len(layout):
                layout.append(None)
            layout[index] = seq
            added.append((index, seq.params, seq.prompt_token_ids, seq.output_token_ids))
        # An index an added sequence took is not removed (vLLM's builder reuses them so).
        removed = [i for i in removed if layout[i] is None]
        at = {seq: i for i, seq in enumerate(layout) if seq is not None}
        moved = []
        for row, seq in enumerate(rows):
            index = at[seq]
            if index == row:
                continue
            other = layout[row]
            layout[row], layout[index] = seq, other
            at[seq] = row
            if other is None:
                moved.append((index, row, MoveDirectionality.UNIDIRECTIONAL))
            else:
                at[other] = index
                moved.append((index, row, MoveDirectionality.SWAP))
        changed = removed or added or moved  # a new size always removes or adds
        self._rows = rows
        update = BatchUpdate(len(rows), removed, added, moved) if changed else None
        return ProcessorRows(update, [seq.output_token_ids for seq in rows])

    # -- the model thread, in step order ----------------------------------------------------

    def apply(self, rows: ProcessorRows, logits: torch.Tensor, all_greedy: bool) -> torch.Tensor:
        """The step's logits after every processor, float32, in a new tensor (the raw
        logits stay for the raw logprobs)."""
        for processor in self.processors:
            processor.update_state(rows.update)
        processed = logits.to(torch.float32, copy=True)
        for processor, argmax_invariant in zip(
            self.processors, self._argmax_invariant, strict=True
        ):
            if not (all_greedy and argmax_invariant):
                processed = processor.apply(processed)
        return processed

    @staticmethod
    def record(rows: ProcessorRows, token_ids: torch.Tensor) -> None:
        """Each row's sampled token onto its sequence's output list."""
        for output, token in zip(rows.outputs, token_ids.tolist(), strict=True):
            output.append(token)
