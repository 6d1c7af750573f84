"""Tools in POST /v1/messages on the default model, read by the official `anthropic` client,
on a server with --enable-auto-tool-choice --tool-call-parser hermes and a chat template
that renders the tools: tool_choice "tool" (a named function) and "any" give tool_use
blocks whose input validates against the tool's schema and is what chat completions calls
for the same request (greedy), stop_reason tool_use, streamed as input_json_delta events
(the tools there are strict: as in vLLM 0.32, forced calls are held to hermes's format by
a structural tag, which holds only a strict tool's arguments to its schema);
"auto" reads the model's own hermes output (a conversation that shows the model the
call to copy drives it there); "none" answers in text; tool_use and tool_result history
renders as chat's tool_calls and tool messages; tool_addition / tool_removal blocks change
the tools the template shows."""

from __future__ import annotations

import json

import jsonschema
import pytest

from aioserve.config.frontend import frontend_config
from aioserve.server.state import ServerState
from tests.server.conftest import MODEL, openai_app, serve_app
from tests.server.openai_helpers import post
from tests.server.test_anthropic_messages import GREEDY, api, chat, message, streamed
from tests.server.test_tool_calls import QUESTION, TIME, WEATHER
from tests.server.test_tools import TEMPLATE

pytestmark = pytest.mark.slow


def _anthropic_tool(tool: dict) -> dict:
    function = tool["function"]
    described = {"description": function["description"]} if "description" in function else {}
    return {"name": function["name"], **described, "input_schema": function["parameters"]}


TOOLS = [_anthropic_tool(tool) for tool in (WEATHER, TIME)]
SCHEMAS = {tool["name"]: tool["input_schema"] for tool in TOOLS}
STRICT_TOOLS = [{**tool, "strict": True} for tool in TOOLS]
STRICT_CHAT_TOOLS = [
    {**tool, "function": {**tool["function"], "strict": True}} for tool in (WEATHER, TIME)
]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
ASK = {"role": "user", "content": "What is the weather in Paris?"}
# SmolLM2 copies the answer it was shown: it writes the hermes call itself.
SHOWN_THE_CALL = [ASK, {"role": "assistant", "content": CALL}] * 2 + [ASK]


@pytest.fixture(scope="module")
def url(engine, server_loop):
    frontend = frontend_config(
        chat_template=TEMPLATE, enable_auto_tool_choice=True, tool_call_parser="hermes"
    )
    with serve_app(
        server_loop, openai_app(ServerState(engine, [MODEL], frontend=frontend))
    ) as base:
        yield base


def _chat_calls(
    url: str, messages: list, tool_choice, tools=(WEATHER, TIME), **fields
) -> list[tuple[str, dict]]:
    reply = chat(
        url, messages, tools=list(tools), tool_choice=tool_choice, max_tokens=200, **fields
    )
    calls = reply["choices"][0]["message"].get("tool_calls") or []
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def _uses(content: list[dict]) -> list[tuple[str, dict]]:
    return [(block["name"], block["input"]) for block in content if block["type"] == "tool_use"]


@pytest.mark.parametrize(
    "choice, chat_choice",
    [
        ({"type": "tool", "name": "get_time"}, {"type": "function", "function": {"name": "get_time"}}),
        ({"type": "any", "disable_parallel_tool_use": True}, "required"),
    ],
    ids=["tool", "any"],
)  # fmt: skip
def test_forced_tools_give_tool_use_blocks(url, choice, chat_choice):
    got = message(url, max_tokens=200, messages=QUESTION, tools=STRICT_TOOLS, tool_choice=choice)
    uses = _uses(got["content"])
    assert uses and got["stop_reason"] == "tool_use"
    for name, arguments in uses:
        jsonschema.validate(arguments, SCHEMAS[name])
    parallel = {"parallel_tool_calls": False} if choice["type"] == "any" else {}
    assert uses == _chat_calls(url, QUESTION, chat_choice, STRICT_CHAT_TOOLS, **parallel)
    block = next(block for block in got["content"] if block["type"] == "tool_use")
    assert list(block) == ["type", "id", "name", "input"] and block["id"]

    events = streamed(
        url, max_tokens=200, messages=QUESTION, tools=STRICT_TOOLS, tool_choice=choice
    )
    starts = [d for n, d in events if n == "content_block_start"]
    tool_starts = [d for d in starts if d["content_block"]["type"] == "tool_use"]
    assert [(d["content_block"]["name"], d["content_block"]["input"]) for d in tool_starts] == [
        (name, {}) for name, _ in uses
    ]
    for start in tool_starts:
        pieces = [
            d["delta"]["partial_json"]
            for n, d in events
            if n == "content_block_delta" and d["index"] == start["index"]
        ]
        assert json.loads("".join(pieces)) == uses[tool_starts.index(start)][1]
    (delta,) = [d for n, d in events if n == "message_delta"]
    assert delta["delta"]["stop_reason"] == "tool_use"


