"""A step's sampling rows: per-slot settings gathered on the host, state read on the device.

`build_host_sampling` runs while the step is prepared: a few array lookups by slot and the
step index of each row (how many tokens its sequence has sampled), all O(rows). The
penalties' per-token counts and prompt masks stay on the device in `SlotTensors`, read in
place by slot; a sequence's fixed logit bias and its allowed_token_ids bitmask were
uploaded when it entered the runner, and only the bans of min_tokens, which end after a
few tokens, are added per step.
`HostSampling.to_batch` puts it together on the model thread as the sampler's
`SamplingBatch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from aioserve.kernels.sampling import SamplingBatch
from aioserve.runner.sequence_slots import (
    FREQUENCY,
    MIN_P,
    PRESENCE,
    REPETITION,
    TEMPERATURE,
    TOP_P,
    SequenceSlots,
    SlotTensors,
)
from aioserve.runner.speculative_rows import DraftRows, penalty_state_with_drafts
from aioserve.runner.step_inputs import host_to_device
from aioserve.runner.step_plan import TokenBitmask


@dataclass
class BiasRow:
    """A sampling row with a logit bias this step: its fixed bias and min_tokens bans."""

    row: int
    slot: int
    fixed: bool  # the sequence has a fixed bias (in SlotTensors.fixed_bias)
    banned_ids: np.ndarray | None  # int64: min_tokens bans this step


@dataclass
class HostSampling:
    slots: np.ndarray  # [S] int64: each row's slot
    float_settings: np.ndarray  # [6, S] float32, rows as in sequence_slots
    top_k: np.ndarray  # [S] int32
    seeds_and_steps: np.ndarray  # [2, S] int64
    penalty_rows: np.ndarray | None  # int64: rows whose sequence uses penalties
    bias_rows: list[BiasRow]
    bitmask_rows: np.ndarray | None  # int64: rows whose sequence has allowed_token_ids
    logprobs_wanted: list[int | None]  # per row: its sequence's `logprobs` setting
    # row -> the tokens whose logprobs it reports after the sampled one's (logprob_token_ids)
    chosen_ids: dict[int, tuple[int, ...]]
    all_greedy: bool
    all_random: bool
    uses_top_k: bool
    uses_top_p: bool
    draft_rows: DraftRows | None = None  # a step with drafts: its rows (speculative_rows.py)

    @property
    def num_logprobs(self) -> int:
        wanted = [n for n in self.logprobs_wanted if n is not None]
        return max(wanted) if wanted else -1

    def to_batch(
        self,
        state: SlotTensors,
        slots: Tensor,
        device: torch.device,
        structured: TokenBitmask | None = None,
        logprobs_mode: str = "raw_logprobs",
    ) -> SamplingBatch:
        """The sampler's batch; `slots` is `self.slots` on the device, `structured` the
        step's structured-output masks (filled), `logprobs_mode` what logprobs report."""
        floats = host_to_device(self.float_settings, device)
        seeds_and_steps = host_to_device(self.seeds_and_steps, device)
        uses_penalties = self.penalty_rows is not None
        counts, prompt_mask, state_rows = state.output_counts, state.prompt_mask, slots
        if uses_penalties and self.draft_rows is not None:
            counts, prompt_mask, state_rows = penalty_state_with_drafts(
                state, slots, self.draft_rows, self.penalty_rows
            )
        bias_ids, bias_values = self._bias(state, device)
        token_bitmask, bitmask_rows = self._token_bitmask(state, device, structured)
        return SamplingBatch(
            temperature=floats[TEMPERATURE],
            top_k=host_to_device(self.top_k, device),
            top_p=floats[TOP_P],
            min_p=floats[MIN_P],
            seeds=seeds_and_steps[0],
            steps=seeds_and_steps[1],
            presence_penalty=floats[PRESENCE],
            frequency_penalty=floats[FREQUENCY],
            repetition_penalty=floats[REPETITION],
            output_token_counts=counts if uses_penalties else None,
            prompt_token_mask=prompt_mask if uses_penalties else None,
            state_rows=state_rows if uses_penalties else None,
            bias_token_ids=bias_ids,
            bias_values=bias_values,
            num_logprobs=self.num_logprobs,
            all_greedy=self.all_greedy,
            all_random=self.all_random,
            token_bitmask=token_bitmask,
            bitmask_rows=bitmask_rows,
            uses_top_k=self.uses_top_k,
            uses_top_p=self.uses_top_p,
            logprobs_mode=logprobs_mode,
        )

    def _token_bitmask(
        self, state: SlotTensors, device: torch.device, structured: TokenBitmask | None
    ) -> tuple[Tensor | None, Tensor | None]:
        """The bitmasks of the rows with allowed_token_ids or a structured output (both:
        the tokens both allow), and those rows."""
        structured_rows = structured.rows if structured is not None else None
        if structured is not None and self.bitmask_rows is None:
            return host_to_device(structured.words, device), host_to_device(structured_rows, device)
        if self.bitmask_rows is None:
            return None, None
        allowed = state.allowed_bitmasks
        masks = {int(r): allowed[int(self.slots[r])] for r in self.bitmask_rows}
        if structured is not None:
            words = host_to_device(structured.words, device)
            for i, row in enumerate(structured_rows.tolist()):
                masks[row] = masks[row] & words[i] if row in masks else words[i]
        rows = sorted(masks)
        return torch.stack([masks[r] for r in rows]), torch.tensor(rows, device=device)

    def _bias(self, state: SlotTensors, device: torch.device) -> tuple[Tensor | None, ...]:
        """[S, K] bias ids (padded with -1) and values for this step's rows with a bias."""
        if not self.bias_rows:
            return None, None
        parts: list[list[tuple[Tensor, Tensor]]] = []
        for entry in self.bias_rows:
            row_parts = []
            if entry.fixed:
                row_parts.append(state.fixed_bias[entry.slot])
            if entry.banned_ids is not None:
                ids = host_to_device(entry.banned_ids, device)
                row_parts.append((ids, torch.full(ids.shape, float("-inf"), device=device)))
            parts.append(row_parts)
        width = max(sum(ids.numel() for ids, _ in row_parts) for row_parts in parts)
        num_rows = self.slots.size
        bias_ids = torch.full((num_rows, width), -1, dtype=torch.int64, device=device)
        bias_values = torch.zeros((num_rows, width), dtype=torch.float32, device=device)
        for entry, row_parts in zip(self.bias_rows, parts, strict=True):
            ids = torch.cat([ids for ids, _ in row_parts])
            values = torch.cat([values for _, values in row_parts])
            bias_ids[entry.row, : ids.numel()] = ids
            bias_values[entry.row, : ids.numel()] = values
        return bias_ids, bias_values


