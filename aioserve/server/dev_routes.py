"""The routes of vLLM's development mode (VLLM_SERVER_DEV_MODE=1) that aioserve has:

    POST /reset_prefix_cache   {"success": true} once every cached prefix block is
                               forgotten; {"success": false} while a request holds blocks
                               (vLLM 0.32's answer; retry once the server is idle)

vLLM's query parameters `reset_running_requests` (preempt the running requests first) and
`reset_external` (a KV connector's cache, which aioserve has none of) are refused when
true. vLLM's other development routes (sleep and wake, collective RPC, multimodal caches)
belong to features aioserve does not have. Not for production: the server logs a warning
when they are on.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from aiohttp import web

from aioserve.server.errors import bad_parameter
from aioserve.server.state import STATE

logger = logging.getLogger("aioserve")
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"


def dev_mode(environ: Mapping[str, str] | None = None) -> bool:
    """Whether VLLM_SERVER_DEV_MODE asks for the development routes (vLLM: "1" or "true")."""
    environ = os.environ if environ is None else environ
    return environ.get(DEV_MODE_ENV, "0").strip().lower() in ("1", "true")


async def reset_prefix_cache(request: web.Request) -> web.Response:
    for name, why in (
        ("reset_running_requests", "aioserve does not preempt running requests for it yet"),
        ("reset_external", "aioserve has no external (KV connector) prefix cache"),
    ):
        value = request.query.get(name, "false")
        if value.lower() not in ("false", "0"):
            raise bad_parameter(name, value, why)
    logger.info("Resetting prefix cache...")
    success = request.app[STATE].engine.reset_prefix_cache()
    if not success:
        logger.warning("The prefix cache was not reset: requests still hold KV blocks")
    return web.json_response({"success": success})


def add_dev_routes(app: web.Application) -> None:
    """Register the development routes on `app`."""
    logger.warning(
        "%s is set: the development routes (/reset_prefix_cache) are on. Do not use this "
        "in production.",
        DEV_MODE_ENV,
    )
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
