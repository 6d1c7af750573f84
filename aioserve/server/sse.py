"""Server-sent events for streamed responses: `data: <json>\\n\\n` per event, then `data: [DONE]\\n\\n`
(the Responses API's named events: `event: <type>` before each, no [DONE]).

The response starts (status 200 and headers) only when the first event is ready, so an
error raised before it, such as a prompt the engine refuses, still reaches the client as
a plain JSON error with its status. An error after that is sent as one
`data: {"error": {...}}` event before `[DONE]`, as vLLM does. A client that goes away ends
the stream quietly: the events' iterator is closed, which aborts the engine request
behind it and returns its KV blocks.

Keep-alive (`--sse-keep-alive-interval`, completions and chat streams, as in vLLM): while
the events have nothing for `keep_alive` seconds (the request queued, in prefill, or
between two tokens), the comment line `: keep-alive` and a blank line go out instead, the
bytes of vLLM's SSE_KEEP_ALIVE_COMMENT; SSE clients skip comments, but proxies with read
timeouts see traffic. When the first event is that late, the response starts with the
comment, so an error after it is sent as an error event, as vLLM's (whose stream has
started by then) is.
"""

from __future__ import annotations

import asyncio
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
KEEP_ALIVE = b": keep-alive\n\n"
"""vLLM's SSE_KEEP_ALIVE_COMMENT."""


def sse_event(payload: dict[str, Any]) -> bytes:
    """One event's bytes."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def named_sse_event(payload: dict[str, Any]) -> bytes:
    """One event's bytes, named by its "type" (the Responses API's form)."""
    return b"event: " + payload["type"].encode() + b"\n" + sse_event(payload)


async def stream_events(
    request: web.Request,
    events: AsyncIterator[dict[str, Any]],
    named: bool = False,
    keep_alive: float = 0,
) -> web.StreamResponse:
    """Send `events` as an SSE stream; close `events` however the stream ends.

    `named`: the Responses API's form, each event as `event: <its type>` then its data, no
    [DONE] at the end, and an error after the start as an event of type "error".
    `keep_alive`: seconds without an event after which a keep-alive comment is sent (and
    again after as many more); 0: none."""
    encode = named_sse_event if named else sse_event
    done = b"" if named else _DONE
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
    )
    items = _with_keep_alive(events, keep_alive) if keep_alive > 0 else events
    async with aclosing(events), aclosing(items):
        first = await anext(items, None)  # errors here become ordinary JSON errors
        try:
            await response.prepare(request)
            if first is not None:
                await response.write(_encoded(first, encode))
            async for item in items:
                await response.write(_encoded(item, encode))
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


def _encoded(item: dict[str, Any] | bytes, encode: Any) -> bytes:
    return item if isinstance(item, bytes) else encode(item)


async def _with_keep_alive(
    events: AsyncIterator[dict[str, Any]], interval: float
) -> AsyncIterator[dict[str, Any] | bytes]:
    """`events`, with KEEP_ALIVE whenever `interval` (> 0) seconds pass without one.
    Closing this leaves `events` to its owner, no step of it running.

    One task at a time takes the next event and is kept across the waits (cancelling it at
    each timeout would cancel the engine request behind it), as vLLM's with_sse_keep_alive
    does."""
    step = asyncio.ensure_future(anext(events))
    try:
        while True:
            done, _ = await asyncio.wait({step}, timeout=interval)
            if not done:
                yield KEEP_ALIVE
                continue
            try:
                event = step.result()
            except StopAsyncIteration:
                return
            yield event
            step = asyncio.ensure_future(anext(events))
    finally:
        step.cancel()
        # `events` cannot be closed while the task still runs a step of it.
        await asyncio.gather(step, return_exceptions=True)


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