def build_host_sampling(
    slots: SequenceSlots, row_slots: np.ndarray, draft_rows: DraftRows | None = None
) -> HostSampling:
    """The sampling rows of the slots `row_slots`, one a sampling chunk, or with
    `draft_rows` those of a step with drafts (row_slots then one a chunk); advances each
    sequence's sampled-token count by one (the model runner adds the drafts it keeps)."""
    if draft_rows is not None:
        return rows_sampling(slots, row_slots[draft_rows.chunk_of_row], draft_rows)
    if len(row_slots) == 1:
        return one_row_sampling(slots, int(row_slots[0]))
    return rows_sampling(slots, row_slots)


def rows_sampling(
    slots: SequenceSlots, row_slots: np.ndarray, draft_rows: DraftRows | None = None
) -> HostSampling:
    """build_host_sampling of any rows, in numpy calls over them: with `draft_rows`, a
    chunk's row j samples its sequence's token `num_sampled + j`."""
    steps = slots.num_sampled[row_slots]
    if draft_rows is None:
        slots.num_sampled[row_slots] += 1
    else:
        steps = steps + draft_rows.offsets
        slots.num_sampled[row_slots[draft_rows.first_rows]] += 1
    settings = [slots.settings[slot] for slot in row_slots.tolist()]
    temperature = slots.float_settings[row_slots, TEMPERATURE]
    top_k = slots.top_k[row_slots]
    penalty = [row for row, s in enumerate(settings) if s.uses_penalties]
    masked = np.flatnonzero(slots.has_allowed_bitmask[row_slots])
    bias_rows = []
    for row, (slot, step) in enumerate(zip(row_slots.tolist(), steps.tolist(), strict=True)):
        bias = _bias_row(slots, row, slot, step)
        if bias is not None:
            bias_rows.append(bias)
    return HostSampling(
        slots=row_slots,
        float_settings=np.ascontiguousarray(slots.float_settings[row_slots].T),
        top_k=top_k,
        seeds_and_steps=np.stack([slots.seeds[row_slots], steps]),
        penalty_rows=np.asarray(penalty, dtype=np.int64) if penalty else None,
        bias_rows=bias_rows,
        bitmask_rows=masked.astype(np.int64) if masked.size else None,
        logprobs_wanted=[s.logprobs for s in settings],
        chosen_ids={
            row: s.logprob_token_ids for row, s in enumerate(settings) if s.logprob_token_ids
        },
        all_greedy=bool((temperature == 0.0).all()),
        all_random=bool((temperature > 0.0).all()),
        uses_top_k=bool((top_k > 0).any()),
        uses_top_p=bool((slots.float_settings[row_slots, TOP_P] < 1.0).any()),
        draft_rows=draft_rows,
    )


def _bias_row(slots: SequenceSlots, row: int, slot: int, step: int) -> BiasRow | None:
    """The row's logit bias at its sequence's `step`-th sample, if it has one."""
    settings = slots.settings[slot]
    banned = None
    if settings.min_tokens_banned_ids and step < settings.min_tokens:
        banned = np.asarray(settings.min_tokens_banned_ids, dtype=np.int64)
    fixed = bool(slots.has_fixed_bias[slot])
    return BiasRow(row, slot, fixed, banned) if fixed or banned is not None else None


def one_row_sampling(slots: SequenceSlots, slot: int) -> HostSampling:
    """build_host_sampling of one row (a step at one stream), from Python scalars: there
    the host's work runs with the CPU's caches cold, and each numpy call on a few elements
    costs microseconds."""
    step = int(slots.num_sampled[slot])
    slots.num_sampled[slot] = step + 1
    settings = slots.settings[slot]
    floats = slots.float_settings[slot]
    temperature, top_k = float(floats[TEMPERATURE]), int(slots.top_k[slot])
    bias = _bias_row(slots, 0, slot, step)
    return HostSampling(
        slots=np.array([slot], dtype=np.int64),
        float_settings=floats[:, None].copy(),
        top_k=np.array([top_k], dtype=np.int32),
        seeds_and_steps=np.array([[int(slots.seeds[slot])], [step]], dtype=np.int64),
        penalty_rows=np.zeros(1, dtype=np.int64) if settings.uses_penalties else None,
        bias_rows=[] if bias is None else [bias],
        bitmask_rows=np.zeros(1, dtype=np.int64) if slots.has_allowed_bitmask[slot] else None,
        logprobs_wanted=[settings.logprobs],
        chosen_ids={0: settings.logprob_token_ids} if settings.logprob_token_ids else {},
        all_greedy=temperature == 0.0,
        all_random=temperature > 0.0,
        uses_top_k=top_k > 0,
        uses_top_p=float(floats[TOP_P]) < 1.0,
    )
