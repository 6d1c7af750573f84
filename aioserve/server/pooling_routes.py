"""Which routes a pooling model has, by its task, as vLLM 0.32 registers them.

(entrypoints/pooling/factories.py, register_pooling_api_routers; the routes listed in
vLLM's startup log for each kind of model.)

- an embedding model ("embed"): /v1/embeddings, /pooling, /score, /v1/score, /rerank,
  /v1/rerank, /v2/rerank (embeddings.py, scoring.py: the bi-encoder);
- a sequence classifier ("classify"): /classify and /pooling (classify.py, embeddings.py),
  and the scoring routes only when it has one label (a cross-encoder: scoring.py's
  cross-encoder branch); no /v1/embeddings. A route a model does not have is a 404.
"""

from __future__ import annotations

from aiohttp import web

from aioserve.server.classify import add_classify_routes
from aioserve.server.embeddings import add_embedding_routes, create_pooling
from aioserve.server.pooling_requests import pooling_task
from aioserve.server.scoring import add_scoring_routes
from aioserve.server.state import STATE


def add_pooling_routes(app: web.Application) -> None:
    """Register the routes of the served pooling model's task on `app` (app[STATE] set)."""
    engine = app[STATE].engine
    if pooling_task(engine) != "classify":
        add_embedding_routes(app)
        return
    app.router.add_post("/pooling", create_pooling)
    add_classify_routes(app)
    if engine.settings.pooler.scores_pairs:
        add_scoring_routes(app)
