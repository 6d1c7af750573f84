"""vLLM's 400 for a development route's bad query parameters (FastAPI's validation errors,
as vLLM's handler words them), shared by pause_routes.py and sleep_routes.py.

Each error is pydantic's dict for the parameter, its `loc` "query.<name>", as Python shows
it; the value it echoes is cut at 200 characters, as vLLM cuts it.
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus
from typing import Any

from aiohttp import web

from aioserve.engine.pause import PAUSE_MODES
from aioserve.server.errors import APIError

logger = logging.getLogger("aioserve")

_MODES = " or ".join(", ".join(f"'{m}'" for m in PAUSE_MODES).rsplit(", ", 1))
_MAX_INPUT_CHARS = 200  # vLLM's cut of the value an error echoes
# What pydantic reads as an integer from a string: ASCII digits, maybe signed, maybe
# grouped by underscores, maybe with a fraction of zeros, within spaces.
_INTEGER = re.compile(r"\s*([+-]?[0-9]+(?:_[0-9]+)*)(?:\.0+)?\s*")


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """vLLM's 400 for FastAPI's validation errors: each error's dict, as Python shows it."""
    label = "error" if len(errors) == 1 else "errors"
    lines = "".join(f"\n  {error}" for error in errors)
    return APIError(
        f"{len(errors)} validation {label}:{lines}",
        param=errors[0]["loc"],
        error_type="Bad Request",
    )


def shown(value: str) -> str:
    if len(value) > _MAX_INPUT_CHARS:
        return value[:_MAX_INPUT_CHARS] + "...[truncated]"
    return value


def mode_errors(query: Any) -> tuple[str, list[dict[str, Any]]]:
    """The query's pause mode ("abort" when absent) and its validation error, if any."""
    mode = query.get("mode", "abort")
    if mode in PAUSE_MODES:
        return mode, []
    error = {
        "type": "literal_error",
        "loc": "query.mode",
        "msg": f"Input should be {_MODES}",
        "input": shown(mode),
        "ctx": {"expected": _MODES},
    }
    return mode, [error]


def bounded_int(
    query: Any, name: str, default: int, low: int, high: int
) -> tuple[int, list[dict[str, Any]]]:
    """The integer query parameter `name` (`default` when absent), which must lie in
    [low, high], and its validation error, if any. Repeated, the last value counts."""
    values = query.getall(name, [])
    if not values:
        return default, []
    raw = values[-1]
    loc = f"query.{name}"
    match = _INTEGER.fullmatch(raw)
    if match is None:
        msg = "Input should be a valid integer, unable to parse string as an integer"
        return default, [{"type": "int_parsing", "loc": loc, "msg": msg, "input": shown(raw)}]
    value = int(match.group(1))
    if value < low:
        msg = f"Input should be greater than or equal to {low}"
        error = {"type": "greater_than_equal", "loc": loc, "msg": msg, "input": shown(raw)}
        return value, [{**error, "ctx": {"ge": low}}]
    if value > high:
        msg = f"Input should be less than or equal to {high}"
        error = {"type": "less_than_equal", "loc": loc, "msg": msg, "input": shown(raw)}
        return value, [{**error, "ctx": {"le": high}}]
    return value, []


def failed(what: str, error: Exception) -> web.Response:
    """The pause routes' 500 for an engine that fails: {"error": "Failed to <what>: <why>"}."""
    logger.error("Failed to %s", what, exc_info=error)
    return web.json_response(
        {"error": f"Failed to {what}: {error}"}, status=HTTPStatus.INTERNAL_SERVER_ERROR
    )
