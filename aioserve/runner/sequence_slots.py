"""The runner's memory of the sequences it runs: one slot per sequence, kept between steps.

A sequence takes a slot when it enters the runner (`StepPlan.new_sequences`) and gives it
back when it leaves (`StepPlan.finished_seq_ids`). Two halves, touched by two threads:

- `SequenceSlots`, on the host, read and written only while a step is prepared (the event
  loop's thread): block tables, how many tokens each sequence has sampled (the step index
  of seeded sampling and min_tokens), the sampling settings as per-slot arrays, so that a
  step's sampling rows are a few array lookups. One exception: a step with drafts
  (speculative_rows.py) adds the drafts each sequence kept to its count when its tokens
  are collected, which is before the next step is prepared because speculation runs with
  one step in flight.
- `SlotTensors`, on the device, read and written only while a step executes (the model
  thread, in step order): the token each sequence sampled last (the input of its next
  decode when the host does not know it yet), per-token output counts and prompt masks for
  the penalties, and each sequence's fixed logit bias. A step records the slot changes it
  needs (`SlotAdmission`) and applies them before it computes, so a step planned while
  an earlier one runs never writes state the earlier one reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from aioserve.kernels.sampling import SAMPLING_EPS
from aioserve.runner.step_plan import NewSequence, SamplingSettings

_SMALLEST_TOP_P = float(np.finfo(np.float32).tiny)

# Columns of SequenceSlots.float_settings.
TEMPERATURE, TOP_P, MIN_P, PRESENCE, FREQUENCY, REPETITION = range(6)


@dataclass
class SlotAdmission:
    """What the device must learn about a sequence that entered slot `slot`."""

    slot: int
    prompt_token_ids: np.ndarray  # int64
    output_token_ids: np.ndarray  # int64
    uses_penalties: bool
    bias_ids: np.ndarray | None  # int64: its fixed logit bias (logit_bias)
    bias_values: np.ndarray | None  # float32
    allowed_bitmask: np.ndarray | None  # int32 words: its allowed_token_ids, as a bitmask


def fixed_logit_bias(settings: SamplingSettings) -> tuple[np.ndarray, np.ndarray] | None:
    """The bias a sequence keeps for its whole life: its logit_bias."""
    bias = {int(t): float(v) for t, v in settings.logit_bias.items()}
    if not bias:
        return None
    return (
        np.fromiter(bias.keys(), dtype=np.int64, count=len(bias)),
        np.fromiter(bias.values(), dtype=np.float32, count=len(bias)),
    )


def allowed_bitmask(settings: SamplingSettings, vocab_size: int) -> np.ndarray | None:
    """A sequence's allowed_token_ids as the sampler's token bitmask: bit t % 32 of word
    t // 32 set for each allowed token t (1,536 int32 words for a 49,152-token vocabulary,
    where a -inf bias on every other token took 49,000 entries a step)."""
    if settings.allowed_token_ids is None:
        return None
    allowed = np.zeros(-(-vocab_size // 32) * 32, dtype=bool)
    allowed[np.asarray(settings.allowed_token_ids, dtype=np.int64)] = True
    # Little-endian bit order: bit j of a word is token 32 * word + j.
    return np.packbits(allowed, bitorder="little").view("<i4")


class SequenceSlots:
    """Host-side per-sequence state, indexed by slot."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._slot_of: dict[str, int] = {}
        self._free = list(range(max_num_seqs - 1, -1, -1))  # pop() hands out slot 0 first
        self.block_tables = np.zeros((max_num_seqs, max_blocks_per_seq), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_sampled = np.zeros(max_num_seqs, dtype=np.int64)
        self.float_settings = np.zeros((max_num_seqs, 6), dtype=np.float32)
        self.top_k = np.zeros(max_num_seqs, dtype=np.int32)
        self.seeds = np.zeros(max_num_seqs, dtype=np.int64)
        self.settings: list[SamplingSettings | None] = [None] * max_num_seqs
        self.has_fixed_bias = np.zeros(max_num_seqs, dtype=bool)
        self.has_allowed_bitmask = np.zeros(max_num_seqs, dtype=bool)
        self._prompts: dict[int, np.ndarray] = {}  # of sequences that want prompt logprobs

    def __len__(self) -> int:
        return len(self._slot_of)

    def slot(self, seq_id: str) -> int:
        try:
            return self._slot_of[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id!r} is not in the runner") from None

    def forget(self, seq_id: str) -> None:
        slot = self._slot_of.pop(seq_id, None)
        if slot is not None:
            self.settings[slot] = None
            self._prompts.pop(slot, None)
            self._free.append(slot)

    @property
    def any_prompt_logprobs(self) -> bool:
        """Whether some sequence in the runner wants prompt logprobs."""
        return bool(self._prompts)

    def prompt_for_logprobs(self, seq_id: str) -> np.ndarray | None:
        """The prompt of a sequence that wants prompt logprobs (int64), else None."""
        return self._prompts.get(self.slot(seq_id))

    def admit(self, seq: NewSequence) -> SlotAdmission:
        if seq.seq_id in self._slot_of:
            raise ValueError(f"sequence {seq.seq_id!r} is already in the runner")
        if not self._free:
            raise RuntimeError("no free sequence slot: more sequences than max_num_seqs")
        slot = self._free.pop()
        self._slot_of[seq.seq_id] = slot
        s = seq.sampling
        self.num_blocks[slot] = 0
        self.num_sampled[slot] = len(seq.output_token_ids)
        temperature = 0.0 if s.temperature < SAMPLING_EPS else s.temperature
        self.float_settings[slot] = (
            temperature,
            # A top_p below float32's smallest normal would round to 0, a mass no token
            # reaches; any such top_p keeps the most likely token alone, as this one does.
            max(s.top_p, _SMALLEST_TOP_P),
            s.min_p,
            s.presence_penalty,
            s.frequency_penalty,
            s.repetition_penalty,
        )
        # A top_k of the vocabulary or more keeps every token: the same as no top_k, and
        # an int32 cannot hold every top_k a request may ask for.
        self.top_k[slot] = s.top_k if 0 < s.top_k < self.vocab_size else -1
        self.seeds[slot] = s.seed
        self.settings[slot] = s
        bias = fixed_logit_bias(s)
        self.has_fixed_bias[slot] = bias is not None
        bitmask = allowed_bitmask(s, self.vocab_size)
        self.has_allowed_bitmask[slot] = bitmask is not None
        prompt = np.asarray(seq.prompt_token_ids, dtype=np.int64)
        if s.prompt_logprobs is not None:
            self._prompts[slot] = prompt
        return SlotAdmission(
            slot=slot,
            prompt_token_ids=prompt,
            output_token_ids=np.asarray(seq.output_token_ids, dtype=np.int64),
            uses_penalties=s.uses_penalties,
            bias_ids=bias[0] if bias else None,
            bias_values=bias[1] if bias else None,
            allowed_bitmask=bitmask,
        )

    def append_blocks(self, slot: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[slot])
        end = start + len(block_ids)
        if end > self.block_tables.shape[1]:
            raise ValueError(
                f"a sequence was given {end} KV blocks, more than max_model_len needs "
                f"({self.block_tables.shape[1]})"
            )
        self.block_tables[slot, start:end] = block_ids
        self.num_blocks[slot] = end


class SlotTensors:
    """Device-side per-sequence state, indexed by slot (see the module docstring)."""

    def __init__(self, max_num_seqs: int, vocab_size: int, device: torch.device) -> None:
        self.max_num_seqs = max_num_seqs
        self.vocab_size = vocab_size
        self.device = device
        self.last_sampled = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        # Allocated with the first sequence that uses penalties: [slots, vocab] each.
        self.output_counts: Tensor | None = None
        self.prompt_mask: Tensor | None = None
        self.fixed_bias: dict[int, tuple[Tensor, Tensor]] = {}
        self.allowed_bitmasks: dict[int, Tensor] = {}  # int32 words, by slot

    def admit(self, admission: SlotAdmission) -> None:
        slot = admission.slot
        self.fixed_bias.pop(slot, None)
        self.allowed_bitmasks.pop(slot, None)
        if admission.allowed_bitmask is not None:
            self.allowed_bitmasks[slot] = torch.from_numpy(admission.allowed_bitmask).to(
                self.device
            )
        if admission.bias_ids is not None:
            self.fixed_bias[slot] = (
                torch.from_numpy(admission.bias_ids).to(self.device),
                torch.from_numpy(admission.bias_values).to(self.device),
            )
        if not admission.uses_penalties:
            return
        if self.output_counts is None:
            shape = (self.max_num_seqs, self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        counts = self.output_counts[slot]
        counts.zero_()
        if admission.output_token_ids.size:
            ids = torch.from_numpy(admission.output_token_ids).to(self.device)
            counts.scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        mask = self.prompt_mask[slot]
        mask.zero_()
        mask[torch.from_numpy(admission.prompt_token_ids).to(self.device)] = True

    def record_sampled(self, slots: Tensor, token_ids: Tensor, penalty_rows: Tensor | None) -> None:
        """Remember each row's sampled token; count it where the sequence uses penalties."""
        self.last_sampled[slots] = token_ids
        if penalty_rows is not None:
            counts = self.output_counts
            counts.index_put_(
                (slots[penalty_rows], token_ids[penalty_rows]),
                torch.ones(penalty_rows.numel(), dtype=counts.dtype, device=counts.device),
                accumulate=True,
            )
