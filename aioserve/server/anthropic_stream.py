"""Anthropic's streamed Messages events, made from a chat completion's chunks as vLLM 0.32
makes them (entrypoints/anthropic/serving.py, message_stream_converter).

The first chunk (the role, with the prompt's usage) is `message_start`. Then each piece of
reasoning, text or tool call goes to the open content block when it is of its kind, else
the open block is stopped (`content_block_stop`) and a new one started
(`content_block_start`: thinking, text, or tool_use with its id and name and an empty
input) before its `content_block_delta` (thinking_delta, text_delta, input_json_delta); a
thinking block gets a `signature_delta` (a random hex signature) before it stops. Text that
arrives while a tool_use block is open is held back and sent as a text block of its own
after that block stops. The usage chunk at the end gives `message_delta` (stop_reason and
stop_sequence, and the usage), and `message_stop` ends the stream. As in vLLM there is no
`ping`, and every event's keys are in vLLM's order. An error once the stream has started
is an `error` event (`{"type": "error", "error": {"type": "internal_error", "message"}}`),
vLLM's, and ends the stream.

The stop reason is vLLM's mapping of chat's finish: "length" is max_tokens, a matched stop
string stop_sequence (with it) unless the tool calls made are whole, a finish after tool
calls tool_use, any other stop end_turn. Usage is vLLM's too: input_tokens are the
prompt's tokens less those read from the prefix cache, which, with
--enable-prompt-tokens-details, are cache_read_input_tokens.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from aioserve.server.errors import APIError

logger = logging.getLogger("aioserve.server")


def anthropic_usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    """A chat usage block as Anthropic's usage (vLLM's _build_anthropic_usage)."""
    if usage is None:
        return {"input_tokens": 0, "output_tokens": 0}
    input_tokens = usage["prompt_tokens"]
    block: dict[str, Any] = {"output_tokens": usage.get("completion_tokens") or 0}
    details = usage.get("prompt_tokens_details")
    if details is not None and details.get("cached_tokens") is not None:
        input_tokens -= details["cached_tokens"]
        block["cache_read_input_tokens"] = details["cached_tokens"]
    return {"input_tokens": max(0, input_tokens), **block}


def anthropic_stop_reason(
    finish_reason: str | None, stop_reason: int | str | None, tool_used: bool, tool_complete: bool
) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a chat finish (vLLM's _to_anthropic_stop_reason):
    `tool_used` whether a tool_use block was made, `tool_complete` whether its input is
    whole (a stop string that cut it short wins)."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(stop_reason, str):  # the stop string matched (a token id is not one)
        return "stop_sequence", stop_reason
    if finish_reason == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def new_signature() -> str:
    """A thinking block's signature: random, as vLLM's (nothing checks it)."""
    return uuid.uuid4().hex


class _Blocks:
    """The content blocks of a streamed message: which is open, and the events that open,
    fill and close them."""

    def __init__(self) -> None:
        self.next_index = 0
        self.kind: str | None = None  # the open block's type
        self.index: int | None = None
        self.signature: str | None = None  # an open thinking block's, until sent
        self.tool_use_id: str | None = None
        self.held_text: list[str] = []  # text that came while a tool_use block was open

    def start(self, block: dict[str, Any]) -> dict[str, Any]:
        event = {"type": "content_block_start", "content_block": block, "index": self.next_index}
        self.kind, self.index = block["type"], self.next_index
        self.signature = new_signature() if block["type"] == "thinking" else None
        self.tool_use_id = block.get("id")
        return event

    def delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        index = self.index if self.index is not None else self.next_index
        return {"type": "content_block_delta", "delta": delta, "index": index}

    def stop(self) -> list[dict[str, Any]]:
        if self.kind is None:
            return []
        events = []
        if self.signature is not None:
            events.append(self.delta({"type": "signature_delta", "signature": self.signature}))
        events.append({"type": "content_block_stop", "index": self.index})
        self.kind = self.index = self.signature = self.tool_use_id = None
        self.next_index += 1
        return events

    def stop_and_flush(self) -> list[dict[str, Any]]:
        """Stop the open block; send the text held back behind it as a block of its own."""
        held = "".join(self.held_text)
        self.held_text.clear()
        events = self.stop()
        if held:
            events.append(self.start({"type": "text", "text": ""}))
            events.append(self.delta({"type": "text_delta", "text": held}))
            events += self.stop()
        return events

    def switch_to(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        return [*self.stop_and_flush(), self.start(block)]


async def anthropic_events(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    """The Messages stream events of a chat stream's `chunks` (with usage in every chunk
    and a usage chunk at the end); closes `chunks` however it ends."""
    blocks = _Blocks()
    finish_reason: str | None = None
    stop_string: int | str | None = None
    tool_used = False
    last_arguments: list[str] = []  # the last tool_use block's, to see whether it is whole
    ids: dict[int, str] = {}  # tool call index -> its id
    started = False
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                if not started:
                    started = True
                    yield _message_start(chunk)
                    continue
                if not chunk["choices"]:  # the usage at the end
                    for event in blocks.stop_and_flush():
                        yield event
                    complete = tool_used and _is_json("".join(last_arguments))
                    reason, sequence = anthropic_stop_reason(
                        finish_reason or "stop", stop_string, tool_used, complete
                    )
                    yield {
                        "type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                        "usage": anthropic_usage(chunk.get("usage")),
                    }
                    continue
                choice = chunk["choices"][0]
                if choice["finish_reason"] is not None:
                    finish_reason, stop_string = choice["finish_reason"], choice.get("stop_reason")
                delta = choice["delta"]
                if reasoning := delta.get("reasoning"):
                    if blocks.kind != "thinking":
                        for event in blocks.switch_to({"type": "thinking", "thinking": ""}):
                            yield event
                    yield blocks.delta({"type": "thinking_delta", "thinking": reasoning})
                if content := delta.get("content"):
                    if blocks.kind == "tool_use":
                        blocks.held_text.append(content)
                    else:
                        if blocks.kind != "text":
                            for event in blocks.switch_to({"type": "text", "text": ""}):
                                yield event
                        yield blocks.delta({"type": "text_delta", "text": content})
                for call in delta.get("tool_calls") or []:
                    function = call.get("function") or {}
                    call_id = call.get("id")
                    if call_id is not None:
                        ids[call["index"]] = call_id
                        name = function.get("name")
                        if blocks.tool_use_id != call_id and name is not None:
                            tool_used, last_arguments = True, []
                            block = {"type": "tool_use", "id": call_id, "name": name, "input": {}}
                            for event in blocks.switch_to(block):
                                yield event
                    else:
                        call_id = ids.get(call["index"])
                    arguments = function.get("arguments")
                    if call_id is not None and arguments and blocks.tool_use_id == call_id:
                        last_arguments.append(arguments)
                        yield blocks.delta({"type": "input_json_delta", "partial_json": arguments})
        for event in blocks.stop_and_flush():
            yield event
        yield {"type": "message_stop"}
    except APIError as error:  # the engine failed the request after the stream started
        if not started:
            raise  # still answered as a JSON error (sse.py)
        yield _error_event(error.message)
    except Exception as error:
        if not started:
            raise
        logger.exception("an Anthropic Messages stream failed")
        yield _error_event(str(error))


def _message_start(chunk: dict[str, Any]) -> dict[str, Any]:
    message = {
        "id": chunk["id"],
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": chunk["model"],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": anthropic_usage(chunk.get("usage")),
    }
    return {"type": "message_start", "message": message}


def _error_event(message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": "internal_error", "message": message}}


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True
