"""The aiohttp runner `aioserve serve` serves its app with: vLLM's HTTP-layer limits and
access log, which vLLM gets from uvicorn.

Header limits. vLLM hands `--h11-max-incomplete-event-size` (default 4 MiB) and
`--h11-max-header-count` (default 256) to uvicorn for its h11 parser. h11 refuses a
request whose head (request line and headers) is still incomplete once more than that
many bytes are buffered; uvicorn answers any such parse error with a 400 ("Invalid HTTP
request received.", not h11's 431 hint) and closes the connection. (uvicorn 0.54 reads no
header count, and with httptools installed, as vLLM's fastapi[standard] installs it, it
does not run h11 at all; the flags' help says what they are meant to do, and here they do
it.) aiohttp's parser has limits of its own, mapped as follows:

- `--h11-max-header-count` -> `max_headers`: one header more is a 400;
- `--h11-max-incomplete-event-size` -> `max_line_size` (the request line) and
  `max_field_size` (one header's name and value): a longer line is a 400 at once; and
  `RequestHeadLimit` on each connection's parser, for h11's own rule on the whole head:
  once more than that many bytes of a head have arrived without its end, a 400.

aiohttp answers each of these 400 with the parser's reason as plain text and closes the
connection, as uvicorn does with its own text; aiohttp has no way to send 431.

Access log. One line per request on the "aioserve.access" logger, as uvicorn writes
them; `--disable-access-log-for-endpoints` leaves out the lines of the paths it lists,
matched as vLLM's filter (vllm/logging_utils/uvicorn_logging.py) matches them: the path
uvicorn logs (the request target's path, percent-decoded then quoted again) with its
query string cut off by urlparse, compared exactly.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any
from urllib.parse import quote, unquote, urlparse

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.web_log import AccessLogger

from aioserve.config.frontend import FrontendConfig
from aioserve.log_setup import ACCESS_LOGGER

# Once draining has ended, how long aborted requests get to write their last bytes.
CLOSE_GRACE_S = 5.0
ACCESS_LOG_FORMAT = '%a "%r" %s %Tfs'
"""One line per request, as uvicorn writes them: client, request line, status, duration."""


def make_runner(app: web.Application, frontend: FrontendConfig) -> web.AppRunner:
    """The app's runner: handlers cancelled when their client goes away, access log and
    header limits as configured."""
    access_log = None if frontend.disable_uvicorn_access_log else logging.getLogger(ACCESS_LOGGER)
    head_bytes = frontend.h11_max_incomplete_event_size
    return HeadLimitedRunner(
        app,
        max_head_bytes=head_bytes,
        handler_cancellation=True,
        access_log=access_log,
        access_log_class=access_logger_class(frontend.disable_access_log_for_endpoints or ()),
        access_log_format=ACCESS_LOG_FORMAT,
        shutdown_timeout=CLOSE_GRACE_S,
        max_line_size=head_bytes,
        max_field_size=head_bytes,
        max_headers=frontend.h11_max_header_count,
    )


# --- the head limit ------------------------------------------------------------------------


class RequestHeadLimit:
    """One connection's request parser, which refuses a request head still incomplete after
    more than `limit` bytes: h11's max_incomplete_event_size.

    The bytes are counted from the end of the previous request (its body read, when it has
    one) until a request comes out of the parser. A read that ends one request and starts
    the next is not counted for the next, so the count may fall short by one read (64 KiB
    to 256 KiB); h11 likewise looks only when its buffer holds no complete head. While
    aiohttp holds back pipelined requests (32 waiting for their handler), the parser keeps
    what follows unparsed and it is counted too; reading pauses then, so that adds a read
    or two at most.
    """

    __slots__ = ("_parser", "_limit", "_pending", "_payload")

    def __init__(self, parser: Any, limit: int) -> None:
        self._parser = parser
        self._limit = limit
        self._pending = 0  # bytes of the head being read
        self._payload: Any = None  # the body of the latest request, until it is all read

    def feed_data(self, data: bytes) -> Any:
        in_head = self._payload is None or self._payload.is_eof()
        messages, upgraded, tail = self._parser.feed_data(data)
        if messages:
            self._payload = messages[-1][1]
            self._pending = 0
        elif in_head:
            self._pending += len(data)
            if self._pending > self._limit:
                raise BadHttpMessage(
                    f"Request header fields too large: no end of the head in {self._pending} "
                    f"bytes (the limit is {self._limit})"
                )
        return messages, upgraded, tail

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parser, name)


class _HeadLimitedServer:
    """aiohttp's protocol factory (`web.Server`), each connection's parser wrapped in a
    RequestHeadLimit; everything else is the server's."""

    def __init__(self, server: web.Server, limit: int) -> None:
        self._server = server
        self._limit = limit

    def __call__(self) -> Any:
        handler = self._server()
        # aiohttp keeps the parser on the protocol (BaseProtocol._parser) and calls
        # feed_data, feed_eof, message_consumed, set_upgraded and pause_reading on it.
        handler._parser = RequestHeadLimit(handler._parser, self._limit)
        return handler

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


class HeadLimitedRunner(web.AppRunner):
    """An AppRunner whose connections refuse request heads over `max_head_bytes`."""

    __slots__ = ("_max_head_bytes",)

    def __init__(self, app: web.Application, *, max_head_bytes: int, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._max_head_bytes = max_head_bytes

    async def _make_server(self) -> Any:
        return _HeadLimitedServer(await super()._make_server(), self._max_head_bytes)


# --- the access log ------------------------------------------------------------------------


def logged_path(target: str) -> str:
    """The path vLLM's access-log filter compares for a request target ("/health?x=1"):
    uvicorn logs the target's path percent-decoded and quoted again, its query string
    after it; the filter takes the path of that with urlparse."""
    raw_path, _, query = target.partition("?")
    logged = quote(unquote(raw_path))
    if query:
        logged += "?" + query
    return urlparse(logged).path


def access_logger_class(excluded_paths: Collection[str]) -> type[AbstractAccessLogger]:
    """aiohttp's access logger, leaving out the requests whose `logged_path` is one of
    `excluded_paths`."""
    if not excluded_paths:
        return AccessLogger
    excluded = frozenset(excluded_paths)

    class FilteredAccessLogger(AccessLogger):
        def log(self, request: Any, response: Any, time: float) -> None:
            if logged_path(request.raw_path) in excluded:
                return
            super().log(request, response, time)

    return FilteredAccessLogger
