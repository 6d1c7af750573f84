"""vLLM 0.32's routes for reinforcement-learning frameworks, which pause a server while they
push new weights into it (vllm/entrypoints/rl/online/api_router.py; development mode only):

    POST /pause           {"status": "paused"} once the pause is complete; query parameters
                          mode ("abort", the default: end the requests in flight; "wait":
                          let them finish; "keep": freeze them) and clear_cache (default
                          true: forget the prefix cache once paused). engine/pause.py says
                          what each mode does, and what becomes of requests sent meanwhile
    POST /resume          {"status": "resumed"}; a 400 while sleep holds memory back
                          (engine/sleep.py: POST /wake_up resumes)
    GET /is_paused        {"is_paused": true | false}
    POST /abort_requests  {"status": "aborted", "aborted": N}: aborts the requests whose ids
                          the body's "request_ids" lists (each counted, known or not), or,
                          when it is empty or absent, every request in flight

The ids are vLLM's external ids, the engine's request ids here: "chatcmpl-<id>" for a chat
completion and "cmpl-<id>-<prompt index>" for a completion, where <id> is the request's
X-Request-Id header, else its `request_id` field, else a random one. An aborted request
ends with finish_reason "abort", streamed or not.

The answers and errors are vLLM's: a bad query parameter is its validation 400 ("1
validation error: ..."), a body that is not a JSON object its "Invalid JSON format" or
"Request body must be a JSON object" 400, and an engine that fails {"error": "Failed to
...: <why>"} with a 500. One departure: "request_ids" must be a list of strings or one
string (vLLM takes any iterable, and counts a string's characters).
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from aioserve.engine.pause import PAUSE_MODES
from aioserve.engine.sleep import EngineAsleepError
from aioserve.server.errors import APIError
from aioserve.server.query_validation import failed, mode_errors, shown, validation_error
from aioserve.server.state import STATE

# The strings pydantic reads as booleans (FastAPI's bool query parameters), lowercased.
_TRUE = ("1", "on", "t", "true", "y", "yes")
_FALSE = ("0", "off", "f", "false", "n", "no")


def _pause_query(query: Any) -> tuple[str, bool]:
    """(mode, clear_cache) from /pause's query, or vLLM's 400 for what is wrong in it."""
    mode, errors = mode_errors(query)
    clear_cache = query.get("clear_cache", "true")
    if clear_cache.lower() not in _TRUE + _FALSE:
        errors.append(
            {
                "type": "bool_parsing",
                "loc": "query.clear_cache",
                "msg": "Input should be a valid boolean, unable to interpret input",
                "input": shown(clear_cache),
            }
        )
    if errors:
        raise validation_error(errors)
    return mode, clear_cache.lower() in _TRUE


async def pause(request: web.Request) -> web.Response:
    mode, clear_cache = _pause_query(request.query)
    try:
        await request.app[STATE].engine.pause_generation(mode, clear_cache)
    except Exception as error:
        return failed("pause generation", error)
    return web.json_response({"status": "paused"})


async def resume(request: web.Request) -> web.Response:
    try:
        request.app[STATE].engine.resume_generation()
    except EngineAsleepError as error:  # engine/sleep.py: not while memory is asleep
        raise APIError(str(error)) from None
    return web.json_response({"status": "resumed"})


async def is_paused(request: web.Request) -> web.Response:
    return web.json_response({"is_paused": request.app[STATE].engine.is_paused})


def _request_ids(body: Any) -> list[str]:
    """The ids a /abort_requests body lists ([]: abort everything), or its 400."""
    if not isinstance(body, dict):
        raise APIError("Request body must be a JSON object", error_type="Bad Request")
    ids = body.get("request_ids") or []
    if isinstance(ids, str):
        return [ids]
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise APIError(
            "request_ids must be a list of request ids (strings)",
            param="request_ids",
            error_type="Bad Request",
        )
    return ids


async def abort_requests(request: web.Request) -> web.Response:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        raise APIError("Invalid JSON format", error_type="Bad Request") from None
    request_ids = _request_ids(body)
    engine = request.app[STATE].engine
    if request_ids:
        for request_id in request_ids:
            engine.abort(request_id)
        aborted = len(request_ids)
    else:
        aborted = engine.abort_all()
    return web.json_response({"status": "aborted", "aborted": aborted})


def add_pause_routes(app: web.Application) -> None:
    """Register /pause, /resume, /is_paused and /abort_requests on `app`."""
    app.router.add_post("/pause", pause)
    app.router.add_post("/resume", resume)
    app.router.add_get("/is_paused", is_paused)
    app.router.add_post("/abort_requests", abort_requests)


def dev_operation(summary: str, properties: dict[str, Any], **more: Any) -> dict[str, Any]:
    """An /openapi.json operation answering a JSON object with `properties`."""
    schema = {"type": "object", "properties": properties}
    ok = {"description": "OK", "content": {"application/json": {"schema": schema}}}
    return {"summary": f"{summary} (VLLM_SERVER_DEV_MODE=1)", **more, "responses": {"200": ok}}


_STATUS = {"status": {"type": "string"}}

PAUSE_OPERATIONS: dict[tuple[str, str], dict[str, Any]] = {
    ("post", "/pause"): dev_operation(
        "Pause generation, once the requests in flight are aborted, done or frozen",
        _STATUS,
        parameters=[
            {"name": "mode", "in": "query", "schema": {"enum": PAUSE_MODES, "default": "abort"}},
            {"name": "clear_cache", "in": "query", "schema": {"type": "boolean", "default": True}},
        ],
    ),
    ("post", "/resume"): dev_operation("Resume generation after /pause", _STATUS),
    ("get", "/is_paused"): dev_operation(
        "Whether generation is paused", {"is_paused": {"type": "boolean"}}
    ),
    ("post", "/abort_requests"): dev_operation(
        "Abort the requests listed, or all in flight",
        {**_STATUS, "aborted": {"type": "integer"}},
        requestBody={
            "required": True,
            "content": {
                "application/json": {
                    "schema": {
                        "type": "object",
                        "properties": {
                            "request_ids": {"type": "array", "items": {"type": "string"}}
                        },
                    }
                }
            },
        },
    ),
}
"""/openapi.json's operations of these routes."""
