"""LoRA adapters as model names of their own, beside the base model's (--enable-lora).

An adapter served as "sql" is asked for with `"model": "sql"` on any generation route; its
responses say `"model": "sql"`, and /v1/models lists it with its folder as `root` and its
base model as `parent`, as vLLM does. Adapters come from --lora-modules at start, and, when
VLLM_ALLOW_RUNTIME_LORA_UPDATING is true, from POST /v1/load_lora_adapter
`{"lora_name", "lora_path", "load_inplace"}` and go with POST /v1/unload_lora_adapter
`{"lora_name"}`, with vLLM 0.32's answers (tests/server/vllm_samples/170-209).

An adapter is read and checked when it is loaded (engine/lora_requests.py), so a bad one is
refused there rather than at its first request. Each load gets a new adapter id: a request
running on an adapter replaced in place or unloaded finishes with the weights it started
with, and the prefix cache never mixes two adapters' keys and values.

Where aioserve answers otherwise than vLLM: an adapter that cannot be served (rank above
--max-lora-rank, DoRA, an unreadable config, ...) is a 400 "Loading lora X failed: ...", where
vLLM answers 500 with its worker's error inside; adapters of embed_tokens or lm_head are
refused (vLLM 0.32 serves them).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from http import HTTPStatus

from aioserve.engine.async_engine import AsyncEngine
from aioserve.engine.lora_requests import LoRARequest
from aioserve.models.lora_adapter import LoRAAdapterError, NoAdapterError
from aioserve.server.errors import APIError

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_allowed() -> bool:
    """vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: "1" or "true" (any case) allows it."""
    return os.environ.get(RUNTIME_UPDATING_ENV, "0").strip().lower() in ("1", "true")


@dataclass(frozen=True)
class ServedAdapter:
    request: LoRARequest
    base_model_name: str


class LoRAModels:
    """The adapters served, by name."""

    def __init__(self, engine: AsyncEngine, base_model_names: list[str]) -> None:
        self.engine = engine
        self.base_model_names = base_model_names
        self.adapters: dict[str, ServedAdapter] = {}
        self._ids = itertools.count(1)

    def lora_request(self, model: str) -> LoRARequest | None:
        adapter = self.adapters.get(model)
        return None if adapter is None else adapter.request

    async def load(
        self, name: str, path: str, base_model_name: str | None = None, inplace: bool = False
    ) -> None:
        """Read and check the adapter, then serve it as `name`; APIError as vLLM words it."""
        if not name or not path:
            raise invalid_input("Both 'lora_name' and 'lora_path' must be provided.")
        if name in self.base_model_names:
            raise invalid_input(f"The lora adapter '{name}' conflicts with a served base model.")
        if name in self.adapters and not inplace:
            raise invalid_input(
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True."
            )
        if self.engine.lora_adapters is None:
            raise APIError("LoRA is not enabled. Use --enable-lora to enable LoRA.")
        request = LoRARequest(name, next(self._ids), path)
        try:
            await self.engine.lora_adapters.read(request)
        except NoAdapterError as error:
            raise APIError(f"Loading lora {name} failed: {error}", HTTPStatus.NOT_FOUND) from None
        except LoRAAdapterError as error:
            raise APIError(f"Loading lora {name} failed: {error}") from None
        previous = self.adapters.get(name)
        if previous is not None:
            self.engine.lora_adapters.drop(previous.request.lora_int_id)
        self.adapters[name] = ServedAdapter(request, base_model_name or self.base_model_names[0])

    def unload(self, name: str) -> None:
        if not name:
            raise invalid_input("'lora_name' needs to be provided to unload a LoRA adapter.")
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise APIError(f"The lora adapter '{name}' cannot be found.", HTTPStatus.NOT_FOUND)
        if self.engine.lora_adapters is not None:
            self.engine.lora_adapters.drop(adapter.request.lora_int_id)


def invalid_input(message: str) -> APIError:
    return APIError(message, error_type="InvalidUserInput")
