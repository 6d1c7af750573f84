"""The routes of vLLM's development mode (VLLM_SERVER_DEV_MODE=1) that aioserve has:

    POST /reset_prefix_cache   {"success": true} once every cached prefix block is
                               forgotten; {"success": false} while a request holds blocks
                               (vLLM 0.32's answer; retry once the server is idle)
    GET /server_info           {"vllm_config", "vllm_env", "system_env"}: the engine's
                               resolved settings and the frontend's configuration
                               (?config_format=text, the default: their reprs; json: as
                               objects), the VLLM_* variables, and environment_info()
    POST /pause, POST /resume, GET /is_paused, POST /abort_requests
                               vLLM's routes for RL frameworks: generation paused around a
                               weight update, requests aborted (pause_routes.py)
    POST /sleep, POST /wake_up, GET /is_sleeping, POST /release_kv_cache_memory
                               vLLM's sleep mode: paused, memory freed and brought back
                               (sleep_routes.py; memory freed with --enable-sleep-mode)

"vllm_config" is aioserve's own configuration (EngineSettings, the values the engine
resolved, such as max_model_len; FrontendConfig, its api_key "<hidden>"), not vLLM's
VllmConfig; "system_env" holds the facts `aioserve collect-env` prints, not vLLM's
collect_env report. "vllm_env" leaves out every variable whose name holds KEY, TOKEN,
SECRET or PASSWORD (vLLM's leaves out only KEY). /reset_prefix_cache's query parameters
`reset_running_requests` (preempt the running requests first) and `reset_external` (a KV
connector's cache, which aioserve has none of) are refused when true. vLLM's other
development routes (collective RPC, multimodal caches, and the RL routes
that transfer, update and check weights) belong to features aioserve does not have. Not
for production: the server logs a warning when they are on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from aioserve.environment import environment_info, is_secret
from aioserve.server.errors import bad_parameter
from aioserve.server.pause_routes import add_pause_routes
from aioserve.server.sleep_routes import add_sleep_routes
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


def _vllm_environment_variables(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The VLLM_* variables set in `environ` (default: os.environ), sorted, secrets left out."""
    environ = os.environ if environ is None else environ
    return {
        name: environ[name]
        for name in sorted(environ)
        if name.startswith("VLLM_") and not is_secret(name)
    }


def _jsonable(value: Any) -> Any:
    """`value` as JSON values: dataclasses and mappings as objects, sequences and sets as
    arrays, what JSON has no type for (torch.dtype, torch.device, paths, enums) as its str."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_jsonable(item) for item in value), key=str)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


@functools.lru_cache(maxsize=1)
def _cached_environment_info() -> dict[str, Any]:
    return environment_info()


async def server_info(request: web.Request) -> web.Response:
    config_format = request.query.get("config_format", "text")
    if config_format not in ("text", "json"):
        raise bad_parameter(
            "config_format", config_format, "config_format must be 'text' or 'json'"
        )
    state = request.app[STATE]
    frontend = state.frontend
    if frontend.api_key:
        frontend = dataclasses.replace(frontend, api_key="<hidden>")
    configs = {"engine": state.engine.settings, "frontend": frontend}
    return web.json_response(
        {
            "vllm_config": "\n".join(map(repr, configs.values()))
            if config_format == "text"
            else _jsonable(configs),
            "vllm_env": _vllm_environment_variables(),
            "system_env": await asyncio.to_thread(_cached_environment_info),
        }
    )


def add_dev_routes(app: web.Application) -> None:
    """Register the development routes on `app`."""
    logger.warning(
        "%s is set: the development routes (/reset_prefix_cache, /server_info, /pause, "
        "/resume, /is_paused, /abort_requests, /sleep, /wake_up, /is_sleeping, "
        "/release_kv_cache_memory) are on. "
        "Do not use this in production.",
        DEV_MODE_ENV,
    )
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_get("/server_info", server_info)
    add_pause_routes(app)
    add_sleep_routes(app)
