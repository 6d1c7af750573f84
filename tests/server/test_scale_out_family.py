"""The rest of vLLM 0.32's scale-out render family (--enable-scale-out), over HTTP, against
vLLM's own answers: /v1/messages/render, /v1/responses/render,
/v1/chat/completions/derender and /v1/completions/derender, whole and streamed.

scale_out_family_vllm.json holds each request and what vLLM's GPU-less render server
(`vllm launch render`, SmolLM2-135M-Instruct, context 2,048) answered, recorded by
tools/record_scale_out_vllm.py; a streamed derender step by step, each step sending the
stream_state vLLM answered the step before. The answers are compared whole, but for
`created` (a time) and, in errors vLLM's validation layer words its own way, the message
(the status, type and param are compared)."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import MODEL, serve_built
from tests.server.openai_helpers import post

RECORDED = json.loads((Path(__file__).parent / "scale_out_family_vllm.json").read_text())
CASES = {case["name"]: case for case in RECORDED["cases"]}
# Errors whose words are vLLM's validation layer's (pydantic) or name the served models
# another way: their status, type and param are compared, not their message.
_OWN_WORDS = ("Bad Request", "NotFoundError")


@pytest.fixture(scope="module")
def url(server_loop, engine) -> Iterator[str]:
    with serve_built(server_loop, engine, "--enable-scale-out") as url:
        yield url


@pytest.fixture(scope="module")
def tools_url(server_loop, engine) -> Iterator[str]:
    flags = ("--enable-scale-out", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    with serve_built(server_loop, engine, *flags) as url:
        yield url


@pytest.fixture
def parsers_url(tools_url, engine, monkeypatch) -> str:
    """A server with vLLM's recording flags: --reasoning-parser qwen3 (for this test),
    hermes tool calls."""
    settings = dataclasses.replace(engine.settings, reasoning_parser="qwen3")
    monkeypatch.setattr(engine, "settings", settings)
    return tools_url


_CALL_ID = re.compile(r"^(chatcmpl-tool-)?[0-9a-f]{16,32}$")


def _normalized(answer: Any, key: str = "") -> Any:
    """`answer` without its times, tool call ids as "ID" (both are random), and the chat
    template's end-of-turn token out of any content (vLLM's parsers see the output with
    special tokens and leave <|im_end|> in some contents; aioserve reads it as
    /v1/chat/completions does, special tokens skipped)."""
    if isinstance(answer, dict):
        return {k: _normalized(v, k) for k, v in answer.items() if k != "created"}
    if isinstance(answer, list):
        return [_normalized(v, key) for v in answer]
    if key in ("id", "last_tool_call_ids") and isinstance(answer, str) and _CALL_ID.match(answer):
        return "ID"
    if key == "content" and isinstance(answer, str):
        return answer.replace("<|im_end|>", "")
    return answer


def _assert_same(case: dict[str, Any], status: int, answer: Any) -> None:
    assert status == case["status"], answer
    expected = case["answer"]
    if status != 200:
        error, wanted = answer["error"], expected["error"]
        assert (error["type"], error["param"], error["code"]) == (
            wanted["type"],
            wanted["param"],
            wanted["code"],
        ), error
        if wanted["type"] not in _OWN_WORDS:
            assert error["message"] == wanted["message"]
        return
    assert _normalized(answer) == _normalized(expected)


# Where aioserve answers otherwise, and why.
DEPARTURES = {
    # /v1/messages' translation checks its fields itself (anthropic_request.py) and names
    # them; vLLM's validation layer answers type "Bad Request", param "body.model".
    "messages_no_model": (400, "BadRequestError", "model"),
    # tool_choice "any" is chat's "required", which aioserve serves without a
    # --tool-call-parser (structured outputs make the answer a call, README "Tools"), on
    # /v1/chat/completions as here; vLLM 0.32 refuses it there and here.
    "messages_tools": (200, None, None),
}


@pytest.mark.parametrize(
    "name", sorted(n for n, c in CASES.items() if not c.get("parsers") and n not in DEPARTURES)
)
def test_answers_as_vllm(url, name):
    case = CASES[name]
    reply = post(url, case["path"], case["body"], headers=case["headers"])
    _assert_same(case, reply.status, reply.json())


@pytest.mark.parametrize("name", sorted(DEPARTURES))
def test_the_departures(url, name):
    case = CASES[name]
    status, error_type, param = DEPARTURES[name]
    reply = post(url, case["path"], case["body"], headers=case["headers"])
    assert reply.status == status, reply.body
    if status != 200:
        assert (reply.json()["error"]["type"], reply.json()["error"]["param"]) == (
            error_type,
            param,
        )
    else:
        structured = reply.json()["sampling_params"]["structured_outputs"]
        assert "get_weather" in json.dumps(structured["json"])


_TOOL_STREAM = "parsed_stream_tool_call_"


@pytest.mark.parametrize(
    "name",
    sorted(n for n, c in CASES.items() if c.get("parsers") and not n.startswith(_TOOL_STREAM)),
)
def test_parsed_answers_as_vllm(parsers_url, name):
    case = CASES[name]
    reply = post(parsers_url, case["path"], case["body"], headers=case["headers"])
    _assert_same(case, reply.status, reply.json())


def test_a_streamed_tool_call_as_vllm(parsers_url):
    """A call streamed across chunks: each chunk as vLLM's but for where the call's deltas
    fall (aioserve's hermes parser announces a call once its name is whole and sends its
    arguments as they parse, vLLM's at other points); the call they add up to is vLLM's,
    its id the same in every chunk and in the state."""
    steps = sorted((n for n in CASES if n.startswith(_TOOL_STREAM)), key=lambda n: int(n[-1]))
    ours, theirs = [], []
    for name in steps:
        case = CASES[name]
        reply = post(parsers_url, case["path"], case["body"])
        assert reply.status == case["status"] == 200
        answers = reply.json(), json.loads(json.dumps(case["answer"]))
        for answer, calls in zip(answers, (ours, theirs), strict=True):
            for choice in answer["chunk"]["choices"]:
                calls.extend(choice["delta"].pop("tool_calls", None) or [])
            call_ids = answer["stream_state"].pop("last_tool_call_ids")
            assert len(call_ids) == (1 if calls else 0)
            assert answer["stream_state"].pop("tools_streamed") is bool(calls)
        assert _normalized(answers[0]) == _normalized(answers[1]), name
    call_id = _merged(ours)["id"]
    assert _merged(ours) == _merged(theirs) | {"id": call_id}
    assert {call["id"] for call in ours if call["id"]} == {call_id}


def _merged(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """The one call a stream's tool_calls deltas add up to."""
    assert {d["index"] for d in deltas} == {0}
    merged = {"id": None, "type": None, "name": None, "arguments": ""}
    for delta in deltas:
        for key in ("id", "type"):
            merged[key] = merged[key] or delta[key]
        merged["name"] = merged["name"] or delta["function"]["name"]
        merged["arguments"] += delta["function"]["arguments"] or ""
    return merged


# --- render -> generate -> derender: the coupled routes' answers -----------------------------

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


def _generated(url: str, rendered: dict[str, Any]) -> dict[str, Any]:
    reply = post(url, "/inference/v1/generate", {**rendered, "return_token_ids": True})
    assert reply.status == 200, reply.body
    return reply.json()


def _sse(reply) -> list[dict[str, Any]]:
    events = [line.removeprefix("data: ") for line in reply.body.decode().split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def test_a_chat_derendered_is_the_chat_completion(url):
    body = {"messages": QUESTION, **GREEDY, "logprobs": True, "top_logprobs": 2}
    coupled = post(url, "/v1/chat/completions", body).json()
    rendered = post(url, "/v1/chat/completions/render", body).json()
    derender = {
        "generate_response": _generated(url, rendered),
        "prompt_tokens": len(rendered["token_ids"]),
        "prompt_token_ids": rendered["token_ids"],
        "chat_request": body,
    }
    reply = post(url, "/v1/chat/completions/derender", derender)
    assert reply.status == 200, reply.body
    answer = reply.json()
    assert answer["id"] == "generate-tokens-" + rendered["request_id"]  # generate's id
    (choice,), (wanted,) = answer["choices"], coupled["choices"]
    assert choice["message"]["content"] == wanted["message"]["content"]
    assert choice["finish_reason"] == wanted["finish_reason"] == "length"
    ours, theirs = choice["logprobs"]["content"], wanted["logprobs"]["content"]
    assert [e["token"] for e in ours] == [e["token"] for e in theirs]
    assert [[t["token"] for t in e["top_logprobs"]] for e in ours] == [
        [t["token"] for t in e["top_logprobs"]] for e in theirs
    ]
    assert [e["logprob"] for e in ours] == pytest.approx([e["logprob"] for e in theirs])
    assert answer["usage"] == coupled["usage"]


def test_a_streamed_derender_adds_up_to_the_whole(url):
    body = {
        "messages": QUESTION,
        **GREEDY,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    rendered = post(url, "/v1/chat/completions/render", body).json()
    events = _sse(post(url, "/inference/v1/generate", rendered))
    whole = post(url, "/v1/chat/completions", {**body, "stream": False, "stream_options": None})
    content, roles, state = "", [], None
    for event in events:
        step = {
            "stream": True,
            "generate_chunk": event,
            "prompt_token_ids": rendered["token_ids"],
            "prompt_tokens": len(rendered["token_ids"]),
        }
        if state is not None:
            step["stream_state"] = state
        reply = post(url, "/v1/chat/completions/derender", step)
        assert reply.status == 200, reply.body
        chunk, state = reply.json()["chunk"], reply.json()["stream_state"]
        for choice in chunk["choices"]:
            content += choice["delta"]["content"] or ""
            roles.append(choice["delta"]["role"])
        assert len(state["prev_tokens"]) <= 5  # the window, not the history
    assert content == whole.json()["choices"][0]["message"]["content"]
    assert roles[0] == "assistant" and set(roles[1:]) == {None}
    assert chunk["usage"]["completion_tokens"] == 12  # the last chunk: generate's usage


def test_completions_derendered_are_the_completion(url):
    body = {"prompt": ["The capital of France is", "1, 2, 3,"], **GREEDY, "logprobs": 1}
    coupled = post(url, "/v1/completions", body).json()
    rendered = post(url, "/v1/completions/render", body).json()
    derender = {
        "generate_responses": [_generated(url, r) for r in rendered],
        "prompt_tokens": [len(r["token_ids"]) for r in rendered],
    }
    answer = post(url, "/v1/completions/derender", derender).json()
    assert answer["id"] == "generate-tokens-" + rendered[0]["request_id"]
    for choice, wanted in zip(answer["choices"], coupled["choices"], strict=True):
        assert (choice["index"], choice["text"]) == (wanted["index"], wanted["text"])
        assert choice["logprobs"]["tokens"] == wanted["logprobs"]["tokens"]
        assert choice["logprobs"]["text_offset"] == wanted["logprobs"]["text_offset"]
    assert answer["usage"] == coupled["usage"]


def test_a_streamed_completion_derender_adds_up_to_the_text(url):
    body = {"prompt": "Once upon a time", **GREEDY, "stream": True, "logprobs": 0}
    (rendered,) = post(url, "/v1/completions/render", body).json()
    whole = post(url, "/v1/completions", {**body, "stream": False}).json()["choices"][0]
    text, offsets, state = "", [], None
    for event in _sse(post(url, "/inference/v1/generate", rendered)):
        step = {"stream": True, "generate_chunk": event, "prompt_token_ids": rendered["token_ids"]}
        if state is not None:
            step["stream_state"] = state
        answer = post(url, "/v1/completions/derender", step).json()
        state = answer["stream_state"]
        for choice in answer["chunk"]["choices"]:
            text += choice["text"]
            offsets += choice["logprobs"]["text_offset"]
    assert text == whole["text"] and offsets == whole["logprobs"]["text_offset"]


def test_a_messages_render_runs_as_the_message(url):
    body = {"model": MODEL, "max_tokens": 12, "messages": QUESTION, "temperature": 0}
    message = post(url, "/v1/messages", body).json()
    rendered = post(url, "/v1/messages/render", body).json()
    generated = _generated(url, rendered)
    derender = {"generate_response": generated, "prompt_token_ids": rendered["token_ids"]}
    chat = post(url, "/v1/chat/completions/derender", derender).json()
    assert chat["choices"][0]["message"]["content"] == message["content"][0]["text"]
    assert len(rendered["token_ids"]) == message["usage"]["input_tokens"]


def test_a_responses_render_runs_as_the_response(url):
    body = {"model": MODEL, "input": "Name a colour.", "max_output_tokens": 10, "temperature": 0}
    response = post(url, "/v1/responses", body).json()
    rendered = post(url, "/v1/responses/render", body).json()
    assert rendered["request_id"].startswith("resp_")
    assert len(rendered["token_ids"]) == response["usage"]["input_tokens"]
    derender = {
        "generate_response": _generated(url, rendered),
        "prompt_token_ids": rendered["token_ids"],
    }
    chat = post(url, "/v1/chat/completions/derender", derender).json()
    assert chat["choices"][0]["message"]["content"] == response["output"][0]["content"][0]["text"]


def test_tokens_only_cannot_derender(server_loop, engine):
    body = {"generate_response": {"choices": [{"index": 0, "token_ids": [5]}]}}
    with serve_built(server_loop, engine, "--tokens-only") as tokens_url:
        reply = post(tokens_url, "/v1/chat/completions/derender", body)
    assert reply.status == 400 and "requires a tokenizer" in reply.json()["error"]["message"]