def test_the_client_reads_a_streamed_tool_use(url):
    with api(url).messages.stream(
        model=MODEL,
        max_tokens=200,
        messages=QUESTION,
        tools=STRICT_TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    ) as stream:
        final = stream.get_final_message()
    (use,) = [block for block in final.content if block.type == "tool_use"]
    assert use.name == "get_weather" and final.stop_reason == "tool_use"
    jsonschema.validate(use.input, SCHEMAS["get_weather"])


def test_auto_reads_the_models_hermes_call(url):
    got = api(url).messages.create(
        model=MODEL, max_tokens=60, messages=SHOWN_THE_CALL, tools=TOOLS, extra_body=GREEDY
    )
    assert [block.type for block in got.content] == ["tool_use"]
    assert (got.content[0].name, got.content[0].input) == ("get_weather", {"city": "Paris"})
    assert got.stop_reason == "tool_use"
    assert _chat_calls(url, SHOWN_THE_CALL, "auto") == [("get_weather", {"city": "Paris"})]
    events = streamed(url, max_tokens=60, messages=SHOWN_THE_CALL, tools=TOOLS)
    blocks = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [(b["type"], b["name"]) for b in blocks] == [("tool_use", "get_weather")]
    partial = "".join(d["delta"]["partial_json"] for n, d in events if n == "content_block_delta")
    assert json.loads(partial) == {"city": "Paris"}
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_none_answers_in_text_with_the_tools_shown(url):
    got = message(url, max_tokens=12, messages=QUESTION, tools=TOOLS, tool_choice={"type": "none"})
    expected = chat(url, QUESTION, tools=[WEATHER, TIME], tool_choice="none", max_tokens=12)
    assert got["content"] == [
        {"type": "text", "text": expected["choices"][0]["message"]["content"]}
    ]
    assert got["usage"]["input_tokens"] == expected["usage"]["prompt_tokens"]
    assert got["stop_reason"] in ("end_turn", "max_tokens")


def test_tool_use_and_tool_result_history_render_as_chat_history(url):
    messages = [
        *QUESTION,
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Paris is in CET.", "signature": "abc"},
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"zone": "CET"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": False,
             "content": [{"type": "text", "text": "14:05"}, {"type": "text", "text": "CET"}]},
            {"type": "text", "text": "Thanks."},
        ]},
    ]  # fmt: skip
    got = message(url, max_tokens=12, messages=messages, tools=TOOLS, tool_choice={"type": "none"})
    history = [
        *QUESTION,
        {"role": "assistant", "content": "Let me check.", "reasoning": "Paris is in CET.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "14:05\nCET"},
        {"role": "user", "content": "Thanks."},
    ]  # fmt: skip
    expected = chat(url, history, tools=[WEATHER, TIME], tool_choice="none", max_tokens=12)
    assert got["content"][0]["text"] == expected["choices"][0]["message"]["content"]
    assert got["usage"]["input_tokens"] == expected["usage"]["prompt_tokens"]


def _count(url: str, **fields) -> int:
    reply = post(url, "/v1/messages/count_tokens", {"model": MODEL, "messages": QUESTION, **fields})
    assert reply.status == 200, reply.body
    return reply.json()["input_tokens"]


def test_tool_additions_and_removals_change_the_tools(url):
    weather, time = TOOLS
    add_time = {"type": "tool_addition", "tool": {"type": "tool_definition", "definition": time}}
    remove_weather = {
        "type": "tool_removal",
        "tool": {"type": "tool_reference", "name": "get_weather"},
    }
    system = {"role": "system", "content": [{"type": "text", "text": "Be brief."}, add_time]}
    plain_system = {"role": "system", "content": "Be brief."}
    both = _count(url, messages=[plain_system, *QUESTION], tools=[weather, time])
    assert _count(url, messages=[system, *QUESTION], tools=[weather]) == both
    system["content"].append(remove_weather)
    only_time = _count(url, messages=[plain_system, *QUESTION], tools=[time])
    assert _count(url, messages=[system, *QUESTION], tools=[weather]) == only_time != both
    refused = post(url, "/v1/messages/count_tokens", {
        "model": MODEL, "messages": [{"role": "user", "content": [add_time]}], "tools": [weather],
    })  # fmt: skip
    assert refused.status == 400
    assert 'only allowed in messages with role "system"' in refused.json()["error"]["message"]
    unknown = {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "nope"}}
    refused = post(url, "/v1/messages/count_tokens", {
        "model": MODEL, "messages": [{"role": "system", "content": [unknown]}, *QUESTION],
        "tools": [weather],
    })  # fmt: skip
    assert refused.status == 400
    assert "references tool 'nope'" in refused.json()["error"]["message"]
