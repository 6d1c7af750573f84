"""The HTTP layer around every route: draining, CORS, the API key, route errors, request logs.

`build_app` installs these middlewares in this order, outermost first:

    error_middleware (errors.py)   any exception -> an OpenAI-shaped JSON error
    --middleware ones              the user's own, from their import paths
    drain_middleware               503 while draining; counts the requests in flight
    cors_preflight_middleware      answers CORS preflight (OPTIONS) requests itself
    api_key_middleware             401 on /v1/* without `Authorization: Bearer <key>`
    route_error_middleware         404 / 405 / 413 as OpenAI-shaped JSON
    request_log_middleware         one log line per request (--enable-log-requests)

and two `on_response_prepare` hooks, which run for streamed responses too: the CORS
headers of an actual (not preflight) request, and X-Request-Id.

Paths are compared without the `--root-path` prefix, since every route answers with and
without it.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import importlib
import logging
import os
import uuid
from collections.abc import Awaitable, Callable
from http import HTTPStatus

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from aioserve.config.declaration import ConfigError
from aioserve.config.frontend import FrontendConfig
from aioserve.server.errors import APIError, log_error_response

logger = logging.getLogger("aioserve.server")

API_KEY_ENV = "VLLM_API_KEY"

MAX_REQUEST_BODY_BYTES = 32 * 2**20
"""The largest request body accepted (aiohttp's client_max_size); larger ones get 413.

vLLM (uvicorn) sets no limit; aiohttp's default of 1 MiB would refuse long prompts. 32 MiB
holds a prompt of a million token ids written as JSON, several times over.
"""

PROBE_PATHS = frozenset({"/health", "/ping", "/load", "/metrics", "/version"})
"""Routes that do no work for a client: not counted as requests in flight."""

_ALL_METHODS = "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"
# Headers a browser may always send (the CORS "safelisted" ones).
_SAFELISTED_HEADERS = frozenset({"accept", "accept-language", "content-language", "content-type"})


def route_path(request: web.Request, root_path: str | None) -> str:
    """The request's path without the `--root-path` prefix."""
    path = request.path
    if root_path and (path == root_path or path.startswith(root_path + "/")):
        return path[len(root_path) :] or "/"
    return path


def _json_error(
    message: str, status: int, headers: dict[str, str] | None = None, *, close: bool = False
) -> web.Response:
    """An OpenAI-shaped error response; `close` ends the connection after it."""
    response = APIError(message, status).response()
    response.headers.update(headers or {})
    if close:
        response.force_close()
    return response


# --- requests in flight and draining ---------------------------------------------------------


class RequestsInFlight:
    """How many client requests are being handled, so that shutdown can wait for them."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.count += 1
        self._idle.clear()

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no request is in flight."""
        await self._idle.wait()


IN_FLIGHT: web.AppKey[RequestsInFlight] = web.AppKey("aioserve_in_flight", RequestsInFlight)


def drain_middleware(
    is_draining: Callable[[], bool], in_flight: RequestsInFlight, root_path: str | None
) -> Middleware:
    """503 for every new request while draining (but /metrics); count the others in flight.

    /health answers 503 too, which tells a load balancer to stop sending requests here.
    """

    @web.middleware
    async def drain(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = route_path(request, root_path)
        if is_draining() and path != "/metrics":
            return _json_error(
                "the server is shutting down and takes no new requests",
                HTTPStatus.SERVICE_UNAVAILABLE,
                {"Retry-After": "1"},
                close=True,
            )
        if path in PROBE_PATHS:
            return await handler(request)
        in_flight.enter()
        try:
            return await handler(request)
        finally:
            in_flight.leave()

    return drain


# --- CORS ----------------------------------------------------------------------------------------


class CorsPolicy:
    """--allowed-origins / --allowed-methods / --allowed-headers / --allow-credentials.

    The rules are those of Starlette's CORSMiddleware, which vLLM uses: "*" allows any
    value; with credentials allowed, the origin is echoed instead of "*".
    """

    def __init__(
        self,
        origins: list[str],
        methods: list[str],
        headers: list[str],
        allow_credentials: bool,
    ) -> None:
        self.any_origin = "*" in origins
        self.origins = frozenset(origins)
        self.any_method = "*" in methods
        self.methods = [method.upper() for method in methods]
        self.any_header = "*" in headers
        self.headers = frozenset(h.lower() for h in headers) | _SAFELISTED_HEADERS
        self.allow_credentials = allow_credentials

    def allows_origin(self, origin: str) -> bool:
        return self.any_origin or origin in self.origins

    def origin_headers(self, origin: str) -> dict[str, str]:
        """Access-Control-Allow-Origin (and -Credentials, Vary) for an allowed origin."""
        if self.any_origin and not self.allow_credentials:
            headers = {"Access-Control-Allow-Origin": "*"}
        else:
            headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        if self.allow_credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        return headers

    def preflight(self, origin: str, method: str, requested_headers: str) -> web.Response:
        """The answer to a preflight request: 200 with the allowances, or 400 saying why not."""
        problems = []
        if not self.allows_origin(origin):
            problems.append(f"origin {origin!r}")
        if not (self.any_method or method.upper() in self.methods):
            problems.append(f"method {method!r}")
        names = [h.strip().lower() for h in requested_headers.split(",") if h.strip()]
        refused = [name for name in names if not (self.any_header or name in self.headers)]
        if refused:
            problems.append(f"headers {', '.join(refused)}")
        if problems:
            return _json_error(f"Disallowed CORS {'; '.join(problems)}", HTTPStatus.BAD_REQUEST)
        headers = self.origin_headers(origin)
        headers["Access-Control-Allow-Methods"] = (
            _ALL_METHODS if self.any_method else ", ".join(self.methods)
        )
        if names:
            headers["Access-Control-Allow-Headers"] = (
                requested_headers if self.any_header else ", ".join(sorted(self.headers))
            )
        headers["Access-Control-Max-Age"] = "600"
        return web.Response(text="OK", headers=headers)


def cors_preflight_middleware(policy: CorsPolicy) -> Middleware:
    """Answer CORS preflight requests (OPTIONS with Origin and Access-Control-Request-Method)."""

    @web.middleware
    async def cors_preflight(request: web.Request, handler: Handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        method = request.headers.get("Access-Control-Request-Method")
        if request.method == "OPTIONS" and origin and method:
            return policy.preflight(
                origin, method, request.headers.get("Access-Control-Request-Headers", "")
            )
        return await handler(request)

    return cors_preflight


def cors_response_hook(
    policy: CorsPolicy,
) -> Callable[[web.Request, web.StreamResponse], Awaitable[None]]:
    """An on_response_prepare hook adding the CORS headers to an allowed origin's responses."""

    async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin and policy.allows_origin(origin):
            for name, value in policy.origin_headers(origin).items():
                response.headers.setdefault(name, value)

    return add_cors_headers


# --- the API key -----------------------------------------------------------------------------


def configured_api_keys(frontend: FrontendConfig) -> list[str]:
    """--api-key's keys, else the environment variable VLLM_API_KEY, as in vLLM."""
    keys = frontend.api_key or [os.environ.get(API_KEY_ENV, "")]
    return [key for key in keys if key]


def api_key_middleware(api_keys: list[str], root_path: str | None) -> Middleware:
    """401 for a request to a protected route without `Authorization: Bearer <key>`, one
    of `api_keys`.

    The /v1, /v2 and /inference routes are protected, as in vLLM 0.32, and /invocations, the
    profiler's and the development routes, which vLLM leaves open although the first
    answers what /v1 does and the others change the server's state; /health, /metrics,
    /tokenize ... are not. Keys are compared as SHA-256 digests with hmac.compare_digest, every one of them,
    so neither a key's content nor its length shows in the time a refusal takes. The key
    is what follows "Bearer " exactly, as vLLM reads it.
    """
    expected = [hashlib.sha256(key.encode()).digest() for key in api_keys]

    @web.middleware
    async def check_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method != "OPTIONS" and _is_protected(route_path(request, root_path)):
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            digest = hashlib.sha256(given.encode()).digest()
            matched = False
            for key in expected:
                matched |= hmac.compare_digest(digest, key)
            if not (matched and scheme.lower() == "bearer"):
                return _json_error(
                    "Unauthorized: send a valid API key as 'Authorization: Bearer <key>'",
                    HTTPStatus.UNAUTHORIZED,
                    {"WWW-Authenticate": "Bearer"},
                )
        return await handler(request)

    return check_api_key


_PROTECTED_ROUTES = frozenset(
    {
        "/invocations",
        "/start_profile",
        "/stop_profile",
        "/reset_prefix_cache",
        "/server_info",
        "/pause",
        "/resume",
        "/is_paused",
        "/abort_requests",
        "/sleep",
        "/wake_up",
        "/is_sleeping",
        "/release_kv_cache_memory",
    }
)


def _is_protected(path: str) -> bool:
    return path.startswith(("/v1", "/v2", "/inference")) or path in _PROTECTED_ROUTES


# --- route errors and body size ----------------------------------------------------------------


@web.middleware
async def route_error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """404 for an unknown route, 405 (with Allow) for a wrong method, 413 for a large body."""
    routing_error = request.match_info.http_exception
    if routing_error is not None:
        log_error_response(request, routing_error, routing_error.status)
    if isinstance(routing_error, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(routing_error.allowed_methods))
        return _json_error(
            f"Method Not Allowed: {request.method} {request.path} (allowed: {allowed})",
            HTTPStatus.METHOD_NOT_ALLOWED,
            {"Allow": allowed},
        )
    if routing_error is not None:
        return _json_error(
            f"Not Found: no route for {request.method} {request.path}", routing_error.status
        )
    length = request.content_length
    if length is not None and length > MAX_REQUEST_BODY_BYTES:
        return _too_large(length)
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge:  # a chunked body that grew past the limit
        return _too_large(None)


def _too_large(length: int | None) -> web.Response:
    size = f" of {length} bytes" if length is not None else ""
    return _json_error(
        f"the request body{size} is larger than the limit of {MAX_REQUEST_BODY_BYTES} bytes",
        HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
        close=True,  # the rest of the body is not read
    )


# --- X-Request-Id --------------------------------------------------------------------------------


async def request_id_hook(request: web.Request, response: web.StreamResponse) -> None:
    """--enable-request-id-headers: echo the client's X-Request-Id, or give a new one."""
    response.headers.setdefault(
        "X-Request-Id", request.headers.get("X-Request-Id") or uuid.uuid4().hex
    )


# --- request logging -------------------------------------------------------------------------


def request_log_middleware(max_log_len: int | None) -> Middleware:
    """--enable-log-requests: log each request's method, path and body (cut to --max-log-len)."""

    @web.middleware
    async def log_request(request: web.Request, handler: Handler) -> web.StreamResponse:
        body = (await request.read()).decode("utf-8", "replace") if request.can_read_body else ""
        if max_log_len is not None and len(body) > max_log_len:
            body = body[:max_log_len] + f"... ({len(body)} characters)"
        logger.info(
            "Received request %s %s from %s: %s",
            request.method,
            request.path_qs,
            request.remote,
            body or "(no body)",
        )
        return await handler(request)

    return log_request


# --- --middleware ----------------------------------------------------------------------------


def import_middlewares(paths: list[str]) -> list[Middleware]:
    """The aiohttp middlewares named by --middleware import paths ("package.module.name").

    Each must be an `async def (request, handler) -> response` function. Raises ConfigError
    naming the path when it cannot be imported or is not callable.
    """
    middlewares = []
    for path in paths:
        module_name, _, name = path.rpartition(".")
        try:
            function = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError) as error:
            raise ConfigError(f"--middleware {path}: cannot import it ({error})") from None
        if not callable(function):
            raise ConfigError(f"--middleware {path}: not a function")
        middlewares.append(_as_middleware(function))
    return middlewares


def _as_middleware(function: Callable[..., Awaitable[web.StreamResponse]]) -> Middleware:
    @web.middleware
    async def call(request: web.Request, handler: Handler) -> web.StreamResponse:
        return await function(request, handler)

    return call
