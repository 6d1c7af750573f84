"""What every handler needs: the engine, the names the model answers to, the frontend config.

One `ServerState` per app, stored under `STATE` (`request.app[STATE]`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import web

from aioserve.config.frontend import FrontendConfig, frontend_config
from aioserve.config.profiler import ProfilerSettings, profiler_settings
from aioserve.engine.async_engine import AsyncEngine
from aioserve.engine.lora_requests import LoRARequest
from aioserve.server.fingerprint import system_fingerprint
from aioserve.server.lora_models import LoRAModels

if TYPE_CHECKING:
    from aioserve.server.tracing import RequestTracer

T = TypeVar("T")


@dataclass
class ServerState:
    engine: AsyncEngine
    served_model_names: list[str]
    """The names a request's `model` may use; the first is the one responses report."""
    frontend: FrontendConfig = field(default_factory=frontend_config)
    """The HTTP server's configuration (chat_template, response_role, max_log_len, ...)."""
    draining: bool = False
    """Set on SIGTERM/SIGINT: new requests get 503 while in-flight ones finish."""
    text_thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="aioserve-text"),
        repr=False,
    )
    """Where prompts are tokenized and chat templates rendered (see `off_loop`)."""
    profiler: ProfilerSettings | None = field(default_factory=lambda: profiler_settings({}))
    """The torch profiler of /start_profile and /stop_profile (None: no such routes): the
    engine's --profiler-config; by default, VLLM_TORCH_PROFILER_DIR's (config/profiler.py)."""
    tracer: RequestTracer | None = None
    """With --otlp-traces-endpoint, what sends the requests' spans (tracing.py; build_app
    makes it)."""
    loras: LoRAModels = field(init=False)
    """The LoRA adapters served under names of their own (lora_models.py)."""

    def __post_init__(self) -> None:
        self.loras = LoRAModels(self.engine, self.served_model_names)

    async def off_loop(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on the text thread, awaited.

        Tokenizing a long prompt or rendering a long conversation takes far more than the
        few milliseconds the event loop may be blocked: on the loop it would stall every
        stream and /health. The tokenizer's Rust core releases the GIL while it encodes.
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.text_thread, functools.partial(fn, *args, **kwargs))

    @functools.cached_property
    def system_fingerprint(self) -> str | None:
        """The responses' system_fingerprint (--fingerprint-mode; fingerprint.py)."""
        return system_fingerprint(self.engine.settings, self.frontend)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def response_model(self, lora: LoRARequest | None) -> str:
        """The `model` a response reports: its adapter's name, else the first served name."""
        return self.model_name if lora is None else lora.lora_name


STATE: web.AppKey[ServerState] = web.AppKey("aioserve_state", ServerState)
