"""Server-sent events for streamed responses: `data: <json>\\n\\n` per event, then `data: [DONE]\\n\\n`
(the Responses API's named events: `event: <type>` before each, no [DONE]).

The response starts (status 200 and headers) only when the first event is ready, so an
error raised before it, such as a prompt the engine refuses, still reaches the client as
a plain JSON error with its status. An error after that is sent as one
`data: {"error": {...}}` event before `[DONE]`, as vLLM does. A client that goes away ends
the stream quietly: the events' iterator is closed, which aborts the engine request
behind it and returns its KV blocks.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from http import HTTPStatus
from typing import Any

import orjson
from aiohttp import web

from aioserve.server.errors import APIError

logger = logging.getLogger("aioserve.server")

_DONE = b"data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> bytes:
    """One event's bytes."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def named_sse_event(payload: dict[str, Any]) -> bytes:
    """One event's bytes, named by its "type" (the Responses API's form)."""
    return b"event: " + payload["type"].encode() + b"\n" + sse_event(payload)


async def stream_events(
    request: web.Request, events: AsyncIterator[dict[str, Any]], named: bool = False
) -> web.StreamResponse:
    """Send `events` as an SSE stream; close `events` however the stream ends.

    `named`: the Responses API's form, each event as `event: <its type>` then its data, no
    [DONE] at the end, and an error after the start as an event of type "error"."""
    encode = named_sse_event if named else sse_event
    done = b"" if named else _DONE
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
    )
    async with aclosing(events):
        first = await anext(events, None)  # errors here become ordinary JSON errors
        try:
            await response.prepare(request)
            if first is not None:
                await response.write(encode(first))
            async for event in events:
                await response.write(encode(event))
            tail = done
        except ConnectionError:  # the client went away: nobody left to tell
            return response
        except APIError as error:
            tail = _error_event(error, named) + done
        except Exception:
            logger.exception("a streamed request failed")
            error = APIError("internal server error", HTTPStatus.INTERNAL_SERVER_ERROR)
            tail = _error_event(error, named) + done
        try:
            await response.write(tail)
        except ConnectionError:
            pass
    return response


def _error_event(error: APIError, named: bool) -> bytes:
    if not named:
        return sse_event(error.body())
    fields = error.body()["error"]
    return named_sse_event(
        {
            "type": "error",
            "code": fields.get("code"),
            "message": fields["message"],
            "param": fields.get("param"),
        }
    )
