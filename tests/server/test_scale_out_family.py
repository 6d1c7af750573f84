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

from tests.server.conftest import serve_built
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
def parsers_url(server_loop, engine) -> Iterator[str]:
    """A server with vLLM's recording flags: --reasoning-parser qwen3, hermes tool calls."""
    settings = engine.settings
    engine.settings = dataclasses.replace(settings, reasoning_parser="qwen3")
    flags = ("--enable-scale-out", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    try:
        with serve_built(server_loop, engine, *flags) as url:
            yield url
    finally:
        engine.settings = settings


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
