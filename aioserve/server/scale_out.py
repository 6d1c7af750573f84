"""vLLM 0.32's scale-out routes, for disaggregated serving, and when they are served.

    POST /v1/completions/render, /v1/chat/completions/render,     request -> GenerateRequest
         /v1/messages/render, /v1/responses/render                (render_routes.py)
    POST /v1/completions/derender, /v1/chat/completions/derender  generate response -> the
                                                                  OpenAI answer, whole or
                                                                  a chunk at a time
                                                                  (derender_routes.py)
    POST /inference/v1/generate                                   tokens in, tokens out
    POST /inference/v1/abort_requests                             abort requests by id
                                                                  (generate_tokens.py)
    POST /abort_requests         the same, with --tokens-only (unless VLLM_SERVER_DEV_MODE=1
                                 serves its own there, as in vLLM)

They are served with --enable-scale-out or --tokens-only (vLLM's
`register_scale_out_api_routers`); without either each path answers vLLM's 403,
PermissionDeniedError, "Scale-out endpoints are disabled. Restart vllm serve with
--enable-scale-out to enable them." A pooling model has none of them, as in vLLM (they
belong to the generate task). The /inference paths need the API key as the /v1 ones do
(middlewares.py), as in vLLM.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from http import HTTPStatus

from aiohttp import web

from aioserve.config.frontend import FrontendConfig
from aioserve.server.derender_routes import derender_chat_completion, derender_completion
from aioserve.server.dev_routes import dev_mode
from aioserve.server.errors import APIError
from aioserve.server.generate_tokens import abort_requests, generate
from aioserve.server.render_routes import (
    render_chat_completion,
    render_completion,
    render_messages,
    render_responses,
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

DISABLED_MESSAGE = (
    "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
)
"""vLLM 0.32's answer (403) on a scale-out path when the routes are not registered."""

RENDER_PATHS = (
    "/v1/chat/completions/render",
    "/v1/messages/render",
    "/v1/completions/render",
    "/v1/responses/render",
)
DERENDER_PATHS = ("/v1/chat/completions/derender", "/v1/completions/derender")
GENERATE_PATHS = ("/inference/v1/generate", "/inference/v1/abort_requests")


def scale_out_enabled(frontend: FrontendConfig) -> bool:
    """Whether the scale-out routes are served (vLLM: --enable-scale-out, or the dedicated
    --tokens-only mode)."""
    return frontend.enable_scale_out or frontend.tokens_only


def add_scale_out_routes(app: web.Application, frontend: FrontendConfig) -> None:
    """The scale-out routes, or vLLM's 403 on each of their paths when they are off."""
    if not scale_out_enabled(frontend):
        for path in (*RENDER_PATHS, *DERENDER_PATHS, *GENERATE_PATHS):
            app.router.add_post(path, _disabled)
        return
    served: dict[str, Handler] = {
        "/v1/completions/render": render_completion,
        "/v1/chat/completions/render": render_chat_completion,
        "/v1/messages/render": render_messages,
        "/v1/responses/render": render_responses,
        "/v1/chat/completions/derender": derender_chat_completion,
        "/v1/completions/derender": derender_completion,
        "/inference/v1/generate": generate,
        "/inference/v1/abort_requests": abort_requests,
    }
    for path in (*RENDER_PATHS, *DERENDER_PATHS, *GENERATE_PATHS):
        app.router.add_post(path, served[path])
    if frontend.tokens_only and not dev_mode():  # vLLM's legacy path; dev mode has its own
        app.router.add_post("/abort_requests", abort_requests)


async def _disabled(request: web.Request) -> web.Response:
    raise APIError(DISABLED_MESSAGE, HTTPStatus.FORBIDDEN, error_type="PermissionDeniedError")
