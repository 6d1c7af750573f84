"""vLLM 0.32's sleep-mode routes (vllm/entrypoints/serve/dev/sleep/api_router.py;
development mode only, VLLM_SERVER_DEV_MODE=1):

    POST /sleep                    {"status": "sleeping", "level": L} once asleep; query
                                   parameters level (0, 1 (the default) or 2) and mode
                                   ("abort", the default, "wait" or "keep": what becomes of
                                   the requests in flight, as for /pause)
    POST /wake_up                  {"status": "awake" | "sleeping", "tags": [...] | null}:
                                   the memory of the repeated query parameter tags
                                   ("weights", "kv_cache"; "scheduling" ends a level-0
                                   sleep) brought back, or with none all of it; "sleeping"
                                   while some is still asleep
    GET /is_sleeping               {"is_sleeping": true | false}
    POST /release_kv_cache_memory  {"status": "kv_cache_released"}: the KV cache's memory
                                   freed, after a completed /pause (or level-0 sleep)

engine/sleep.py says what each level frees and what the server does meanwhile; without
--enable-sleep-mode the routes answer the same and free nothing, as vLLM's do.

The errors are vLLM's: a bad query parameter is its validation 400 ("1 validation error:
..."), an engine that refuses or fails a 500 {"error": {"message": "Call to <operation>
method failed: <why>", "type": "InternalServerError", ...}}, as vLLM's engine core reports a
failed call. One departure: a level 2 this server cannot take (weights it could not load
again, engine/sleep.py) is a 400 naming why. The sleep, wake and release are timed in
vLLM's operation metrics (sleep_metrics.py).
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from aiohttp import web

from aioserve.engine.pause import PAUSE_MODES
from aioserve.engine.sleep import SleepRefused
from aioserve.server.errors import APIError
from aioserve.server.metrics import METRICS
from aioserve.server.pause_routes import dev_operation
from aioserve.server.query_validation import bounded_int, mode_errors, validation_error
from aioserve.server.sleep_metrics import SleepOperationMetrics
from aioserve.server.state import STATE

logger = logging.getLogger("aioserve")

SLEEP_OPERATIONS: web.AppKey[list[SleepOperationMetrics]] = web.AppKey(
    "aioserve_sleep_operations", list
)
"""Holds the app's SleepOperationMetrics once a route made them (the app is frozen then)."""


def _operations(app: web.Application) -> SleepOperationMetrics:
    made = app[SLEEP_OPERATIONS]
    if not made:
        made.append(SleepOperationMetrics(app[METRICS].registry))
    return made[0]


def _call_failed(method: str, error: Exception) -> APIError:
    """vLLM's answer to an engine-core call that raised: a 500 naming the call."""
    logger.error("Invocation of %s method failed", method, exc_info=error)
    return APIError(f"Call to {method} method failed: {error}", HTTPStatus.INTERNAL_SERVER_ERROR)


async def sleep(request: web.Request) -> web.Response:
    level, errors = bounded_int(request.query, "level", 1, 0, 2)
    mode, mode_error = mode_errors(request.query)
    if errors or mode_error:
        raise validation_error(errors + mode_error)
    with _operations(request.app).record("sleep"):
        try:
            await request.app[STATE].engine.sleep(level, mode)
        except SleepRefused as error:
            raise APIError(str(error), param="level") from None
        except Exception as error:
            raise _call_failed("sleep", error) from None
    return web.json_response({"status": "sleeping", "level": level})


async def wake_up(request: web.Request) -> web.Response:
    tags = request.query.getall("tags", []) or None  # none given: every tag
    logger.info("wake up the engine with tags: %s", tags)
    with _operations(request.app).record("wake"):
        try:
            fully_awake = await request.app[STATE].engine.wake_up(tags)
        except Exception as error:
            raise _call_failed("wake_up", error) from None
    return web.json_response({"status": "awake" if fully_awake else "sleeping", "tags": tags})


async def is_sleeping(request: web.Request) -> web.Response:
    return web.json_response({"is_sleeping": request.app[STATE].engine.is_sleeping})


async def release_kv_cache_memory(request: web.Request) -> web.Response:
    with _operations(request.app).record("release_kv_cache_memory"):
        try:
            await request.app[STATE].engine.release_kv_cache_memory()
        except Exception as error:
            raise _call_failed("release_kv_cache_memory", error) from None
    return web.json_response({"status": "kv_cache_released"})


def add_sleep_routes(app: web.Application) -> None:
    """Register /sleep, /wake_up, /is_sleeping and /release_kv_cache_memory on `app`."""
    app[SLEEP_OPERATIONS] = []
    app.router.add_post("/sleep", sleep)
    app.router.add_post("/wake_up", wake_up)
    app.router.add_get("/is_sleeping", is_sleeping)
    app.router.add_post("/release_kv_cache_memory", release_kv_cache_memory)


_STATUS = {"status": {"type": "string"}}

SLEEP_ROUTE_OPERATIONS: dict[tuple[str, str], dict[str, Any]] = {
    ("post", "/sleep"): dev_operation(
        "Put the engine to sleep: pause, and at level 1 or 2 free its memory",
        {**_STATUS, "level": {"type": "integer"}},
        parameters=[
            {
                "name": "level",
                "in": "query",
                "schema": {"type": "integer", "minimum": 0, "maximum": 2, "default": 1},
            },
            {"name": "mode", "in": "query", "schema": {"enum": PAUSE_MODES, "default": "abort"}},
        ],
    ),
    ("post", "/wake_up"): dev_operation(
        "Bring back the memory of the tags given (all when none), resume once all is back",
        {**_STATUS, "tags": {"type": "array", "items": {"type": "string"}, "nullable": True}},
        parameters=[
            {
                "name": "tags",
                "in": "query",
                "schema": {"type": "array", "items": {"type": "string"}},
                "explode": True,
            }
        ],
    ),
    ("get", "/is_sleeping"): dev_operation(
        "Whether the engine sleeps (or is paused)", {"is_sleeping": {"type": "boolean"}}
    ),
    ("post", "/release_kv_cache_memory"): dev_operation(
        "Free the KV cache's memory after a completed pause", _STATUS
    ),
}
"""/openapi.json's operations of these routes."""
