"""Tool calls end to end on the default model, through the official `openai` client.

tool_choice "required" and a named function are enforced by structured outputs: every
call must name one of the tools and carry arguments that validate against its parameters
(`jsonschema`), streamed (deltas joined by index) and not, greedy and sampled. The "auto"
path with --tool-call-parser hermes is driven by a regex that makes the model write the
hermes format, so that the parser's reading of a real generated output is checked. The
chat template (--chat-template) is one that renders the tools, as a tools-capable model's
does.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from aioserve.config.frontend import frontend_config
from tests.server.conftest import MODEL
from tests.server.openai_helpers import client
from tests.server.test_tools import TEMPLATE

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = {tool["function"]["name"]: tool for tool in (WEATHER, TIME)}
QUESTION = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]


@pytest.fixture
def api(start_openai_server):
    return client(start_openai_server(frontend=frontend_config(chat_template=TEMPLATE)))


def assert_valid_call(name: str, arguments: str) -> None:
    assert name in TOOLS, name
    jsonschema.validate(json.loads(arguments), TOOLS[name]["function"]["parameters"])


def streamed_calls(stream) -> tuple[list[tuple[str, str]], set[str]]:
    """(name, arguments) per call index from the deltas, and the finish reasons."""
    names, arguments, finishes = {}, {}, set()
    for chunk in stream:
        for choice in chunk.choices:
            if choice.finish_reason:
                finishes.add(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                if delta.function.name is not None:
                    assert delta.index not in names, "a name sent twice"
                    assert delta.id and delta.type == "function"
                    names[delta.index] = delta.function.name
                    arguments[delta.index] = ""
                arguments[delta.index] += delta.function.arguments or ""
    return [(names[i], arguments[i]) for i in sorted(names)], finishes


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 5, "n": 2}])
@pytest.mark.parametrize("parallel", [False, None], ids=["one-call", "parallel"])
def test_required_always_gives_valid_calls(api, openai_server, parallel, sampling):
    # With the tools template, the 135M model repeats parallel calls until max_tokens
    # (finish "length", no calls, as vLLM would give): those run on its own template.
    if parallel is None:
        api = client(openai_server)
    request = dict(model=MODEL, messages=QUESTION, tools=[WEATHER, TIME], max_tokens=120)
    if parallel is not None:
        request["parallel_tool_calls"] = parallel
    reply = api.chat.completions.create(tool_choice="required", **request, **sampling)
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
            assert_valid_call(call.function.name, call.function.arguments)
    if "n" not in sampling:
        calls, finishes = streamed_calls(
            api.chat.completions.create(tool_choice="required", stream=True, **request, **sampling)
        )
        assert finishes == {"tool_calls"}
        # vLLM streams the model's text but re-serialises a whole answer's arguments
        # (parser/abstract_parser.py _extract_tool_calls): equal as JSON.
        assert [(name, json.loads(arguments)) for name, arguments in calls] == [
            (c.function.name, json.loads(c.function.arguments))
            for c in reply.choices[0].message.tool_calls
        ]


def test_a_named_function_is_called_with_valid_arguments(api):
    named = {"type": "function", "function": {"name": "get_time"}}
    request = dict(model=MODEL, messages=QUESTION, tools=[WEATHER, TIME], tool_choice=named)
    reply = api.chat.completions.create(max_tokens=40, temperature=0.8, seed=1, **request)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    assert_valid_call("get_time", call.function.arguments)
    assert reply.choices[0].finish_reason == "stop"  # vLLM's (and OpenAI's) for a named call
    calls, _ = streamed_calls(
        api.chat.completions.create(max_tokens=40, stream=True, temperature=0, **request)
    )
    assert [name for name, _ in calls] == ["get_time"]
    assert_valid_call(*calls[0])


def test_parallel_tool_calls_false_makes_one_call(api):
    reply = api.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=2, n=3,
    )  # fmt: skip
    for choice in reply.choices:
        assert len(choice.message.tool_calls) == 1


def test_auto_reads_a_generated_hermes_output(start_openai_server):
    url = start_openai_server(
        frontend=frontend_config(
            enable_auto_tool_choice=True, tool_call_parser="hermes", chat_template=TEMPLATE
        )
    )
    api = client(url)
    hermes = (
        r'Checking\.\n<tool_call>\{"name": "get_weather", "arguments": '
        r'\{"city": "[A-Z][a-z]{2,8}", "unit": "celsius"\}\}</tool_call>'
    )
    request = dict(
        model=MODEL, messages=QUESTION, tools=[WEATHER, TIME], max_tokens=60, temperature=0,
        extra_body={"structured_outputs": {"regex": hermes}},
    )  # fmt: skip
    reply = api.chat.completions.create(**request)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking.\n"
    (call,) = choice.message.tool_calls
    assert_valid_call(call.function.name, call.function.arguments)
    calls, finishes = streamed_calls(api.chat.completions.create(stream=True, **request))
    assert finishes == {"tool_calls"} and calls == [("get_weather", call.function.arguments)]
    plain = api.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER], max_tokens=30, temperature=0,
        extra_body={"structured_outputs": {"regex": "No tool needed"}},
    )  # fmt: skip
    assert plain.choices[0].message.content == "No tool needed"
    assert not plain.choices[0].message.tool_calls
