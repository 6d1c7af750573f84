"""What POST /v1/responses sends back: the response object, its output items, and the
stream of events that builds them (responses_api.py reads the request).

The answer is split into output items as vLLM 0.32's simple (non-harmony) path splits it:
with --reasoning-parser, a reasoning item (its text as one `reasoning_text` part), then a
message item for the content, then with a tool parser one function_call item per call,
each only when it has something; without either parser, a single message item (with no
content part when the answer is empty). Streamed, a call is read from the content as it
arrives (chat's ToolCallStream): its item opens with response.output_item.added, takes
response.function_call_arguments.delta events and closes with
response.function_call_arguments.done and response.output_item.done. Any other item opens with
response.output_item.added and response.content_part.added when its first piece of text
arrives, takes response.reasoning_text.delta or response.output_text.delta events, and
closes with the text's done event, response.content_part.done and
response.output_item.done; response.created and response.in_progress come first and
response.completed last (or, when the engine fails the request midway, an "error" event
instead, OpenAI's shape, numbered as the others). Every event's keys are in vLLM's (alphabetical) order and carry
a sequence number counting from 0. Keys and their order elsewhere are vLLM's too.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing
from typing import Any

from aioserve.engine.outputs import RequestMetrics, RequestOutput
from aioserve.server.chat import calls_in_answer
from aioserve.server.errors import APIError
from aioserve.server.reasoning import ReasoningSplitter, count_reasoning_tokens
from aioserve.server.request_metrics import timing_metrics
from aioserve.server.tool_calls.streaming import ToolCallStream
from aioserve.server.tools import ToolUse

_ID_PREFIXES = {"reasoning": "rs", "message": "msg", "function_call": "fc"}


class _Item:
    """One output item: a reasoning item, the assistant's message, or a function call (its
    text then being the call's arguments)."""

    def __init__(self, kind: str, name: str | None = None, call_id: str | None = None) -> None:
        self.kind = kind
        self.id = f"{_ID_PREFIXES[kind]}_{secrets.token_hex(8)}"
        self.text = ""
        self.name, self.call_id = name, call_id

    def part(self, logprobs: list | None = None) -> dict[str, Any]:
        if self.kind == "reasoning":
            return {"text": self.text, "type": "reasoning_text"}
        return {"annotations": [], "text": self.text, "type": "output_text", "logprobs": logprobs}

    def body(self, status: str | None) -> dict[str, Any]:
        """The item as "in_progress" (opened in a stream), "completed" (closed in a
        stream), or None (in a whole response: a message says "completed" then, a
        reasoning item nothing, as vLLM's)."""
        done = status != "in_progress"
        if self.kind == "function_call":
            call = {
                "arguments": self.text,
                "call_id": self.call_id,
                "name": self.name,
                "type": "function_call",
                "id": self.id,
                "async": None,
                "caller": None,
                "namespace": None,
                "status": status or "completed",
            }
            return call
        if self.kind == "reasoning":
            return {
                "id": self.id,
                "summary": [],
                "type": "reasoning",
                "content": [self.part()] if done else None,
                "encrypted_content": None,
                "status": status,
            }
        return {
            "id": self.id,
            "content": [self.part()] if done and self.text else [],
            "role": "assistant",
            "status": status or "completed",
            "type": "message",
            "phase": None,
        }


