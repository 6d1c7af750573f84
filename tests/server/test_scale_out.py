"""vLLM 0.32's scale-out routes (server/scale_out.py): off by default (vLLM's 403), and the
render routes with --enable-scale-out, on the shared in-process engine."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.conftest import serve_built
from tests.server.openai_helpers import post

SCALE_OUT_PATHS = [
    "/v1/chat/completions/render",
    "/v1/messages/render",
    "/v1/completions/render",
    "/v1/responses/render",
    "/v1/chat/completions/derender",
    "/v1/completions/derender",
    "/inference/v1/generate",
    "/inference/v1/abort_requests",
]

# vLLM 0.32's body, from register_scale_out_api_routers' disabled_scale_out.
DISABLED = {
    "error": {
        "message": "Scale-out endpoints are disabled. Restart vllm serve with "
        "--enable-scale-out to enable them.",
        "type": "PermissionDeniedError",
        "param": None,
        "code": 403,
    }
}


@pytest.fixture(scope="module")
def default_url(server_loop, engine) -> Iterator[str]:
    with serve_built(server_loop, engine) as url:
        yield url


@pytest.mark.parametrize("path", SCALE_OUT_PATHS)
def test_without_the_flag_each_path_answers_vllms_403(default_url, path):
    reply = post(default_url, path, {"model": "x", "prompt": "hi"})
    assert reply.status == 403
    assert reply.json() == DISABLED


# --- render ------------------------------------------------------------------------------------

# Requests and what vLLM 0.32 renders for them: built with vLLM's own classes
# (CompletionRequest / ChatCompletionRequest.to_sampling_params, GenerateRequest.model_dump)
# on the token ids of this model's tokenizer and chat template, max_model_len 2048.
RENDERED = json.loads((Path(__file__).parent / "scale_out_render_vllm.json").read_text())


@pytest.fixture(scope="module")
def url(server_loop, engine) -> Iterator[str]:
    with serve_built(server_loop, engine, "--enable-scale-out") as url:
        yield url


@pytest.mark.parametrize("name", sorted(RENDERED))
def test_render_answers_vllms_generate_request(url, name):
    case = RENDERED[name]
    path = (
        "/v1/completions/render" if name.startswith("completion") else "/v1/chat/completions/render"
    )
    reply = post(url, path, case["request"])
    assert reply.status == 200, reply.body
    assert reply.json() == case["render"]


def test_rendered_tokens_are_the_tokenize_routes(url):
    case = RENDERED["chat_default"]["request"]
    tokens = post(url, "/tokenize", {"messages": case["messages"]}).json()["tokens"]
    rendered = post(url, "/v1/chat/completions/render", case).json()
    assert rendered["token_ids"] == tokens
    prompt = RENDERED["completion_greedy"]["request"]["prompt"]
    tokens = post(url, "/tokenize", {"prompt": prompt}).json()["tokens"]
    assert post(url, "/v1/completions/render", {"prompt": prompt}).json()[0]["token_ids"] == tokens


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        (
            "/v1/completions/render",
            {"prompt": "hi", "use_beam_search": True, "n": 2},
            400,
            "Beam search is not supported by the render endpoint",
        ),
        ("/v1/completions/render", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
        (
            "/v1/chat/completions/render",
            {"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
            404,
            "nope",
        ),
        ("/v1/chat/completions/render", {"messages": []}, 400, "messages"),
        ("/v1/messages/render", {"messages": []}, 501, "/v1/messages/render"),
    ],
)
def test_render_refusals_are_openai_errors(url, path, body, status, words):
    reply = post(url, path, body)
    assert reply.status == status
    error = reply.json()["error"]
    assert error["code"] == status and words in error["message"]
