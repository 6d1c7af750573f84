"""POST /invocations (SageMaker's route, as vLLM serves it): each kind of body gets the
answer of the route that kind has, checked against that route's own answer to the same
body; a body of no kind gets vLLM's 400 naming the kinds the model takes; --api-key
protects it as it protects /v1.

The generating model is the default one served as `aioserve serve` builds its app; the
pooling models are the stubs of test_pooling_http.py and test_classify_http.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
from aiohttp import web
from transformers import AutoTokenizer

from aioserve.server.errors import error_middleware
from aioserve.server.invocations import add_invocations_route
from aioserve.server.pooling_routes import add_pooling_routes
from aioserve.server.state import STATE, ServerState
from tests.server.conftest import serve_app, serve_built
from tests.server.openai_helpers import post
from tests.server.serve_process import fetch
from tests.server.test_classify_http import StubClassifier
from tests.server.test_pooling_http import StubEngine

S1 = "The quick brown fox jumps over the lazy dog."
GENERATING = "['ChatCompletionRequest', 'CompletionRequest']"


pytestmark = pytest.mark.usefixtures("no_api_key_env")


@pytest.fixture(scope="module")
def generating(server_loop, engine) -> Iterator[str]:
    with serve_built(server_loop, engine) as url:
        yield url


def _without_ids(body: dict) -> dict:
    return {key: value for key, value in body.items() if key not in ("id", "created")}


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
        ("/v1/completions", {"prompt": "The capital of France is"}),
        ("/v1/completions", {"prompt": [504, 3575, 282]}),
    ],
)
def test_a_generating_models_kinds_get_their_routes_answers(generating, route, body):
    body = {**body, "max_tokens": 6, "temperature": 0.0}
    invoked = post(generating, "/invocations", body)
    direct = post(generating, route, body)
    assert invoked.status == direct.status == 200, invoked.body
    assert _without_ids(invoked.json()) == _without_ids(direct.json())


def test_a_stream_comes_as_its_route_streams_it(generating):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    reply = fetch("POST", generating + "/invocations", body=body)
    assert reply.status == 200
    assert reply.headers["Content-Type"].startswith("text/event-stream")
    events = [line for line in reply.body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "chat.completion.chunk"


def test_a_bad_field_gets_its_routes_error_naming_it(generating):
    body = {"messages": [{"role": "user", "content": "Hi"}], "temperature": -1}
    invoked, direct = (
        post(generating, path, body) for path in ("/invocations", "/v1/chat/completions")
    )
    assert invoked.status == direct.status == 400
    assert invoked.json() == direct.json()
    assert invoked.json()["error"]["param"] == "temperature"


@pytest.mark.parametrize("body", [{}, {"input": S1}, {"message": []}])
def test_a_body_of_no_kind_gets_vllms_400(generating, body):
    reply = post(generating, "/invocations", body)
    assert reply.status == 400
    error = reply.json()["error"]
    assert error["message"] == (
        f"Cannot find suitable handler for request. Expected one of: {GENERATING}"
    )
    assert error["type"] == "BadRequestError"


def test_only_json_objects_are_read(generating):
    assert post(generating, "/invocations", raw=b"{oops").status == 400
    assert post(generating, "/invocations", [1, 2]).json()["error"]["message"] == (
        "the request body must be a JSON object"
    )
    reply = fetch(
        "POST", generating + "/invocations", raw=b"{}", headers={"Content-Type": "text/plain"}
    )
    assert reply.status == 400


def test_the_api_key_protects_it_as_it_protects_v1(server_loop, engine):
    body = {"prompt": "Hello", "max_tokens": 2}
    with serve_built(server_loop, engine, "--api-key", "s3cret") as url:
        assert post(url, "/invocations", body).status == 401
        assert fetch("POST", url + "/v2/rerank", body={}).status == 401
        reply = fetch(
            "POST", url + "/invocations", body=body, headers={"Authorization": "Bearer s3cret"}
        )
        assert reply.status == 200
        assert fetch("GET", url + "/health").status == 200


# --- pooling models ----------------------------------------------------------------------


@contextmanager
def _pooling(server_loop, engine, name: str) -> Iterator[str]:
    app = web.Application(middlewares=[error_middleware])
    app[STATE] = ServerState(engine, [name])
    add_pooling_routes(app)
    add_invocations_route(app)
    with serve_app(server_loop, app) as url:
        yield url


@pytest.fixture(scope="module")
def tokenizer(minilm_folder):
    return AutoTokenizer.from_pretrained(minilm_folder)


@pytest.fixture(scope="module")
def embedder(tokenizer, server_loop):
    with _pooling(server_loop, StubEngine(tokenizer), "minilm") as url:
        yield url


@pytest.fixture(scope="module")
def classifiers(tokenizer, server_loop):
    cross, labels = StubClassifier(tokenizer, 1), StubClassifier(tokenizer, 3)
    with (
        _pooling(server_loop, cross, cross.name) as ce,
        _pooling(server_loop, labels, labels.name) as cls,
    ):
        yield SimpleNamespace(ce=ce, cls=cls)


EMBEDDER_BODIES = [
    ("/v1/embeddings", {"input": S1}, 200),
    # The stub's tokenizer has no chat template: the embeddings route's 400, either way.
    ("/v1/embeddings", {"messages": [{"role": "user", "content": S1}]}, 400),
    ("/rerank", {"query": "fox", "documents": [S1, "a cat"]}, 200),
    ("/score", {"text_1": "fox", "text_2": [S1, "a cat"]}, 200),
    ("/score", {"queries": "fox", "documents": [S1]}, 200),
]


@pytest.mark.parametrize(("route", "body", "status"), EMBEDDER_BODIES)
def test_an_embedding_models_kinds_get_their_routes_answers(embedder, route, body, status):
    invoked, direct = post(embedder, "/invocations", body), post(embedder, route, body)
    assert invoked.status == direct.status == status, invoked.body
    assert _without_ids(invoked.json()) == _without_ids(direct.json())


@pytest.mark.parametrize(
    ("which", "route", "body"),
    [
        ("cls", "/classify", {"input": [S1, "a cat"]}),
        ("ce", "/classify", {"input": S1}),
        ("ce", "/rerank", {"query": "fox", "documents": [S1, "a cat"]}),
        ("ce", "/score", {"text_1": "fox", "text_2": S1}),
    ],
)
def test_a_classifiers_kinds_get_their_routes_answers(classifiers, which, route, body):
    url = getattr(classifiers, which)
    invoked, direct = post(url, "/invocations", body), post(url, route, body)
    assert invoked.status == direct.status == 200, invoked.body
    assert _without_ids(invoked.json()) == _without_ids(direct.json())


@pytest.mark.parametrize(
    ("which", "body", "kinds"),
    [
        ("embedder", {"prompt": S1}, "['EmbeddingRequest', 'RerankRequest', 'ScoreRequest']"),
        ("ce", {"messages_": S1}, "['ClassificationRequest', 'RerankRequest', 'ScoreRequest']"),
        ("cls", {"query": "fox", "documents": [S1]}, "['ClassificationRequest']"),
    ],
)
def test_a_pooling_models_400_names_its_own_kinds(embedder, classifiers, which, body, kinds):
    url = embedder if which == "embedder" else getattr(classifiers, which)
    reply = post(url, "/invocations", body)
    assert reply.status == 400
    assert reply.json()["error"]["message"] == (
        f"Cannot find suitable handler for request. Expected one of: {kinds}"
    )
