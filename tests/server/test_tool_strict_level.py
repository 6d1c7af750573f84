"""--tool-strict-level: which "auto" requests get a structural tag, what the tag lets a
model write (random walks through the compiled tag, read back by a regex and
`jsonschema`), the start-up checks, and the request path over HTTP."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from aioserve.config.declaration import ConfigError
from aioserve.config.frontend import frontend_config
from aioserve.engine.structured_outputs import StructuredOutputsParams
from aioserve.server.body_fields import BodyFields
from aioserve.server.request_schema import CHAT_BODY
from aioserve.server.tool_calls import check_tool_call_settings
from aioserve.server.tool_calls.strict_tags import strict_call_tag
from aioserve.server.tools import read_tool_use
from tests.engine.structured_outputs.walks import random_walk
from tests.server.conftest import MODEL
from tests.server.openai_helpers import client

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": CITY, "strict": True}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}
HERMES_CALL = re.compile(
    r'<tool_call>\n?\{"name": "(\w+)", "arguments": (.*?)\}\n?</tool_call>', re.S
)


def compiled_tag(form, tools, level="auto", single_call=False) -> StructuredOutputsParams:
    tag = strict_call_tag(form, tools, level, single_call)
    assert tag is not None
    return StructuredOutputsParams(structural_tag=tag, backend="xgrammar")


@pytest.mark.parametrize(
    ("tools", "level", "single_call", "tagged"),
    [
        ([CLOCK], "auto", False, False),  # no strict tool: calls left free
        ([CLOCK, WEATHER], "auto", False, True),
        ([CLOCK], "function", False, True),
        ([CLOCK], "parameter", False, True),
        ([CLOCK], "auto", True, True),  # one call only needs the tag
    ],
)
def test_which_requests_get_a_tag(tools, level, single_call, tagged):
    assert (strict_call_tag("hermes", tools, level, single_call) is not None) == tagged
    assert strict_call_tag(None, tools, "parameter", single_call) is None


def test_a_strict_tool_is_held_to_its_schema_and_names_only_the_tools(
    smollm2_compiler, smollm2_tokenizer
):
    constraint = compiled_tag("hermes", [CLOCK, WEATHER])
    for seed in range(4):
        prefix = 'Sure. <tool_call>\n{"name": "weather'
        text = random_walk(
            smollm2_compiler, smollm2_tokenizer, constraint, seed, prefix=prefix, skip_blanks=True
        )
        calls = HERMES_CALL.findall(text)
        assert calls and calls[0][0] == "weather", text
        jsonschema.validate(json.loads(calls[0][1]), CITY)
    with pytest.raises(AssertionError, match="masked"):
        random_walk(
            smollm2_compiler, smollm2_tokenizer, constraint, 0, prefix='<tool_call>{"name": "rm'
        )
    with pytest.raises(AssertionError, match="masked"):  # days must be 1, 2 or 3
        prefix = '<tool_call>{"name": "weather", "arguments": {"city": "Oslo", "days": 7'
        random_walk(smollm2_compiler, smollm2_tokenizer, constraint, 0, prefix=prefix)


@pytest.mark.parametrize(("level", "free"), [("function", True), ("parameter", False)])
def test_a_tool_without_strict_is_free_below_the_parameter_level(
    smollm2_compiler, smollm2_tokenizer, level, free
):
    clock = {"type": "function", "function": {"name": "clock", "parameters": CITY}}
    constraint = compiled_tag("hermes", [clock], level)
    prefix = '<tool_call>{"name": "clock", "arguments": {"zone": 1}}</tool_call>'
    if free:
        random_walk(smollm2_compiler, smollm2_tokenizer, constraint, 0, prefix=prefix)
    else:
        with pytest.raises(AssertionError, match="masked"):
            random_walk(smollm2_compiler, smollm2_tokenizer, constraint, 0, prefix=prefix)


def test_one_call_only_ends_the_calls_after_the_first(smollm2_compiler, smollm2_tokenizer):
    constraint = compiled_tag("hermes", [WEATHER], single_call=True)
    first = '<tool_call>{"name": "weather", "arguments": {"city": "Oslo", "days": 1}}</tool_call>'
    with pytest.raises(AssertionError, match="masked"):
        random_walk(
            smollm2_compiler, smollm2_tokenizer, constraint, 0, prefix=first + " <tool_call>"
        )
    many = compiled_tag("hermes", [WEATHER])
    random_walk(
        smollm2_compiler,
        smollm2_tokenizer,
        many,
        0,
        prefix=first + " <tool_call>",
        skip_blanks=True,
    )


def test_llama3_json_calls_follow_xgrammars_llama_form(smollm2_compiler, smollm2_tokenizer):
    constraint = compiled_tag("llama", [CLOCK, WEATHER])
    for seed in range(3):
        prefix = '{"name": "weather", "parameters": '
        text = random_walk(
            smollm2_compiler, smollm2_tokenizer, constraint, seed, prefix=prefix, skip_blanks=True
        )
        call, _ = json.JSONDecoder().raw_decode(text)  # the text after the call is free
        assert call["name"] == "weather"
        jsonschema.validate(call["parameters"], CITY)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"tool_strict_level": "function"}, "needs a --tool-call-parser .* none is given"),
        ({"tool_strict_level": "parameter", "tool_call_parser": "mistral"}, "'mistral' has none"),
    ],
)
def test_a_level_without_a_structural_form_is_refused(settings, message):
    with pytest.raises(ConfigError, match=message):
        check_tool_call_settings(frontend_config(**settings))
    with pytest.raises(ConfigError, match="tool_strict_level must be one of auto, function"):
        frontend_config(tool_strict_level="strict")


def test_the_request_path_carries_the_tag_for_xgrammar():
    frontend = frontend_config(
        enable_auto_tool_choice=True, tool_call_parser="hermes", tool_strict_level="function"
    )
    check_tool_call_settings(frontend)
    use = read_tool_use(BodyFields({"tools": [CLOCK]}, CHAT_BODY), frontend)
    assert use.call_tag.backend == "xgrammar" and use.constraint is None
    named = {"tools": [CLOCK], "tool_choice": {"type": "function", "function": {"name": "clock"}}}
    assert read_tool_use(BodyFields(named, CHAT_BODY), frontend).call_tag is None


@pytest.mark.parametrize(
    ("level", "tool", "refused"),
    [
        ("auto", {"strict": True}, True),
        ("auto", {}, False),  # no tag, nothing compiled
        ("function", {}, False),  # a tool that is not strict takes any arguments
        ("parameter", {}, True),
    ],
)
def test_over_http_a_tagged_request_compiles_its_tools(start_openai_server, level, tool, refused):
    """A tool whose schema xgrammar cannot compile shows whether the request was tagged:
    a 400 naming `tools` when it was, an answer when it was not."""
    frontend = frontend_config(
        enable_auto_tool_choice=True, tool_call_parser="hermes", tool_strict_level=level
    )
    api = client(start_openai_server(frontend=frontend))
    broken = {"name": "broken", "parameters": {"type": "strin"}, **tool}
    request = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello"}],
        tools=[{"type": "function", "function": broken}],
        max_tokens=4,
    )
    if refused:
        with pytest.raises(openai.BadRequestError) as caught:
            api.chat.completions.create(**request)
        assert caught.value.body["param"] == "tools"
        assert "structural_tag" in caught.value.body["message"]
    else:
        assert api.chat.completions.create(**request).choices[0].message is not None
