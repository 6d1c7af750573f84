"""Reading a JSON request body and its fields with their types checked.

A wrong type is a 400 naming the field and the value, the value cut short so that a huge
input does not make a huge message: "max_tokens must be an integer (parameter=max_tokens,
value=ten)". A field that is absent or null reads as its default.

Keys a route does not know are not errors, as in OpenAI's API; `log_ignored_fields` logs
them as vLLM does, at DEBUG: "The following fields were present in the request but ignored:
{'foo'}", against the fields vLLM's request model for the route has (request_fields.py).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import orjson
from aiohttp import web

from aioserve.server.errors import APIError, bad_parameter
from aioserve.server.request_fields import REMOVED_GUIDED_FIELDS
from aioserve.server.request_schema import BodyField

logger = logging.getLogger("aioserve.server")

# JSON kinds and the Python types orjson decodes them to.
_KIND_TYPES: dict[str, tuple[type, ...]] = {
    "boolean": (bool,),
    "integer": (int, float),
    "number": (int, float),
    "string": (str,),
    "array": (list,),
    "object": (dict,),
    "string or array": (str, list),
    "string or object": (str, dict),
}


async def read_json_body(request: web.Request) -> dict[str, Any]:
    """The request's body as a JSON object, or a 400 saying why it is not one. As vLLM's
    routes, only a body sent as application/json is read (curl's default form type is not)."""
    media_type = request.headers.get("Content-Type", "").lower().split(";", 1)[0].strip()
    if media_type != "application/json":
        raise APIError("Unsupported Media Type: Only 'application/json' is allowed")
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        raise APIError(f"the request body is not valid JSON: {error}", param="body") from None
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", param="body")
    return body


class BodyFields:
    """Typed reads of a JSON object's declared fields (request_schema.py)."""

    def __init__(
        self, body: dict[str, Any], declared: dict[str, BodyField], where: str = ""
    ) -> None:
        self.body = body
        self.declared = declared
        self.where = where
        """The object's own name, prefixed to its fields' names in errors: "stream_options."."""

    def get(self, name: str, default: Any = None) -> Any:
        """The field `name` as its declared kind ("boolean", "integer", "number", "string",
        "array", "object", "string or array" or "string or object"); an integer may arrive
        as a whole float (16.0). KeyError for a field the route does not declare."""
        kind = self.declared[name].kind
        value = self.body.get(name)
        if value is None:
            return default
        # bool is an int in Python, but true is not a number in JSON.
        if (kind == "boolean") != isinstance(value, bool) or not isinstance(
            value, _KIND_TYPES[kind]
        ):
            raise _wrong_type(self.where + name, value, kind)
        if kind == "integer":
            if isinstance(value, float) and not value.is_integer():
                raise _wrong_type(self.where + name, value, kind)
            return int(value)
        if kind == "number":
            return float(value)
        return value


def log_ignored_fields(body: dict[str, Any], known: frozenset[str]) -> None:
    """Log, as vLLM does, the keys of an accepted `body` outside its route's `known` fields."""
    # vLLM 0.32 removed the guided_* fields, which aioserve still honours.
    extra = body.keys() - known - REMOVED_GUIDED_FIELDS
    if not extra:
        return
    logger.debug("The following fields were present in the request but ignored: %s", extra)


def optional_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    """A boolean field of `body` read outside a BodyFields declaration; null or absent:
    `default`; another type: a 400 naming the field."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_parameter(name, shown_value(value), f"{name} must be a boolean")
    return value


def check_prompt_count(count: int, field: str) -> None:
    """vLLM's cap on the prompts of one completions request (VLLM_MAX_COMPLETION_PROMPTS,
    1024 by default), for `field`'s list: a 400 naming it past the cap."""
    max_prompts = int(os.environ.get("VLLM_MAX_COMPLETION_PROMPTS", "1024"))
    if count > max_prompts:
        raise APIError(
            f"{field} list length {count} exceeds the maximum allowed count of {max_prompts}. "
            "To increase this limit, set the VLLM_MAX_COMPLETION_PROMPTS environment variable.",
            param=field,
        )


def shown_value(value: Any, limit: int = 100) -> str:
    """A value as error messages show it: JSON, cut after `limit` characters."""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = orjson.dumps(value).decode()
        except TypeError:
            text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _wrong_type(name: str, value: Any, kind: str) -> APIError:
    article = "an" if kind[0] in "aeiou" else "a"
    return bad_parameter(name, shown_value(value), f"{name} must be {article} {kind}")
