"""The OpenAI generation routes: POST /v1/completions and POST /v1/chat/completions.

The handlers expect the app to carry a `ServerState` under `STATE` and to answer their
APIErrors through `error_middleware`. A client that disconnects aborts its request only if
the app's runner cancels handlers on disconnect (`web.AppRunner(app,
handler_cancellation=True)`); streams notice a gone client on their own.
"""

from __future__ import annotations

from aiohttp import web

from aioserve.server.chat import create_chat_completion
from aioserve.server.completions import create_completion


def add_openai_routes(app: web.Application) -> None:
    """Register /v1/completions and /v1/chat/completions on `app`."""
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