class ResponseBuilder:
    """The response of one request as its answer arrives (whole, or in deltas)."""

    def __init__(
        self,
        response_id: str,
        model: str,
        body: dict[str, Any],
        echoed: dict[str, Any],
        input_tokens: int,
        splitter: ReasoningSplitter | None,
        decode: Callable[[list[int]], str],
        tool_use: ToolUse,
        server_parses_calls: bool,
    ) -> None:
        self.id = response_id
        self.created_at = int(time.time())
        self.model, self.request, self.echoed = model, body, echoed
        self.input_tokens, self.cached_tokens = input_tokens, 0
        self.splitter, self.decode, self.tool_use = splitter, decode, tool_use
        # vLLM sends a message item for an empty answer only when it parses nothing.
        self.plain = splitter is None and tool_use.parser is None and not server_parses_calls
        # In a stream with a tool parser: the content read for calls as it arrives.
        self.calls: ToolCallStream | None = None
        self.include_reasoning = body.get("include_reasoning", True) is not False
        self.token_ids: list[int] = []
        self.items: list[_Item] = []
        self.item_status: str | None = None  # "completed" once streamed (_Item.body)
        self.status, self.incomplete_reason = "in_progress", None
        self.text = ""  # the raw generated text (--enable-log-outputs)
        self.finish_reason: str | None = None  # the engine's
        self.request_metrics: RequestMetrics | None = None
        self.with_metrics = False  # --enable-per-request-metrics: "metrics" when done

    def take(self, output: RequestOutput) -> Iterator[tuple[str, Any]]:
        """Take an engine output (the whole answer, or its next delta); yield its text as
        (item kind, piece) in order, the reasoning's apart from the message's, and in a
        stream with a tool parser the calls' deltas as ("call", chat's tool_calls delta)."""
        sample = output.outputs[0]
        self.token_ids += sample.token_ids
        self.text += sample.text
        self.finish_reason = sample.finish_reason
        self.request_metrics = output.metrics
        self.cached_tokens = output.num_cached_tokens or 0
        last = sample.finish_reason is not None
        if last:
            length = sample.finish_reason == "length"
            self.status = "incomplete" if length else "completed"
            self.incomplete_reason = "max_output_tokens" if length else None
        reasoning, content = "", sample.text
        if self.splitter is not None:
            split = self.splitter.feed(sample.text, last=last)
            reasoning = split.reasoning if self.include_reasoning else ""
            content = split.content
        if reasoning:
            yield "reasoning", reasoning
        deltas = None
        if self.calls is not None:
            content, deltas = self.calls.feed(content, last)
        if content:
            yield "message", content
        for call in deltas or []:
            yield "call", call

    def add_whole(self, output: RequestOutput) -> None:
        """Take the whole answer and build its items: reasoning, message and calls, each
        only when it has something (without a reasoning or tool parser, a message even
        when empty, as vLLM does)."""
        text = {"reasoning": "", "message": ""}
        for kind, piece in self.take(output):
            text[kind] += piece
        content, calls = text["message"], None
        if self.tool_use.parser is not None:
            finish_reason = output.outputs[0].finish_reason
            content, calls, _ = calls_in_answer(self.tool_use, content or None, finish_reason)
        if text["reasoning"]:
            self.items.append(_Item("reasoning"))
            self.items[-1].text = text["reasoning"]
        if content or self.plain:
            self.items.append(_Item("message"))
            self.items[-1].text = content or ""
        for call in calls or []:
            function = call["function"]
            self.items.append(_Item("function_call", function["name"], call["id"]))
            self.items[-1].text = function["arguments"]

    def body(self) -> dict[str, Any]:
        done = self.status != "in_progress"
        request = self.request
        return {
            "id": self.id,
            "created_at": self.created_at,
            "incomplete_details": (
                {"reason": self.incomplete_reason} if self.incomplete_reason else None
            ),
            "instructions": request.get("instructions"),
            "metadata": request.get("metadata"),
            "model": self.model,
            "object": "response",
            "output": [item.body(self.item_status) for item in self.items] if done else [],
            "parallel_tool_calls": request.get("parallel_tool_calls") is not False,
            "temperature": self.echoed["temperature"],
            "tool_choice": _tool_choice_echo(request),
            "tools": [_tool_echo(tool) for tool in request.get("tools") or []],
            "top_p": self.echoed["top_p"],
            "background": False,
            "max_output_tokens": self.echoed["max_output_tokens"],
            "max_tool_calls": None,
            "previous_response_id": None,
            "prompt": None,
            "reasoning": _reasoning_echo(request.get("reasoning")),
            "service_tier": request.get("service_tier", "auto"),
            "status": self.status,
            "text": _text_echo(request.get("text")),
            "top_logprobs": None,
            "truncation": "disabled",
            "usage": self._usage() if done else None,
            "user": request.get("user"),
            **(
                {"metrics": timing_metrics(self.request_metrics, len(self.token_ids))}
                if self.with_metrics and done
                else {}  # vLLM leaves the key out when there are no metrics
            ),
            "presence_penalty": self.echoed["presence_penalty"],
            "frequency_penalty": self.echoed["frequency_penalty"],
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "input_messages": None,
            "output_messages": None,
        }

    def _usage(self) -> dict[str, Any]:
        reasoning_tokens = 0
        if self.splitter is not None:
            reasoning_tokens = count_reasoning_tokens(self.splitter, self.token_ids, self.decode)
        output_tokens = len(self.token_ids)
        return {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {
                "cached_tokens": self.cached_tokens,
                "cache_write_tokens": 0,
                "input_tokens_per_turn": [],
                "cached_tokens_per_turn": [],
            },
            "output_tokens": output_tokens,
            "output_tokens_details": {
                "reasoning_tokens": reasoning_tokens,
                "tool_output_tokens": 0,
                "output_tokens_per_turn": [],
                "tool_output_tokens_per_turn": [],
            },
            "total_tokens": self.input_tokens + output_tokens,
        }


