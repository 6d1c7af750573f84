"""vLLM 0.32's scale-out routes (server/scale_out.py), on the shared in-process engine: off
by default (vLLM's 403); with --enable-scale-out the render routes (against GenerateRequests
built with vLLM's own classes), /inference/v1/generate (render -> generate gives
/v1/completions' tokens), its refusals, aborts; and --tokens-only."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from aioserve.config.engine import engine_config_from_args
from aioserve.config.frontend import frontend_config_from_args
from aioserve.config.parser import build_engine_parser
from tests.server.conftest import serve_built, wait_until_idle
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
        ("/v1/messages/render", {"model": "nope", "messages": []}, 404, "nope"),
        ("/v1/responses/render", {"input": "hi", "background": True}, 400, "background"),
        ("/v1/chat/completions/derender", {"generate_response": {}}, 400, "choices"),
    ],
)
def test_render_refusals_are_openai_errors(url, path, body, status, words):
    reply = post(url, path, body)
    assert reply.status == status
    error = reply.json()["error"]
    assert error["code"] == status and words in error["message"]


# --- /inference/v1/generate --------------------------------------------------------------------

PROMPT = "The capital of France is"


def _sse_events(reply) -> list:
    lines = [line for line in reply.body.decode().split("\n\n") if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 11}])
def test_render_then_generate_gives_the_completions_tokens(url, sampling):
    body = {"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, **sampling}
    completion = post(url, "/v1/completions", {**body, "return_token_ids": True}).json()
    (rendered,) = post(url, "/v1/completions/render", body).json()
    reply = post(url, "/inference/v1/generate", {**rendered, "return_token_ids": True})
    assert reply.status == 200, reply.body
    answer = reply.json()
    assert answer["request_id"] == "generate-tokens-" + rendered["request_id"]
    assert list(answer) == [
        "request_id",
        "model",
        "created",
        "usage",
        "prompt_logprobs",
        "prompt_token_id_logprobs",
        "prompt_token_ids",
        "mm_placeholders",
        "metrics",
        "kv_transfer_params",
        "ec_transfer_params",
        "output_mode",
        "choices",
    ]
    (choice,) = answer["choices"]
    assert choice["token_ids"] == completion["choices"][0]["token_ids"]
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert answer["prompt_token_ids"] == rendered["token_ids"]
    assert answer["usage"]["completion_tokens"] == 8
    assert answer["usage"]["prompt_tokens"] == len(rendered["token_ids"])


def test_generate_streams_the_same_tokens_with_usage(url, engine, server_loop):
    (rendered,) = post(
        url,
        "/v1/completions/render",
        {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True},
    ).json()
    whole = post(url, "/inference/v1/generate", rendered).json()["choices"][0]["token_ids"]
    body = {**rendered, "stream": True, "stream_options": {"include_usage": True}}
    body["sampling_params"] = {**rendered["sampling_params"], "logprobs": 1}
    events = _sse_events(post(url, "/inference/v1/generate", body))
    *chunks, last = events
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == whole
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert list(chunks[0]) == ["request_id", "usage", "output_mode", "choices"]
    logprob = chunks[0]["choices"][0]["logprobs"]["content"][0]
    assert logprob["token_id"] == whole[0] and logprob["top_logprobs"][0]["token_id"] == whole[0]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    wait_until_idle(engine, server_loop)


def test_generate_text_mode_adds_the_text(url):
    (rendered,) = post(
        url, "/v1/completions/render", {"prompt": PROMPT, "max_tokens": 5, "temperature": 0}
    ).json()
    text = post(
        url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "temperature": 0}
    ).json()
    answer = post(url, "/inference/v1/generate", {**rendered, "output_mode": "text"}).json()
    assert answer["output_mode"] == "text"
    assert answer["choices"][0]["text"] == text["choices"][0]["text"]


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"token_ids": []}, "body.token_ids"),
        ({"token_ids": [1, -2]}, "body.token_ids"),
        ({"sampling_params": {"top_p": 7}}, "body.sampling_params.top_p"),
        ({"sampling_params": {"colour": 1}}, "body.sampling_params.colour"),
        ({"sampling_params": None}, "body.sampling_params"),
        ({"features": {"mm_hashes": {}}}, "body.features"),
        ({"output_mode": "words"}, "body.output_mode"),
        ({"cache_salt": ""}, "body.cache_salt"),
        ({"token_ids": [10**9]}, "body.token_ids"),
    ],
)
def test_generate_refuses_bad_bodies_as_vllm(url, change, param):
    body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}, **change}
    reply = post(url, "/inference/v1/generate", body)
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "Bad Request" and error["code"] == 400
    if change.get("token_ids") == [1, -2]:  # vLLM's validator's words
        assert "token_ids must not contain negative values" in error["message"]


def test_a_client_gone_mid_stream_aborts_the_request(url, engine, server_loop):
    body = {
        "token_ids": [1, 2, 3],
        "stream": True,
        "sampling_params": {"max_tokens": 500, "ignore_eos": True},
    }

    async def leave_early() -> None:
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/inference/v1/generate", json=body) as response:
                await response.content.readline()

    asyncio.run(leave_early())
    wait_until_idle(engine, server_loop)


def test_abort_requests_ends_a_request_by_its_id(url, engine, server_loop):
    body = {
        "request_id": "to-abort",
        "token_ids": [1, 2, 3],
        "sampling_params": {"max_tokens": 900, "ignore_eos": True},
    }

    async def abort_while_running() -> dict:
        async with aiohttp.ClientSession() as session:
            running = asyncio.ensure_future(session.post(url + "/inference/v1/generate", json=body))
            while not engine.num_unfinished_requests:
                await asyncio.sleep(0.01)
            abort = {"request_ids": ["generate-tokens-to-abort"]}
            async with session.post(url + "/inference/v1/abort_requests", json=abort) as reply:
                assert reply.status == 200 and await reply.read() == b""
            async with await running as response:
                return await response.json()

    answer = asyncio.run(abort_while_running())
    assert answer["choices"][0]["finish_reason"] == "abort"
    assert len(answer["choices"][0]["token_ids"]) < 900
    assert post(url, "/inference/v1/abort_requests", {}).status == 400
    wait_until_idle(engine, server_loop)


# --- --tokens-only -----------------------------------------------------------------------------


def test_tokens_only_skips_the_tokenizer():
    args = build_engine_parser("aioserve serve").parse_args(["--tokens-only"])
    assert engine_config_from_args(args).model.skip_tokenizer_init is True
    assert frontend_config_from_args(args).tokens_only is True
    plain = build_engine_parser("aioserve serve").parse_args([])
    assert engine_config_from_args(plain).model.skip_tokenizer_init is False


def test_tokens_only_serves_generate_without_detokenizing(server_loop, engine):
    body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 3, "temperature": 0}}
    with serve_built(server_loop, engine, "--tokens-only") as tokens_url:
        answer = post(tokens_url, "/inference/v1/generate", body)
        assert answer.status == 200  # served without --enable-scale-out
        reply = post(tokens_url, "/inference/v1/generate", {**body, "output_mode": "text"})
        assert reply.status == 400 and "requires a tokenizer" in reply.json()["error"]["message"]
        stop = {**body, "sampling_params": {"max_tokens": 3, "stop": ["x"]}}
        reply = post(tokens_url, "/inference/v1/generate", stop)
        assert reply.status == 400
        assert reply.json()["error"]["message"].startswith("stop strings are not supported on a")
        assert post(tokens_url, "/abort_requests", {"request_ids": ["none"]}).status == 200
        detokenized = []
        engine_generate = engine.generate

        def spy(prompt, params, *args, **kwargs):
            detokenized.append(params.detokenize)
            return engine_generate(prompt, params, *args, **kwargs)

        engine.generate = spy
        try:
            assert post(tokens_url, "/inference/v1/generate", body).status == 200
        finally:
            del engine.generate
        assert detokenized == [False]
