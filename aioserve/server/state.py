"""What every handler needs: the engine, the names the model answers to, the options.

One `ServerState` per app, stored under `STATE` (`request.app[STATE]`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from aioserve.engine.async_engine import AsyncEngine


@dataclass
class ServerState:
    engine: AsyncEngine
    served_model_names: list[str]
    """The names a request's `model` may use; the first is the one responses report."""
    options: dict[str, Any] = field(default_factory=dict)
    """Frontend options by argparse dest (chat_template, response_role, max_log_len, ...)."""
    draining: bool = False
    """Set on SIGTERM/SIGINT: new requests get 503 while in-flight ones finish."""

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


STATE: web.AppKey[ServerState] = web.AppKey("aioserve_state", ServerState)
