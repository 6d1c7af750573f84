"""The Anthropic Messages pieces that need no model: chat chunks turned into Anthropic's
events as vLLM 0.32's converter turns them (a thinking block signed before it stops, text
held behind an open tool_use block and sent after it, an error once started as an
`error` event), vLLM's stop-reason and usage mapping, and the chat body a Messages body
becomes (anthropic_request.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from aioserve.server.anthropic_request import messages_chat_body
from aioserve.server.anthropic_stream import (
    anthropic_events,
    anthropic_stop_reason,
    anthropic_usage,
)
from aioserve.server.errors import APIError

HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m"}


def _chunk(delta: dict | None = None, finish: str | None = None, stop=None, **usage) -> dict:
    """A chat chunk with one choice (`delta`), or with `usage` only when `delta` is None."""
    if delta is None:
        return {**HEAD, "choices": [], "usage": usage}
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = stop
    return {**HEAD, "choices": [choice]}


async def _aiter(items):
    for item in items:
        if isinstance(item, Exception):
            raise item
        yield item


def _events(chunks: list) -> list[dict]:
    async def collect():
        return [event async for event in anthropic_events(_aiter(chunks))]

    return asyncio.run(collect())


START = _chunk({"role": "assistant", "content": ""})
END = _chunk(None, prompt_tokens=7, completion_tokens=5, total_tokens=12)


def test_blocks_open_and_close_in_vllms_order():
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": '{"a"'}}  # fmt: skip
    events = _events([
        START,
        _chunk({"reasoning": "Think"}),
        _chunk({"reasoning": "ing."}),
        _chunk({"content": "Hi."}),
        _chunk({"tool_calls": [call]}),
        _chunk({"content": " held"}),  # text while the tool_use block is open waits
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
               finish="tool_calls"),
        END,
    ])  # fmt: skip
    kinds = [(e["type"], e.get("index")) for e in events]
    assert kinds == [
        ("message_start", None),
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0),
        ("content_block_delta", 0), ("content_block_stop", 0),  # the signature, then stop
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_delta", 2), ("content_block_delta", 2),
        ("content_block_stop", 2),
        ("content_block_start", 3), ("content_block_delta", 3), ("content_block_stop", 3),
        ("message_delta", None), ("message_stop", None),
    ]  # fmt: skip
    assert events[1]["content_block"] == {"type": "thinking", "thinking": ""}
    assert events[4]["delta"]["type"] == "signature_delta" and events[4]["delta"]["signature"]
    assert events[9]["content_block"] == {
        "type": "tool_use",
        "id": "call_1",
        "name": "f",
        "input": {},
    }
    assert [events[i]["delta"]["partial_json"] for i in (10, 11)] == ['{"a"', ": 1}"]
    assert events[14]["delta"] == {"type": "text_delta", "text": " held"}
    assert events[16] == {
        "type": "message_delta",
        "delta": {"stop_reason": "tool_use", "stop_sequence": None},
        "usage": {"input_tokens": 7, "output_tokens": 5},
    }
    assert events[0]["message"]["usage"] == {"input_tokens": 0, "output_tokens": 0}


def test_a_stop_string_that_cuts_a_call_short_is_the_stop_reason():
    call = {"index": 0, "id": "c", "function": {"name": "f", "arguments": '{"a": '}}
    events = _events([START, _chunk({"tool_calls": [call]}, finish="stop", stop="</x>"), END])
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "</x>"}


def test_an_error_after_the_start_is_an_error_event_and_before_it_an_exception():
    failure = APIError("the model step failed", 500)
    events = _events([START, _chunk({"content": "a"}), failure])
    assert events[-1] == {
        "type": "error",
        "error": {"type": "internal_error", "message": "the model step failed"},
    }
    with pytest.raises(APIError):
        _events([failure])


@pytest.mark.parametrize(
    "finish, stop, used, whole, expected",
    [
        ("length", "x", True, True, ("max_tokens", None)),
        ("stop", None, False, False, ("end_turn", None)),
        ("stop", 2, False, False, ("end_turn", None)),  # a stop token is no stop sequence
        ("stop", "END", False, False, ("stop_sequence", "END")),
        ("stop", "END", True, True, ("tool_use", None)),
        ("stop", None, True, False, ("tool_use", None)),
        ("tool_calls", None, False, False, ("tool_use", None)),
        ("abort", None, False, False, (None, None)),
    ],
)
def test_stop_reasons_are_vllms(finish, stop, used, whole, expected):
    assert anthropic_stop_reason(finish, stop, used, whole) == expected


def test_cached_tokens_are_read_from_the_cache():
    usage = {
        "prompt_tokens": 40,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 32},
    }
    assert anthropic_usage(usage) == {
        "input_tokens": 8, "output_tokens": 3, "cache_read_input_tokens": 32
    }  # fmt: skip


def _chat(**body) -> dict:
    return messages_chat_body(
        {"model": "m", "max_tokens": 4, **body}, "m", merge_inline_system=False
    )


def test_a_messages_body_becomes_vllms_chat_body():
    chat = _chat(
        system="S",
        messages=[
            {"role": "user", "content": [{"type": "text", "text": ""}]},  # nothing: dropped
            {"role": "assistant", "content": [
                {"type": "redacted_thinking", "data": "xyz"},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
                {"type": "tool_result", "tool_use_id": "t0", "content": [{"type": "text", "text": "r"}]},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [
                    {"type": "text", "text": "one"},
                    {"type": "tool_reference", "tool_name": "g"},
                ]},
            ]},
        ],
        stop_sequences=["END"], top_k=5, stream=True, metadata={"user_id": "u"},
        tools=[{"name": "f", "input_schema": {"properties": {}}}],
        tool_choice={"type": "any"}, cache_salt="salt",
    )  # fmt: skip
    assert chat["messages"] == [
        {"role": "system", "content": "S"},
        {"role": "assistant", "content": "Tool result: [{'type': 'text', 'text': 'r'}]",
         "tool_calls": [{"id": "t1", "type": "function",
                         "function": {"name": "f", "arguments": json.dumps({"a": 1})}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "one"},
        {"role": "tool", "tool_call_id": "t1", "content": [{"type": "tool_reference", "name": "g"}]},
    ]  # fmt: skip
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "f", "description": None, "parameters": {"properties": {}, "type": "object"},
        "strict": None, "defer_loading": None}}]  # fmt: skip
    assert (chat["tool_choice"], chat["parallel_tool_calls"]) == ("required", True)
    assert (chat["stop"], chat["top_k"], chat["max_tokens"], chat["cache_salt"]) == (
        ["END"], 5, 4, "salt"
    )  # fmt: skip
    assert chat["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert "metadata" not in chat


def test_output_config_and_thinking_become_chat_fields():
    schema = {"type": "object"}
    chat = _chat(
        messages=[{"role": "user", "content": "x"}],
        output_config={"effort": "high", "format": {"type": "json_schema", "schema": schema}},
    )
    assert chat["response_format"] == {
        "type": "json_schema", "json_schema": {"schema": schema, "name": "json_schema"}
    }  # fmt: skip
    assert chat["reasoning_effort"] == "high"
    disabled = messages_chat_body(
        {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
         "output_config": {"effort": "high"}, "thinking": {"type": "disabled"}},
        "m", merge_inline_system=False, disabled_thinking_effort="low",
    )  # fmt: skip
    assert disabled["reasoning_effort"] == "low"  # thinking wins, as in vLLM
