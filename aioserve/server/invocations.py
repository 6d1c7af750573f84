"""POST /invocations: SageMaker's inference route, as vLLM serves it beside /ping.

One route takes every kind of request the served model answers, and hands the body to the
route that kind has (vLLM 0.32's entrypoints/serve/sagemaker/api_router.py), trying the
kinds in vLLM's order:

- a generating model: a chat completion (a body with `messages`), then a completion
  (`prompt` or `prompt_embeds`);
- an embedding model: embeddings (`input` or `messages`), rerank (`query` and
  `documents`), score (`queries`/`documents`, `queries`/`items`, `data_1`/`data_2` or
  `text_1`/`text_2`);
- a classifier: classify (`input` or `messages`), then rerank and score when it scores
  pairs (a cross-encoder).

vLLM picks the first kind whose whole request model validates the body, so a chat body
with one bad value falls through and is answered "Cannot find suitable handler"; here the
kind is picked by the fields that make it, and the body then gets its route's own answer,
the error naming the bad field included. A body of no kind gets vLLM's 400.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from aioserve.server.body_fields import read_json_body
from aioserve.server.chat import create_chat_completion
from aioserve.server.classify import create_classify
from aioserve.server.completions import create_completion
from aioserve.server.embeddings import create_embedding
from aioserve.server.errors import APIError
from aioserve.server.pooling_requests import pooling_task
from aioserve.server.scoring import SCORE_SIDES, create_rerank, create_score
from aioserve.server.state import STATE

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Invocation:
    """One kind of request /invocations takes: vLLM's name for its request model, whether
    a body is of that kind, and the route that answers it."""

    name: str
    matches: Callable[[dict[str, Any]], bool]
    handler: Handler


def _has_any(*keys: str) -> Callable[[dict[str, Any]], bool]:
    return lambda body: any(body.get(key) is not None for key in keys)


def _is_rerank(body: dict[str, Any]) -> bool:
    return "query" in body and "documents" in body


def _is_score(body: dict[str, Any]) -> bool:
    return any(first in body and second in body for first, second in SCORE_SIDES)


CHAT = Invocation("ChatCompletionRequest", _has_any("messages"), create_chat_completion)
COMPLETION = Invocation("CompletionRequest", _has_any("prompt", "prompt_embeds"), create_completion)
EMBEDDING = Invocation("EmbeddingRequest", _has_any("input", "messages"), create_embedding)
CLASSIFICATION = Invocation("ClassificationRequest", _has_any("input", "messages"), create_classify)
RERANK = Invocation("RerankRequest", _is_rerank, create_rerank)
SCORE = Invocation("ScoreRequest", _is_score, create_score)


def invocation_kinds(app: web.Application) -> list[Invocation]:
    """The kinds of request the served model answers, in the order vLLM tries them."""
    engine = app[STATE].engine
    if engine.settings.runner_type != "pooling":
        return [CHAT, COMPLETION]
    if pooling_task(engine) != "classify":
        return [EMBEDDING, RERANK, SCORE]
    if engine.settings.pooler.scores_pairs:
        return [CLASSIFICATION, RERANK, SCORE]
    return [CLASSIFICATION]


def add_invocations_route(app: web.Application) -> None:
    """Register POST /invocations for the served model's kinds of request on `app`."""
    kinds = invocation_kinds(app)

    async def invoke(request: web.Request) -> web.StreamResponse:
        body = await read_json_body(request)  # kept by aiohttp for the route's own read
        for kind in kinds:
            if kind.matches(body):
                return await kind.handler(request)
        names = [kind.name for kind in kinds]
        raise APIError(f"Cannot find suitable handler for request. Expected one of: {names}")

    app.router.add_post("/invocations", invoke)
