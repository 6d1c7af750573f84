"""What a sleeping engine gives back, and how it takes it again: vLLM's worker sleep,
wake_up and discard over its allocator's tags "weights" and "kv_cache".

The KV cache (sleep levels 1 and 2, /release_kv_cache_memory): each cache tensor's storage
is resized to nothing, which frees its memory. On the CPU that memory goes back to glibc,
which this process tells to keep what it frees (host_memory.py), so `malloc_trim` then
hands the free pages to the kernel. At wake the storages are allocated again and zeroed
(runner/kv_memory.py says why zeroed). The tensors themselves stay, with their shapes and
layouts: the step context, the compiled layer graphs and the one-row graph (which take them
as inputs at every step) and the decode graphs' static KV list hold the same objects and
see the new memory.

The weights, level 1: on CUDA/ROCm each weight storage is copied to host memory and its
device memory freed, then copied back in place at wake. On the CPU the weights are in host
memory already: they are kept where they are, and level 1 frees the KV cache only.

The weights, level 2: every weight storage is freed, on every platform. At wake the model
is loaded again from its checkpoint (the loader and the transforms of the start, given as
`reload`) and copied into them, tensor by tensor: aioserve has no route through which a
trainer could send new weights, which is what vLLM leaves a level-2 wake waiting for.
Weights that have no storage of their own to free and refill (oneDNN's packed copies of a
bfloat16 model on a CPU with bfloat16 arithmetic) refuse level 2 (`level_2_refusal`).

A CUDA/HIP decode graph replays the addresses it was captured on: after a wake that moved
any memory it reads (`moved`), the decode graphs are captured again.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from aioserve import host_memory
from aioserve.models.step_context import KVCache

logger = logging.getLogger("aioserve")

KV_CACHE = "kv_cache"
WEIGHTS = "weights"
SLEEP_TAGS = frozenset((WEIGHTS, KV_CACHE))  # vLLM's executor's


def module_tensors(model: nn.Module) -> dict[str, Tensor]:
    """Every tensor `model`'s modules hold, by dotted name: parameters, buffers, and the
    plain attributes the weight forms keep (GGUF blocks, int4/int8/fp8 forms, row copies)."""
    found: dict[str, Tensor] = {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        held = itertools.chain(
            module._parameters.items(), module._buffers.items(), vars(module).items()
        )
        for name, value in held:
            if isinstance(value, Tensor):
                found[prefix + name] = value
    return found


def level_2_refusal(model: nn.Module) -> str | None:
    """Why level 2 cannot discard `model`'s weights and restore them, or None if it can."""
    if any(name.endswith((".lora_a", ".lora_b")) for name in module_tensors(model)):
        return "the model holds LoRA adapter slots (--enable-lora)"
    if any(getattr(m, "packed_key", 0) for m in model.modules()):
        return "the MoE experts' weights are packed by oneDNN"
    for name, tensor in module_tensors(model).items():
        if tensor.layout is not torch.strided or tensor.is_mkldnn:
            return f"{name} is a oneDNN-packed weight, which has no storage to free and refill"
    return None


def _storages(tensors: Iterable[Tensor]) -> list[torch.UntypedStorage]:
    """The distinct storages under `tensors` (tied weights share one)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen.setdefault(storage._cdata, storage)
    return list(seen.values())


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes = [ctypes.c_size_t]
    return trim


def return_free_host_memory() -> None:
    """Hand the pages glibc holds free back to the kernel (nothing off glibc)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def addresses(kv_caches: list[KVCache], model: nn.Module) -> tuple[int, ...]:
    """Where the KV caches and the weights are: what a captured graph reads."""
    tensors = [cache for pair in kv_caches for cache in pair[:2]]
    tensors += module_tensors(model).values()
    return tuple(storage.data_ptr() for storage in _storages(tensors))


def moved(before: tuple[int, ...], after: tuple[int, ...]) -> bool:
    """Whether memory a graph captured at `before` reads is elsewhere now."""
    return before != after


