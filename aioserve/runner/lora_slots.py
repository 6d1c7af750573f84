"""The device's LoRA adapter slots, and which sequence uses which.

With --enable-lora each layer an adapter may reach (models/lora_adapter.py `lora_targets`)
gets `max_loras` slots of adapter weights on the device, zero-padded to --max-lora-rank, as
the Linear's `lora_a` and `lora_b` buffers (models/lora_op.py): a step can mix up to that
many adapters, and the scheduler never runs more at once. A sequence entering the runner with an adapter takes
the slot already holding it, or the slot unused longest; the weights are copied in on the
model thread, in step order, so a step still running keeps the weights it started with.

On the CPU the slots of a 16-bit model are float32 (the adapter's values rounded to
--lora-dtype first): the torch reference's small products are ~4x faster in float32 there
(kernels/lora_reference.py). GPUs keep them in --lora-dtype, as the Triton kernels want.

Each step, the tokens of the sequences with an adapter are grouped by slot
(kernels/lora.py `LoRATokenGroups`), once, for every LoRA layer of the model to read.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from aioserve.kernels.lora import LoRATokenGroups, lora_token_groups
from aioserve.models.lora_adapter import LoRAAdapter, lora_targets
from aioserve.runner.step_plan import NewSequence, StepPlan


@dataclass(frozen=True)
class LayerSlots:
    """One layer's slots: `a` [slots, slices · rank, in] holds each slot's lora_A of every
    slice, `b` [slots, out, rank] each output column's lora_B row times the scaling; slice
    i is output columns slice_bounds[i]..slice_bounds[i+1] (kernels/lora.py)."""

    a: torch.Tensor
    b: torch.Tensor
    slice_bounds: tuple[int, ...]


@dataclass(frozen=True)
class SlotLoad:
    """Copy `adapter` (id `lora_id`) into `slot` before the step runs."""

    slot: int
    lora_id: int
    adapter: LoRAAdapter


class LoRASlots:
    def __init__(
        self,
        model: nn.Module,
        *,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = device
        if device.type == "cpu":
            dtype = torch.float32
        modules = dict(model.named_modules())
        self.layers: dict[str, LayerSlots] = {}
        for name, target in lora_targets(model).items():
            num_slices = len(target.slice_bounds) - 1
            weights = LayerSlots(
                a=torch.zeros(
                    max_loras, num_slices * max_rank, target.in_features, dtype=dtype, device=device
                ),
                b=torch.zeros(
                    max_loras, target.slice_bounds[-1], max_rank, dtype=dtype, device=device
                ),
                slice_bounds=target.slice_bounds,
            )
            module = modules[name]
            module.lora_a, module.lora_b = weights.a, weights.b
            module.lora_slice_bounds = weights.slice_bounds
            self.layers[name] = weights
        # Host bookkeeping, on the thread that prepares steps.
        self._slot_lora = [0] * max_loras  # the adapter id each slot holds (0: none)
        self._slot_users = [0] * max_loras  # sequences in the runner using it
        self._slot_used_at = [0] * max_loras  # when it last gained a user
        self._clock = itertools.count(1)
        self._seq_slot: dict[str, int] = {}

    @property
    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.layers.values())

    # -- host, while earlier steps may still run -------------------------------------------

    def admit(self, seq: NewSequence) -> SlotLoad | None:
        """Give `seq` its adapter's slot; the load to run first if the slot must change."""
        if not seq.lora_id:
            return None
        assert seq.lora_adapter is not None, "a sequence with a LoRA id carries its weights"
        if seq.lora_adapter.rank > self.max_rank:
            raise ValueError(
                f"LoRA rank {seq.lora_adapter.rank} exceeds the slots' {self.max_rank}"
            )
        load = None
        if seq.lora_id in self._slot_lora:
            slot = self._slot_lora.index(seq.lora_id)
        else:
            idle = [s for s in range(self.max_loras) if self._slot_users[s] == 0]
            if not idle:
                raise RuntimeError(
                    f"more than --max-loras ({self.max_loras}) adapters in the runner at once"
                )
            slot = min(idle, key=self._slot_used_at.__getitem__)
            self._slot_lora[slot] = seq.lora_id
            load = SlotLoad(slot, seq.lora_id, seq.lora_adapter)
        self._slot_users[slot] += 1
        self._slot_used_at[slot] = next(self._clock)
        self._seq_slot[seq.seq_id] = slot
        return load

    def forget(self, seq_id: str) -> None:
        slot = self._seq_slot.pop(seq_id, None)
        if slot is not None:
            self._slot_users[slot] -= 1

    def token_slots(self, plan: StepPlan) -> list[int] | None:
        """Each token's slot in the step's flat batch (-1: no adapter); None if no token has one."""
        seq_slot = self._seq_slot
        if not any(chunk.seq_id in seq_slot for chunk in plan.chunks):
            return None
        slots: list[int] = []
        for chunk in plan.chunks:
            slots.extend([seq_slot.get(chunk.seq_id, -1)] * chunk.num_tokens)
        return slots

    # -- the model thread, in step order ---------------------------------------------------

    @torch.inference_mode()
    def load(self, load: SlotLoad) -> None:
        """Copy an adapter's weights into its slot, zeros where it has none or less rank."""
        for name, weights in self.layers.items():
            a, b = weights.a[load.slot], weights.b[load.slot]
            a.zero_()
            b.zero_()
            pairs = load.adapter.layers.get(name)
            if pairs is None:
                continue
            bounds = weights.slice_bounds
            for i, pair in enumerate(pairs):
                if pair is None:
                    continue
                lora_a, lora_b = pair  # in --lora-dtype; float32 slots hold them exactly
                rank = lora_a.shape[0]
                a[i * self.max_rank : i * self.max_rank + rank].copy_(lora_a)
                b[bounds[i] : bounds[i + 1], :rank].copy_(lora_b)

    def groups(self, token_slots: list[int] | None) -> LoRATokenGroups | None:
        """The step's tokens grouped by slot, on the device."""
        if token_slots is None:
            return None
        return lora_token_groups(token_slots, self.device)
