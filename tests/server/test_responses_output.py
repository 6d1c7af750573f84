"""The Responses API's output items and events from an answer given in pieces: with a
reasoning parser, a reasoning item then a message item, each opened by its first text and
closed before the next, the text of each whole and equal to the joined deltas, as vLLM
0.32's simple streaming path builds them; without one, a message alone; with a tool
parser, the calls read out of the text as function_call items, their markup never sent."""

from __future__ import annotations

import asyncio
import json

from aioserve.engine.outputs import CompletionOutput, RequestOutput
from aioserve.server.reasoning import ReasoningSplitter
from aioserve.server.responses_output import ResponseBuilder, response_events
from aioserve.server.tool_calls.parsers import new_tool_parser
from aioserve.server.tools import ToolUse

ECHOED = {
    "temperature": 0.0,
    "top_p": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "max_output_tokens": 16,
}
PIECES = ["<think>", "Let me", " see.</th", "ink>The", " answer", "."]  # one token each


def _outputs(pieces: list[str], finish_reason: str = "stop") -> list[RequestOutput]:
    return [
        RequestOutput(
            "r", None, [1, 2], [CompletionOutput(0, piece, [10 + i], None, None, reason)], False
        )
        for i, (piece, reason) in enumerate(
            zip(pieces, [None] * (len(pieces) - 1) + [finish_reason], strict=True)
        )
    ]


def _builder(parser: str | None, **body) -> ResponseBuilder:
    splitter = ReasoningSplitter(parser) if parser else None
    return ResponseBuilder("abc", "m", body, ECHOED, 2, splitter, lambda ids: "".join(
        PIECES[i - 10] for i in ids
    ), ToolUse(None), False)  # fmt: skip


def _streamed(builder: ResponseBuilder, outputs: list[RequestOutput]) -> list[dict]:
    async def deliver():
        for output in outputs:
            yield output

    async def run():
        return [event async for event in response_events(builder, deliver())]

    return asyncio.run(run())


def _whole(builder: ResponseBuilder, pieces: list[str], reason: str = "stop") -> dict:
    text = "".join(pieces)
    ids = [10 + i for i in range(len(pieces))]
    builder.add_whole(
        RequestOutput("r", None, [1, 2], [CompletionOutput(0, text, ids, None, None, reason)], True)
    )
    return builder.body()


def test_a_whole_answer_is_a_reasoning_item_then_a_message():
    body = _whole(_builder("deepseek_r1"), PIECES)
    reasoning, message = body["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"text": "Let me see.", "type": "reasoning_text"}]
    assert reasoning["status"] is None and reasoning["summary"] == []
    assert message["content"][0]["text"] == "The answer."
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == 4  # up to </think>
    dropped = _whole(_builder("deepseek_r1", include_reasoning=False), PIECES)
    assert [item["type"] for item in dropped["output"]] == ["message"]


def test_without_a_parser_an_empty_answer_is_still_a_message():
    body = _whole(_builder(None), [""], "length")
    assert [item["type"] for item in body["output"]] == ["message"]
    assert body["output"][0]["content"] == []
    assert (body["status"], body["incomplete_details"]) == (
        "incomplete",
        {"reason": "max_output_tokens"},
    )


def test_streamed_items_open_with_their_first_text_and_close_in_turn():
    events = _streamed(_builder("deepseek_r1"), _outputs(PIECES))
    names = [event["type"] for event in events]
    assert names == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        *["response.reasoning_text.delta"] * 2,
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * 3,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert all(list(event) == sorted(event) for event in events)  # vLLM's key order
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    content = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (reasoning, content) == ("Let me see.", "The answer.")
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [(e["output_index"], e["item"]["type"], e["item"]["status"]) for e in added] == [
        (0, "reasoning", "in_progress"),
        (1, "message", "in_progress"),
    ]
    final = events[-1]["response"]["output"]
    assert [item["status"] for item in final] == ["completed", "completed"]
    assert final[0]["content"][0]["text"] == reasoning and final[1]["content"][0]["text"] == content


def test_a_stream_with_no_text_has_no_items():
    events = _streamed(_builder(None), _outputs(["", ""]))
    assert [event["type"] for event in events] == [
        "response.created",
        "response.in_progress",
        "response.completed",
    ]


def test_a_failure_midway_is_a_numbered_error_event():
    from aioserve.server.errors import APIError

    async def failing():
        yield _outputs(PIECES)[0]
        raise APIError("the engine failed", 500)

    async def run():
        return [e async for e in response_events(_builder(None), failing())]

    events = asyncio.run(run())
    assert events[-1] == {
        "code": "InternalServerError",
        "message": "the engine failed",
        "param": None,
        "sequence_number": len(events) - 1,
        "type": "error",
    }
    assert not any(e["type"] == "response.completed" for e in events)


HERMES = ['Checking.\n<tool', '_call>{"name": "get_weather", ', '"arguments": {"city": "Par',
          'is"}}</tool_call>']  # fmt: skip


def _hermes_builder() -> ResponseBuilder:
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    tool_use = ToolUse([weather], new_tool_parser("hermes"))
    return ResponseBuilder("abc", "m", {}, ECHOED, 2, None, lambda ids: "", tool_use, True)


def test_a_call_read_from_the_answer_is_a_function_call_item_whole_and_streamed():
    whole = _whole(_hermes_builder(), HERMES)["output"]
    assert [item["type"] for item in whole] == ["message", "function_call"]
    assert whole[0]["content"][0]["text"] == "Checking.\n"
    assert (whole[1]["name"], json.loads(whole[1]["arguments"])) == (
        "get_weather",
        {"city": "Paris"},
    )

    events = _streamed(_hermes_builder(), _outputs(HERMES))
    names = [event["type"] for event in events]
    collapsed = [name for i, name in enumerate(names) if i == 0 or name != names[i - 1]]
    assert collapsed == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "Checking.\n"  # the markup never reaches the message
    arguments = "".join(
        e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
    )
    (done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert done["arguments"] == arguments and json.loads(arguments) == {"city": "Paris"}
    assert done["name"] == "get_weather" and done["output_index"] == 1
    final = events[-1]["response"]["output"]
    assert [item["type"] for item in final] == ["message", "function_call"]
    assert final[1]["call_id"] and final[1]["status"] == "completed"
