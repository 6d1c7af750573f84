"""tool_choice "required" and a named function as vLLM 0.32 forces them: with
--enable-auto-tool-choice and a --tool-call-parser whose calls have a structural form, a
structural tag holds the answer to the parser's own call format (only the allowed tools,
at least one call for "required"), and that parser reads the calls; with
VLLM_ENFORCE_STRICT_TOOL_CALLING=0, or a parser without a form, the bare-JSON forcing of
tool_calls/forced.py stays.

The constraint a request gets is compared with the one vLLM's own parser sets on the same
request (tests/server/vllm_tool_tags.json, made by tools/vllm_tool_tags.py from vLLM
0.32.0: parser/abstract_parser.py adjust_request), for hermes, llama3_json, qwen3_coder
and deepseek_v3 × required / named × parallel_tool_calls unset / true / false × strict
levels, with the variable unset and "0". Random walks through the compiled tags show
what they let a model write (read back by the parsers and `jsonschema`), and the default
model answers over HTTP through the official `openai` client, streamed and not, on chat
completions and the Responses API (the Anthropic route: test_anthropic_tools.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from aioserve.config.frontend import frontend_config
from aioserve.server.body_fields import BodyFields
from aioserve.server.request_schema import CHAT_BODY
from aioserve.server.state import ServerState
from aioserve.server.tool_calls.parsers import new_tool_parser
from aioserve.server.tool_calls.strict_tags import (
    ENFORCE_STRICT_ENV,
    enforces_strict_tool_calling,
)
from aioserve.server.tools import read_tool_use
from tests.engine.structured_outputs.walks import random_walk
from tests.server.conftest import MODEL, openai_app, serve_app
from tests.server.openai_helpers import client
from tests.server.test_tools import TEMPLATE

VLLM = json.loads((Path(__file__).parent / "vllm_tool_tags.json").read_text())

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
ZONE = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather in a city",
                 "parameters": CITY, "strict": True},
}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": ZONE, "strict": True}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {"get_weather": CITY, "get_time": ZONE}
NAMED = {"type": "function", "function": {"name": "get_time"}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]


def frontend(parser: str = "hermes", level: str = "auto", **more):
    return frontend_config(
        enable_auto_tool_choice=True, tool_call_parser=parser, tool_strict_level=level, **more
    )


def tool_use(body: dict, front=None):
    return read_tool_use(BodyFields(body, CHAT_BODY), front or frontend())


# -- the constraint is vLLM's -------------------------------------------------------------


@pytest.mark.parametrize("enforced", [True, False], ids=["default", "not_enforced"])
@pytest.mark.parametrize("name", sorted(VLLM))
def test_the_constraint_is_the_one_vllm_sets(monkeypatch, name, enforced):
    case = VLLM[name]
    if enforced:
        monkeypatch.delenv(ENFORCE_STRICT_ENV, raising=False)
    else:
        monkeypatch.setenv(ENFORCE_STRICT_ENV, "0")
    body = case["body"]
    use = tool_use(body, frontend(case["parser"], case["level"]))
    expected = case["vllm" if enforced else "vllm_not_enforced"]
    choice = body["tool_choice"]
    constraint = use.call_tag if choice == "auto" else use.constraint
    if expected is None:
        assert constraint is None
    elif "structural_tag" in expected:
        assert constraint.backend == "xgrammar" and constraint.json is None
        assert json.loads(json.dumps(constraint.structural_tag)) == expected["structural_tag"]
        assert use.parser.name == case["parser"]  # the calls are read as under "auto"
    else:
        assert constraint.structural_tag is None and constraint.json is not None
        assert use.parser.name == ("named" if isinstance(choice, dict) else "required")
        if isinstance(choice, dict):
            assert constraint.json == expected["json"]
    if choice != "auto":
        assert use.calls_finish_as_tool_calls == (choice == "required")
    assert use.single_call == (body.get("parallel_tool_calls") is False)


@pytest.mark.parametrize(
    ("value", "on"),
    [(None, True), ("1", True), ("true", True), ("TRUE", True), ("True", True),
     ("0", False), ("false", False), ("no", False), ("yes", False), ("", False)],
)  # fmt: skip
def test_the_variable_is_read_as_vllm_reads_it(monkeypatch, value, on):
    # vllm/envs.py: os.getenv("VLLM_ENFORCE_STRICT_TOOL_CALLING", "True").lower() in
    # ("true", "1")
    if value is None:
        monkeypatch.delenv(ENFORCE_STRICT_ENV, raising=False)
    else:
        monkeypatch.setenv(ENFORCE_STRICT_ENV, value)
    assert enforces_strict_tool_calling() is on
    forced = tool_use({"tools": TOOLS, "tool_choice": "required"}).constraint
    assert (forced.structural_tag is not None) is on


@pytest.mark.parametrize(
    "settings",
    [
        {"enable_auto_tool_choice": False, "tool_call_parser": "hermes"},
        {"enable_auto_tool_choice": False},
        {"enable_auto_tool_choice": True, "tool_call_parser": "mistral"},  # no form
        {"enable_auto_tool_choice": True, "tool_call_parser": "pythonic"},
    ],
)
@pytest.mark.parametrize("choice", ["required", NAMED])
def test_without_a_parser_with_a_form_the_json_forcing_stays(settings, choice):
    use = tool_use({"tools": TOOLS, "tool_choice": choice}, frontend_config(**settings))
    assert use.constraint.json is not None and use.constraint.structural_tag is None
    assert use.parser.name == ("required" if choice == "required" else "named")


# -- what the tags let a model write -----------------------------------------------------


def compiled(parser: str, choice, parallel=None, tools=TOOLS):
    body = {"tools": tools, "tool_choice": choice}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    return tool_use(body, frontend(parser)).constraint


def assert_valid_calls(parser: str, text: str, names=("get_weather", "get_time")):
    parsed = new_tool_parser(parser, TOOLS).read_whole(text)
    assert parsed.calls, text
    for call in parsed.calls:
        assert call.name in names, text
        arguments = json.loads(call.arguments)
        if parser == "qwen3_coder":
            # xgrammar's qwen_xml lets whitespace surround a parameter's value
            # (`<parameter=zone> CET </parameter>`), which the parser keeps
            arguments = {k: v.strip() if isinstance(v, str) else v for k, v in arguments.items()}
        jsonschema.validate(arguments, SCHEMAS[call.name])
    return parsed


@pytest.mark.parametrize("parser", ["hermes", "qwen3_coder", "llama3_json", "deepseek_v3"])
def test_required_walks_are_calls_of_the_tools(smollm2_compiler, smollm2_tokenizer, parser):
    constraint = compiled(parser, "required")
    for seed in range(3):
        text = random_walk(
            smollm2_compiler, smollm2_tokenizer, constraint, seed, limit=400, skip_blanks=True
        )
        assert_valid_calls(parser, text)


def test_hermes_required_starts_with_a_call_of_a_given_tool(smollm2_compiler, smollm2_tokenizer):
    constraint = compiled("hermes", "required")
    for prefix in ("Sure", '<tool_call>{"name": "rm'):
        with pytest.raises(AssertionError, match="masked"):
            random_walk(smollm2_compiler, smollm2_tokenizer, constraint, 0, prefix=prefix)


@pytest.mark.parametrize("parser", ["hermes", "qwen3_coder", "llama3_json"])
def test_a_named_function_is_the_only_call(smollm2_compiler, smollm2_tokenizer, parser):
    constraint = compiled(parser, NAMED)
    for seed in range(3):
        text = random_walk(
            smollm2_compiler, smollm2_tokenizer, constraint, seed, limit=160, skip_blanks=True
        )
        assert len(assert_valid_calls(parser, text, names=("get_time",)).calls) == 1
    other = {
        "hermes": '<tool_call>{"name": "get_weather',
        "qwen3_coder": "<tool_call>\n<function=get_weather",
        "llama3_json": '{"name": "get_weather',
    }[parser]
    with pytest.raises(AssertionError, match="masked"):
        random_walk(smollm2_compiler, smollm2_tokenizer, constraint, 0, prefix=other)


@pytest.mark.parametrize("parallel", [None, False])
def test_parallel_tool_calls_false_allows_one_call(smollm2_compiler, smollm2_tokenizer, parallel):
    constraint = compiled("hermes", "required", parallel)
    first = '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
    second = first + '<tool_call>{"name": "get_weather'
    if parallel is False:
        with pytest.raises(AssertionError, match="masked"):
            random_walk(smollm2_compiler, smollm2_tokenizer, constraint, 0, prefix=second)
    else:
        random_walk(
            smollm2_compiler, smollm2_tokenizer, constraint, 0, prefix=second, skip_blanks=True
        )


def test_a_tool_that_is_not_strict_takes_any_arguments(smollm2_compiler, smollm2_tokenizer):
    # As in vLLM 0.32: a forced call's arguments follow the schema only for a strict
    # tool (or at --tool-strict-level parameter).
    loose = [{"type": "function", "function": {"name": "get_time", "parameters": ZONE}}]
    call = '<tool_call>{"name": "get_time", "arguments": {"zone": 5}}</tool_call>'
    free = compiled("hermes", NAMED, tools=loose)
    random_walk(smollm2_compiler, smollm2_tokenizer, free, 0, prefix=call)
    body = {"tools": loose, "tool_choice": NAMED}
    held = tool_use(body, frontend(level="parameter")).constraint
    with pytest.raises(AssertionError, match="masked"):
        random_walk(smollm2_compiler, smollm2_tokenizer, held, 0, prefix=call)


# -- over HTTP, on the default model -------------------------------------------------------


@pytest.fixture(scope="module")
def url(engine, server_loop):
    front = frontend(chat_template=TEMPLATE)
    with serve_app(server_loop, openai_app(ServerState(engine, [MODEL], frontend=front))) as base:
        yield base


def raw_text(hf_tokenizer, choice) -> str:
    return hf_tokenizer.decode(choice.token_ids, skip_special_tokens=True)


def streamed(stream) -> tuple[list[tuple[str, str]], set[str], str]:
    """(name, arguments) per call index from the deltas, the finish reasons, the content."""
    names, arguments, finishes, content = {}, {}, set(), ""
    for chunk in stream:
        for choice in chunk.choices:
            finishes.update([choice.finish_reason] if choice.finish_reason else [])
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                if delta.function.name is not None:
                    assert delta.index not in names and delta.id.startswith("chatcmpl-tool-")
                    names[delta.index], arguments[delta.index] = delta.function.name, ""
                arguments[delta.index] += delta.function.arguments or ""
    return [(names[i], arguments[i]) for i in sorted(names)], finishes, content


@pytest.mark.slow
@pytest.mark.parametrize(
    ("choice", "finish", "names"),
    [("required", "tool_calls", ("get_weather", "get_time")), (NAMED, "stop", ("get_time",))],
    ids=["required", "named"],
)
@pytest.mark.parametrize("parallel", [None, False], ids=["parallel", "one-call"])
def test_the_model_answers_in_hermes_calls(url, hf_tokenizer, choice, finish, names, parallel):
    api = client(url)
    request = dict(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=choice)
    if parallel is not None:
        request["parallel_tool_calls"] = parallel
    reply = api.chat.completions.create(
        max_tokens=150, temperature=1.0, seed=5, n=2, extra_body={"return_token_ids": True},
        **request,
    )  # fmt: skip
    for answer in reply.choices:
        # the model's own format, read by the hermes parser
        assert raw_text(hf_tokenizer, answer).startswith("<tool_call>")
        assert answer.finish_reason == finish and answer.message.content == ""
        assert answer.message.tool_calls
        for call in answer.message.tool_calls:
            assert call.function.name in names and call.id.startswith("chatcmpl-tool-")
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    greedy = api.chat.completions.create(
        max_tokens=150, temperature=0, extra_body={"return_token_ids": True}, **request
    ).choices[0]
    calls, finishes, content = streamed(
        api.chat.completions.create(max_tokens=150, temperature=0, stream=True, **request)
    )
    assert finishes == {finish} and content == ""
    # Streamed, the arguments are the model's own text (hermes_tool_parser.py); whole,
    # json.dumps of them: the same values.
    assert [(name, json.loads(arguments)) for name, arguments in calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in greedy.message.tool_calls
    ]
    assert all(arguments in raw_text(hf_tokenizer, greedy) for _, arguments in calls)


@pytest.mark.slow
@pytest.mark.parametrize(("choice", "opening"), [("required", "["), (NAMED, "{")])
def test_not_enforced_the_calls_are_bare_json(url, hf_tokenizer, monkeypatch, choice, opening):
    monkeypatch.setenv(ENFORCE_STRICT_ENV, "0")
    reply = client(url).chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=choice, max_tokens=150,
        temperature=0, parallel_tool_calls=False, extra_body={"return_token_ids": True},
    )  # fmt: skip
    answer = reply.choices[0]
    assert raw_text(hf_tokenizer, answer).lstrip().startswith(opening)
    (call,) = answer.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.slow
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "name": "get_time"}], ids=["required", "named"]
)
def test_the_responses_api_shares_the_forcing(url, choice):
    # vLLM's Responses route runs the same parser adjustment (_apply_structural_tag takes
    # a ResponsesRequest) and parses the answer with the same parser.
    tools = [{"type": "function", **tool["function"]} for tool in TOOLS]
    request = dict(
        model=MODEL, input=QUESTION, tools=tools, tool_choice=choice, temperature=0,
        max_output_tokens=150, parallel_tool_calls=False,
    )  # fmt: skip
    api = client(url)
    response = api.responses.create(**request)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(item.type == "function_call" for item in response.output)
    for call in calls:
        assert call.name in (("get_time",) if isinstance(choice, dict) else SCHEMAS)
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    done = [
        event
        for event in api.responses.create(stream=True, **request)
        if event.type == "response.function_call_arguments.done"
    ]
    assert [(e.name, json.loads(e.arguments)) for e in done] == [
        (call.name, json.loads(call.arguments)) for call in calls
    ]
