"""The OpenAI generation routes: POST /v1/completions, POST /v1/chat/completions and
POST /v1/responses (with the stored-response routes, which find nothing: responses_api.py),
and as in vLLM Anthropic's POST /v1/messages and POST /v1/messages/count_tokens
(anthropic_api.py).

The handlers expect the app to carry a `ServerState` under `STATE` and to answer their
APIErrors through `error_middleware`. A client that disconnects aborts its request only if
the app's runner cancels handlers on disconnect (`web.AppRunner(app,
handler_cancellation=True)`); streams notice a gone client on their own.
"""

from __future__ import annotations

from aiohttp import web

from aioserve.server.anthropic_api import add_anthropic_routes
from aioserve.server.chat import create_chat_completion
from aioserve.server.completions import create_completion
from aioserve.server.responses_api import create_response, stored_response_not_found


def add_openai_routes(app: web.Application) -> None:
    """Register the generation routes on `app`."""
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", stored_response_not_found)
    app.router.add_post("/v1/responses/{response_id}/cancel", stored_response_not_found)
    add_anthropic_routes(app)