class SleepingMemory:
    """The runner's memory by tag: `sleep(level)`, `discard(tags)`, `wake_up(tags)`.

    `reload` loads the model again from its checkpoint, with every transform the start
    applied (level 2's wake); `recapture` captures the decode graphs again (None: none)."""

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[KVCache],
        device: torch.device,
        *,
        reload: Callable[[], nn.Module] | None = None,
        recapture: Callable[[], None] | None = None,
    ) -> None:
        self.model = model
        self._kv = [cache for pair in kv_caches for cache in pair[:2]]
        self._kv_caches = kv_caches
        self._device = device
        self._reload = reload
        self._recapture = recapture
        self._kv_bytes: list[tuple[torch.UntypedStorage, int]] = []  # freed, and their sizes
        self._weights_on_host: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []
        self._weights_discarded: list[tuple[torch.UntypedStorage, int]] = []
        self._graph_addresses = addresses(kv_caches, model)
        self.recaptures = 0  # how many wakes captured the decode graphs again

    @property
    def kv_resident(self) -> bool:
        return not self._kv_bytes

    @property
    def weights_resident(self) -> bool:
        return not self._weights_on_host and not self._weights_discarded

    # -- sleep ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def sleep(self, level: int) -> None:
        """Level 1: the KV cache freed, the weights offloaded to host memory (kept there on
        the CPU); level 2: both freed."""
        if level == 2:
            self._discard_weights()
        elif self._device.type != "cpu":
            self._offload_weights()
        self._free_kv()
        self._synchronize()
        return_free_host_memory()

    def discard(self, tags: Iterable[str]) -> None:
        """Free the memory of `tags` without keeping its contents (only "kv_cache" has any
        to free without a level: /release_kv_cache_memory)."""
        if KV_CACHE in tags:
            self._free_kv()
            self._synchronize()
            return_free_host_memory()

    def _free_kv(self) -> None:
        if self._kv_bytes:
            return
        for storage in _storages(self._kv):
            self._kv_bytes.append((storage, storage.nbytes()))
            storage.resize_(0)

    def _offload_weights(self) -> None:
        if not self.weights_resident:
            return
        for storage in _storages(module_tensors(self.model).values()):
            host = torch.UntypedStorage(storage.nbytes(), device="cpu").pin_memory()
            host.copy_(storage)
            self._weights_on_host.append((storage, host))
            storage.resize_(0)

    def _discard_weights(self) -> None:
        if self._weights_discarded:
            return
        if self._weights_on_host:  # offloaded: the host copies go
            for storage, host in self._weights_on_host:
                self._weights_discarded.append((storage, host.nbytes()))
            self._weights_on_host.clear()
            return
        for storage in _storages(module_tensors(self.model).values()):
            self._weights_discarded.append((storage, storage.nbytes()))
            storage.resize_(0)

    # -- wake ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """Bring back the memory of `tags` (None: all); the decode graphs are captured
        again once everything is resident and anything they read has moved."""
        tags = SLEEP_TAGS if tags is None else set(tags)
        if WEIGHTS in tags:
            self._restore_weights()
        if KV_CACHE in tags:
            self._restore_kv()
        self._synchronize()
        if self.kv_resident and self.weights_resident:
            now = addresses(self._kv_caches, self.model)
            if moved(self._graph_addresses, now):
                self._graph_addresses = now
                if self._recapture is not None:
                    self._recapture()
                    self.recaptures += 1

    def _restore_kv(self) -> None:
        freed, self._kv_bytes = self._kv_bytes, []
        for storage, nbytes in freed:
            storage.resize_(nbytes)
            if storage.device.type == "cpu":
                # As at start (kv_memory.py KVZeroing): the pool on small pages.
                host_memory.on_small_pages(storage.data_ptr(), nbytes)
        for storage, _ in freed:
            zero_storage(storage)

    def _restore_weights(self) -> None:
        on_host, self._weights_on_host = self._weights_on_host, []
        for storage, host in on_host:
            storage.resize_(host.nbytes())
            storage.copy_(host)
        if self._weights_discarded:
            self._reload_weights()

    def _reload_weights(self) -> None:
        if self._reload is None:
            raise RuntimeError("the weights were discarded and there is no checkpoint to reload")
        fresh = self._reload()
        fresh_tensors = module_tensors(fresh)
        for storage, nbytes in self._weights_discarded:
            storage.resize_(nbytes)
        for name, tensor in module_tensors(self.model).items():
            source = fresh_tensors[name].untyped_storage()
            tensor.untyped_storage().copy_(source)
        self._weights_discarded.clear()
        del fresh, fresh_tensors
        return_free_host_memory()

    def _synchronize(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)


def zero_storage(storage: torch.UntypedStorage) -> None:
    """Write zeros over `storage` (memory handed out again may hold anything)."""
    torch.tensor([], dtype=torch.uint8, device=storage.device).set_(storage).zero_()
