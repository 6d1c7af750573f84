"""Function tools in /v1/responses on the default model, read by the official openai
client: tool_choice "required" and a named function give function_call items whose
arguments validate against the tool's parameters (jsonschema), the same calls as chat
completions gives for the same request (greedy), streamed as vLLM's
function_call_arguments events; earlier calls and their outputs in `input` render as
chat's assistant tool_calls and tool messages do."""

from __future__ import annotations

import json

import jsonschema
import pytest

from aioserve.config.frontend import frontend_config
from aioserve.server.state import ServerState
from tests.server.conftest import MODEL, openai_app, serve_app
from tests.server.openai_helpers import client, post
from tests.server.test_responses_api import _named_events
from tests.server.test_tool_calls import QUESTION, TIME, WEATHER
from tests.server.test_tools import TEMPLATE

pytestmark = pytest.mark.slow

# The Responses API's form of a function tool: its fields beside "type", not under "function".
TOOLS = [{"type": "function", **tool["function"]} for tool in (WEATHER, TIME)]
PARAMETERS = {tool["name"]: tool["parameters"] for tool in TOOLS}


@pytest.fixture(scope="module")
def url(engine, server_loop):
    """One server for the module, with a chat template that renders the tools."""
    state = ServerState(engine, [MODEL], frontend=frontend_config(chat_template=TEMPLATE))
    with serve_app(server_loop, openai_app(state)) as base_url:
        yield base_url


def _request(**fields) -> dict:
    # One call at most: SmolLM2 would otherwise list calls until max_output_tokens.
    return {
        "model": MODEL, "input": QUESTION, "tools": TOOLS, "temperature": 0,
        "parallel_tool_calls": False, **fields,
    }  # fmt: skip


def _calls(output: list[dict]) -> list[tuple[str, str]]:
    return [(item["name"], item["arguments"]) for item in output if item["type"] == "function_call"]


def _chat_calls(url: str, tool_choice) -> list[tuple[str, str]]:
    reply = client(url).chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=200,
    )
    return [(c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls]


@pytest.mark.parametrize(
    "choice, chat_choice",
    [
        ("required", "required"),
        (
            {"type": "function", "name": "get_time"},
            {"type": "function", "function": {"name": "get_time"}},
        ),
    ],
    ids=["required", "named"],
)
def test_forced_calls_are_function_call_items(url, choice, chat_choice):
    got = post(url, "/v1/responses", _request(tool_choice=choice, max_output_tokens=200)).json()
    calls = _calls(got["output"])
    assert calls, got["output"]
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), PARAMETERS[name])
    assert calls == _chat_calls(url, chat_choice)
    item = next(item for item in got["output"] if item["type"] == "function_call")
    assert item["id"].startswith("fc_") and item["call_id"] and item["status"] == "completed"
    assert list(item) == [
        "arguments", "call_id", "name", "type", "id", "async", "caller", "namespace", "status"
    ]  # fmt: skip
    # The tools and tool_choice come back as vLLM repeats them.
    assert [tool["name"] for tool in got["tools"]] == ["get_weather", "get_time"]
    assert list(got["tools"][0]) == [
        "name", "parameters", "strict", "type", "allowed_callers", "async", "defer_loading",
        "description", "output_schema",
    ]  # fmt: skip
    assert got["tool_choice"] == (choice if isinstance(choice, str) else {**choice})

    stream = post(
        url, "/v1/responses", _request(tool_choice=choice, max_output_tokens=200, stream=True)
    )
    events = _named_events(stream.body)
    added = [d["item"] for n, d in events if n == "response.output_item.added"]
    done = [d for n, d in events if n == "response.function_call_arguments.done"]
    deltas = {}
    for name, data in events:
        if name == "response.function_call_arguments.delta":
            deltas[data["item_id"]] = deltas.get(data["item_id"], "") + data["delta"]
    # Streamed, the arguments are the model's own text (as chat's deltas); whole, chat's
    # JSON of them: the same values.
    assert [(d["name"], json.loads(d["arguments"])) for d in done] == [
        (name, json.loads(arguments)) for name, arguments in calls
    ]
    assert [deltas[d["item_id"]] for d in done] == [d["arguments"] for d in done]
    assert all(item["status"] == "in_progress" and item["arguments"] == "" for item in added)


def test_the_openai_client_reads_the_calls(url):
    response = client(url).responses.create(
        model=MODEL,
        input=QUESTION,
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=200,
    )
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), PARAMETERS["get_weather"])