def _tool_echo(tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool as vLLM's response repeats it: every key, null if unset."""
    keys = ("name", "parameters", "strict", "type", "allowed_callers", "async")
    more = ("defer_loading", "description", "output_schema")
    return {key: tool.get(key) for key in (*keys, *more)}


def _tool_choice_echo(request: dict[str, Any]) -> Any:
    """The request's tool_choice as vLLM repeats it: "auto" by default with tools, "none"
    without; a named function as {name, type}."""
    choice = request.get("tool_choice")
    if not request.get("tools"):
        return "none" if choice in (None, "auto") else choice
    if isinstance(choice, dict):
        return {"name": choice.get("name"), "type": "function"}
    return choice or "auto"


def _reasoning_echo(reasoning: Any) -> dict[str, Any] | None:
    """The request's `reasoning` as vLLM's response repeats it: every key, null if unset."""
    if not isinstance(reasoning, dict):
        return None
    keys = ("context", "effort", "generate_summary", "mode", "summary")
    return {key: reasoning.get(key) for key in keys}


def _text_echo(text: Any) -> dict[str, Any] | None:
    """The request's `text` as vLLM's response repeats it."""
    if not isinstance(text, dict):
        return None
    fmt = text.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        fmt = {
            "name": fmt.get("name"),
            "schema": fmt.get("schema"),
            "type": "json_schema",
            "description": fmt.get("description"),
            "strict": fmt.get("strict"),
        }
    return {"format": fmt, "verbosity": text.get("verbosity")}


async def response_events(
    response: ResponseBuilder, outputs: AsyncIterator[RequestOutput]
) -> AsyncIterator[dict[str, Any]]:
    """vLLM's stream of events for the answer `outputs` delivers in deltas."""
    number = -1

    def event(kind: str, **fields: Any) -> dict[str, Any]:
        nonlocal number
        number += 1
        fields.update(sequence_number=number, type=kind)
        return dict(sorted(fields.items()))  # vLLM's events list their keys in this order

    def opened(item: _Item) -> Iterator[dict[str, Any]]:
        index = index_of(item)
        yield event("response.output_item.added", item=item.body("in_progress"), output_index=index)
        if item.kind == "function_call":
            return  # a call has no content part
        yield event(
            "response.content_part.added",
            content_index=0,
            item_id=item.id,
            output_index=index,
            part=item.part([]),  # the item has no text yet
        )

    def index_of(item: _Item) -> int:
        return response.items.index(item)

    def delta(item: _Item, piece: str) -> dict[str, Any]:
        if item.kind == "function_call":
            return event(
                "response.function_call_arguments.delta",
                delta=piece,
                item_id=item.id,
                output_index=index_of(item),
            )
        where = {"content_index": 0, "item_id": item.id, "output_index": index_of(item)}
        if item.kind == "reasoning":
            return event("response.reasoning_text.delta", delta=piece, **where)
        return event("response.output_text.delta", delta=piece, logprobs=[], **where)

    def closed(item: _Item) -> Iterator[dict[str, Any]]:
        index = index_of(item)
        if item.kind == "function_call":
            yield event(
                "response.function_call_arguments.done",
                arguments=item.text,
                item_id=item.id,
                name=item.name,
                output_index=index,
            )
        else:
            where = {"content_index": 0, "item_id": item.id, "output_index": index}
            if item.kind == "reasoning":
                yield event("response.reasoning_text.done", text=item.text, **where)
            else:
                yield event("response.output_text.done", logprobs=[], text=item.text, **where)
            yield event("response.content_part.done", part=item.part(None), **where)
        yield event("response.output_item.done", item=item.body("completed"), output_index=index)

    def switched_to(item: _Item) -> Iterator[dict[str, Any]]:
        """Close the current item and open `item` after it."""
        if response.items:
            yield from closed(response.items[-1])
        response.items.append(item)
        yield from opened(item)

    response.item_status = "completed"
    if response.tool_use.parser is not None:
        response.calls = ToolCallStream(response.tool_use.parser, response.tool_use.single_call)
    calls: dict[int, _Item] = {}  # by the call's index in the answer
    async with aclosing(outputs):
        first = await anext(outputs, None)  # a refusal still reaches the client as JSON
        yield event("response.created", response=response.body())
        yield event("response.in_progress", response=response.body())
        output = first
        while output is not None:
            for kind, piece in response.take(output):
                if kind == "call":  # chat's tool_calls delta: a new call, or more arguments
                    function = piece["function"]
                    if "id" in piece:
                        item = _Item("function_call", function["name"], piece["id"])
                        calls[piece["index"]] = item
                        for opening in switched_to(item):
                            yield opening
                    item, piece = calls[piece["index"]], function["arguments"]
                    if not piece:
                        continue
                else:
                    item = response.items[-1] if response.items else None
                    if item is None or item.kind != kind:
                        item = _Item(kind)
                        for opening in switched_to(item):
                            yield opening
                item.text += piece
                yield delta(item, piece)
            try:
                output = await anext(outputs, None)
            except APIError as error:  # the engine failed the request after it started
                fields = error.body()["error"]
                yield event(
                    "error", code=fields["type"], message=fields["message"], param=fields["param"]
                )
                return
    if response.items:
        for closing in closed(response.items[-1]):
            yield closing
    yield event("response.completed", response=response.body())
