"""LoRA adapters as the engine knows them: a request's `LoRARequest`, and the host cache of
adapters read from their folders.

A `LoRARequest` names an adapter (vLLM's fields: `lora_name`, `lora_int_id`, `lora_path`);
the id, unique per adapter, is what the scheduler counts against --max-loras and what the
runner's slots hold. The adapter's weights are read off the event loop the first time a
request needs them and kept in an LRU cache of --max-cpu-loras adapters (vLLM's
`max_cpu_loras`); a sequence that is running keeps its adapter's weights alive even once
the cache has dropped them.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from aioserve.models.lora_adapter import LoRAAdapter


@dataclass(frozen=True)
class LoRARequest:
    """An adapter a request runs with: vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)`."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be > 0, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError("a LoRARequest needs the adapter's folder (lora_path)")


class LoRAAdapterCache:
    """Adapters read from their folders, the `capacity` last used kept in host memory.

    `read` is the reader (models/lora_adapter.py `read_lora_adapter` bound to the model):
    it raises LoRAAdapterError for an adapter that cannot be served."""

    def __init__(self, read: Callable[[str], LoRAAdapter], capacity: int) -> None:
        self._read = read
        self.capacity = capacity
        self._adapters: OrderedDict[int, tuple[str, LoRAAdapter]] = OrderedDict()
        self._reading: dict[int, asyncio.Future[LoRAAdapter]] = {}

    def cached(self, lora: LoRARequest) -> LoRAAdapter | None:
        entry = self._adapters.get(lora.lora_int_id)
        if entry is None or entry[0] != lora.lora_path:
            return None
        self._adapters.move_to_end(lora.lora_int_id)
        return entry[1]

    def read_now(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter, read on this thread if it is not cached (the offline API)."""
        adapter = self.cached(lora)
        if adapter is None:
            adapter = self._read(lora.lora_path)
            self._keep(lora, adapter)
        return adapter

    async def read(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter, read on a worker thread if it is not cached; concurrent requests
        for one adapter share one read."""
        adapter = self.cached(lora)
        if adapter is not None:
            return adapter
        pending = self._reading.get(lora.lora_int_id)
        if pending is None:
            pending = asyncio.ensure_future(asyncio.to_thread(self._read, lora.lora_path))
            self._reading[lora.lora_int_id] = pending
            try:
                adapter = await asyncio.shield(pending)
            finally:
                self._reading.pop(lora.lora_int_id, None)
            self._keep(lora, adapter)
            return adapter
        return await asyncio.shield(pending)

    def drop(self, lora_int_id: int) -> None:
        """Forget an adapter (unloaded): running sequences keep the weights they hold."""
        self._adapters.pop(lora_int_id, None)

    def _keep(self, lora: LoRARequest, adapter: LoRAAdapter) -> None:
        self._adapters[lora.lora_int_id] = (lora.lora_path, adapter)
        self._adapters.move_to_end(lora.lora_int_id)
        while len(self._adapters) > self.capacity:
            self._adapters.popitem(last=False)