def test_earlier_calls_and_outputs_render_as_chat_history(url):
    call = {
        "type": "function_call",
        "call_id": "call_1",
        "name": "get_time",
        "arguments": '{"zone": "CET"}',
    }
    output = {"type": "function_call_output", "call_id": "call_1", "output": "14:05"}
    got = post(
        url,
        "/v1/responses",
        {"model": MODEL, "input": [*QUESTION, call, output], "tools": TOOLS, "tool_choice": "none",
         "temperature": 0, "max_output_tokens": 12},
    ).json()  # fmt: skip
    history = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "14:05"},
    ]  # fmt: skip
    reply = client(url).chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER, TIME], tool_choice="none",
        temperature=0, max_tokens=12,
    )  # fmt: skip
    assert got["output"][0]["content"][0]["text"] == reply.choices[0].message.content


def test_auto_reads_a_generated_hermes_output(start_openai_server):
    # A regex makes the model write the hermes format; the parser finds the call in it,
    # whole and as it streams, and the text before it is the message.
    url = start_openai_server(
        frontend=frontend_config(
            enable_auto_tool_choice=True, tool_call_parser="hermes", chat_template=TEMPLATE
        )
    )
    hermes = (
        r'Checking\.\n<tool_call>\{"name": "get_weather", "arguments": '
        r'\{"city": "[A-Z][a-z]{2,8}", "unit": "celsius"\}\}</tool_call>'
    )
    body = {
        "model": MODEL, "input": QUESTION, "tools": TOOLS, "temperature": 0,
        "max_output_tokens": 60, "structured_outputs": {"regex": hermes},
    }  # fmt: skip
    got = post(url, "/v1/responses", body).json()
    assert [item["type"] for item in got["output"]] == ["message", "function_call"]
    assert got["output"][0]["content"][0]["text"] == "Checking.\n"
    ((name, arguments),) = _calls(got["output"])
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), PARAMETERS[name])

    events = _named_events(post(url, "/v1/responses", {**body, "stream": True}).body)
    text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    assert text == "Checking.\n"  # the call's markup is never sent as text
    (done,) = [d for n, d in events if n == "response.function_call_arguments.done"]
    assert (done["name"], json.loads(done["arguments"])) == (name, json.loads(arguments))
    added = [d["item"]["type"] for n, d in events if n == "response.output_item.added"]
    assert added == ["message", "function_call"]
    final = events[-1][1]["response"]["output"]
    assert [item["type"] for item in final] == ["message", "function_call"]


def test_auto_without_a_tool_parser_renders_the_tools_and_answers_in_text(url):
    # vLLM's Responses route (unlike its chat route) takes tools on a server that parses
    # no calls: the template shows them and the answer is read as text.
    body = {"model": MODEL, "input": QUESTION, "tools": TOOLS, "temperature": 0,
            "max_output_tokens": 10}  # fmt: skip
    got = post(url, "/v1/responses", body)
    assert got.status == 200, got.body
    reply = client(url).chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER, TIME], tool_choice="none",
        temperature=0, max_tokens=10,
    )  # fmt: skip
    assert [item["type"] for item in got.json()["output"]] == ["message"]
    assert got.json()["output"][0]["content"][0]["text"] == reply.choices[0].message.content
    assert got.json()["tool_choice"] == "auto"


def test_a_whole_conversation_given_back_renders_as_chat_history(url):
    # What a client sends on its next turn: the last output items, then the call's result.
    items = [
        *QUESTION,
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Paris, so CET."}]},
        {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me check.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_time",
         "arguments": '{"zone": "CET"}'},
        {"type": "function_call_output", "call_id": "call_1",
         "output": [{"type": "input_text", "text": "14:05"}]},
    ]  # fmt: skip
    body = {"model": MODEL, "input": items, "tools": TOOLS, "tool_choice": "none",
            "temperature": 0, "max_output_tokens": 12}  # fmt: skip
    got = post(url, "/v1/responses", body)
    assert got.status == 200, got.body
    history = [
        *QUESTION,
        {"role": "assistant", "content": "Let me check.", "reasoning": "Paris, so CET.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "14:05"}]},
    ]  # fmt: skip
    reply = post(url, "/v1/chat/completions", {
        "model": MODEL, "messages": history, "tools": [WEATHER, TIME], "tool_choice": "none",
        "temperature": 0, "max_tokens": 12,
    }).json()  # fmt: skip
    text = got.json()["output"][0]["content"][0]["text"]
    assert text == reply["choices"][0]["message"]["content"]
    encrypted = {**items[1], "encrypted_content": "xyz"}
    refused = post(url, "/v1/responses", {**body, "input": [*QUESTION, encrypted]})
    assert refused.status == 400
    assert (
        refused.json()["error"]["message"]
        == "Encrypted content is not supported. (parameter=input)"
    )
