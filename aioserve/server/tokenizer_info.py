"""GET /tokenizer_info (--enable-tokenizer-info-endpoint): the tokenizer's configuration.

As vLLM 0.32's route (entrypoints/serve/tokenize): the keyword arguments the tokenizer was
built with (`init_kwargs`, tokenizer_config.json's values: special tokens, the added
tokens, model_max_length, the tokenizer's own chat_template, ...) without the file paths
vocab_file and merges_file, special tokens as their text; then `tokenizer_class`, the
tokenizer's class name; then `chat_template`, the template of --chat-template (the file's
text) when it is given, replacing the tokenizer's. Without the flag the route does not
exist (404, as vLLM's); without a tokenizer (--skip-tokenizer-init) it answers 400.

The route is not under /v1, so --api-key does not guard it (nor vLLM's); it may expose the
chat template, which is why it is off by default.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from aioserve.server.chat_template import load_chat_template
from aioserve.server.errors import APIError
from aioserve.server.state import STATE


def tokenizer_config(tokenizer: Any, chat_template: str | None) -> dict[str, Any]:
    """What /tokenizer_info answers for `tokenizer` and --chat-template's template."""
    config = dict(getattr(tokenizer, "init_kwargs", None) or {})
    config.pop("vocab_file", None)
    config.pop("merges_file", None)
    config = _jsonable(config)
    config["tokenizer_class"] = type(tokenizer).__name__
    if chat_template:
        config["chat_template"] = chat_template
    return config


def _jsonable(value: Any) -> Any:
    """`value` with special tokens (AddedToken) as their text, as vLLM writes them."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {key: _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    return value


async def get_tokenizer_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    tokenizer = state.engine.tokenizer
    if tokenizer is None:
        raise APIError(
            "/tokenizer_info needs the tokenizer, which is not loaded (--skip-tokenizer-init)"
        )
    configured = state.frontend.chat_template
    template = load_chat_template(configured) if configured else None
    # The standard json module: model_max_length is often past orjson's 64-bit integers,
    # and added_tokens_decoder's integer keys become strings as in vLLM's answer.
    body = json.dumps(tokenizer_config(tokenizer, template), default=str)
    return web.Response(text=body, content_type="application/json")


def add_tokenizer_info_route(app: web.Application) -> None:
    app.router.add_get("/tokenizer_info", get_tokenizer_info)
