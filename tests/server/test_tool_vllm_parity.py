"""Tool calling as vLLM 0.32 does it, case by case: the parsers' whole and streamed
readings, the ids, parallel_tool_calls, the finish reasons, the tools the chat template
gets, and the refusals. Each expectation names the vLLM code it comes from (or was
checked by running vLLM's own parser on the same text); none needs vLLM installed.
"""

from __future__ import annotations

import json
import re

import pytest

from aioserve.config.frontend import frontend_config
from aioserve.server.body_fields import BodyFields
from aioserve.server.chat import calls_in_answer
from aioserve.server.errors import APIError
from aioserve.server.request_schema import CHAT_BODY
from aioserve.server.tool_calls.parsers import new_tool_parser
from aioserve.server.tool_calls.partial_json import canonical_prefix
from aioserve.server.tool_calls.streaming import ToolCallStream
from aioserve.server.tools import checked_tools, read_tool_use

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
AUTO = frontend_config(enable_auto_tool_choice=True, tool_call_parser="hermes")
TWO_CALLS = (
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)


def streamed(parser_name: str, text: str, single_call: bool = False):
    """Feed `text` a character at a time: (content, [(name, arguments)], ids, made_calls)."""
    stream = ToolCallStream(new_tool_parser(parser_name), single_call)
    content, calls, ids = "", {}, []
    for i, char in enumerate(text):
        piece, deltas = stream.feed(char, last=i == len(text) - 1)
        content += piece or ""
        for delta in deltas or []:
            if "id" in delta:
                ids.append(delta["id"])
                calls[delta["index"]] = [delta["function"]["name"], ""]
            calls[delta["index"]][1] += delta["function"]["arguments"]
    return content, [tuple(calls[i]) for i in sorted(calls)], ids, stream.made_calls


def whole(parser_name: str, text: str):
    parsed = new_tool_parser(parser_name).read_whole(text)
    return parsed.content, [(call.name, call.arguments) for call in parsed.calls]


def use(body: dict, frontend=AUTO):
    return read_tool_use(BodyFields(body, CHAT_BODY), frontend)


# -- arguments re-serialised -------------------------------------------------------------


@pytest.mark.parametrize(
    ("parser_name", "text"),
    [
        # hermes_tool_parser.py extract_tool_calls: json.dumps(arguments, ensure_ascii=False)
        ("hermes", '<tool_call>{"name":"get_weather","arguments":{"city":"Z\\u00fcrich"}}</tool_call>'),
        # llama_tool_parser.py extract_tool_calls: the same
        ("llama3_json", '{"name":"get_weather","parameters":{"city":"Z\\u00fcrich"}}'),
        # parser/mistral.py _pre_v11_function_calls: the same
        ("mistral", '[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Z\\u00fcrich"}}]'),
    ],
)  # fmt: skip
def test_whole_arguments_are_reserialised(parser_name, text):
    assert whole(parser_name, text)[1] == [("get_weather", '{"city": "Zürich"}')]


def test_streamed_arguments_are_what_vllm_streams():
    # llama_tool_parser.py extract_tool_calls_streaming streams json.dumps of the
    # arguments; hermes_tool_parser.py (_extract_tool_args) and the mistral array format
    # (parser/mistral.py, pre-v11 streaming) stream the model's own text.
    llama = '{"name":"get_weather","parameters":{"city":"Z\\u00fcrich","n":[1,2.50]}}'
    assert streamed("llama3_json", llama)[1] == [
        ("get_weather", '{"city": "Zürich", "n": [1, 2.5]}')
    ]
    hermes = '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>'
    assert streamed("hermes", hermes)[1] == [("get_weather", '{"city":"Paris"}')]
    mistral = '[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Paris"}}]'
    assert streamed("mistral", mistral)[1] == [("get_weather", '{"city":"Paris"}')]


def test_a_canonical_prefix_only_grows():
    value = '{"s": "a\\"\\n\\ud83d\\ude00é", "n": [1, -0, 1e3, true, null], "e": {}}'
    full = json.dumps(json.loads(value), ensure_ascii=False)
    last = ""
    for end in range(len(value) + 1):
        prefix = canonical_prefix(value[:end], end == len(value))
        assert prefix.startswith(last) and full.startswith(prefix), value[:end]
        last = prefix
    assert last == full


def test_a_mistral_string_argument_is_kept_as_it_is():
    # parser/mistral.py _pre_v11_function_calls: "string arguments are kept as-is"
    text = '[TOOL_CALLS][{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}]'
    assert whole("mistral", text)[1] == [("get_weather", '{"city": "Paris"}')]


# -- the formats ---------------------------------------------------------------------------


def test_llama3_json_finds_calls_after_text():
    # llama_tool_parser.py extract_tool_calls: finditer("{") + raw_decode, text dropped
    text = 'Sure! {"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert whole("llama3_json", text) == ("", [("get_weather", '{"city": "Paris"}')])
    # an object that is not a call makes it all content (the KeyError branch)
    text = 'See {"a": 1} and {"name": "get_weather", "parameters": {}}'
    assert whole("llama3_json", text) == (text, [])
    # streaming needs the output to start with the tag or "{" (extract_tool_calls_streaming)
    assert streamed("llama3_json", '\n {"name": "f", "parameters": {}}')[1] == []


@pytest.mark.parametrize(
    "text",
    [
        # hermes_tool_parser.py: the regex's `<tool_call>(.*)` branch takes the dangling
        # tag, json.loads fails, and the whole output is content
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        "<tool_call>\n",
        # text after the JSON inside the tag: json.loads fails the same way
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}} extra\n</tool_call>',
    ],
)
def test_hermes_whole_output_with_a_failed_tag_is_content(text):
    assert whole("hermes", text) == (text, [])
    content, tool_calls, finish = calls_in_answer(use({"tools": [WEATHER]}), text, "length")
    assert (content, tool_calls, finish) == (text, None, "length")


def test_mistral_bare_object_and_ids():
    # parser/mistral.py _pre_v11_function_calls: "a bare object is a single call"
    text = '[TOOL_CALLS]{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert whole("mistral", text) == ("", [("get_weather", '{"city": "Paris"}')])
    content, calls, ids, made = streamed("mistral", text)
    assert calls == [("get_weather", '{"city": "Paris"}')] and made
    # MistralToolCall.generate_random_id: 9 letters and digits
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", call_id) for call_id in ids)
    assert re.fullmatch(r"[A-Za-z0-9]{9}", new_tool_parser("mistral").new_call_id())


def test_mistral_text_after_the_marker_that_is_no_call_is_flushed():
    text = "Sure. [TOOL_CALLS] sorry, I cannot call tools."
    content, calls, _, made = streamed("mistral", text)
    assert (content, calls, made) == (text, [], False)
    assert whole("mistral", text) == (text, [])


@pytest.mark.parametrize(
    "text", [" [get_weather(city='Paris')]", "[get_weather(city='Paris')] done"]
)
def test_pythonic_list_must_be_the_whole_output(text):
    # pythonic_tool_parser.py extract_tool_calls: TOOL_CALL_REGEX.match at the start, then
    # ast.parse of the whole output
    assert whole("pythonic", text) == (text, [])


def test_pythonic_leading_whitespace_streams_as_content():
    # extract_tool_calls_streaming: `if not current_text.startswith("[")` → content
    text = " [get_weather(city='Paris')]"
    assert streamed("pythonic", text)[:2] == (text, [])


def test_default_ids_are_vllm_random_uuid():
    # vllm/utils random_uuid (16 hex digits) via renderers/chat_utils.py make_tool_call_id
    call_id = new_tool_parser("hermes").new_call_id()
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", call_id)


# -- parallel_tool_calls and finish reasons --------------------------------------------------


def test_parallel_tool_calls_false_keeps_the_first_call():
    # entrypoints/serve/utils/tool_calls_utils.py maybe_filter_parallel_tool_calls
    tool_use = use({"tools": [WEATHER], "parallel_tool_calls": False})
    _, calls, finish = calls_in_answer(tool_use, TWO_CALLS, "stop")
    assert [call["function"]["name"] for call in calls] == ["get_weather"]
    assert finish == "tool_calls"
    _, streamed_calls, _, _ = streamed("hermes", TWO_CALLS, single_call=True)
    assert [name for name, _ in streamed_calls] == ["get_weather"]
    _, calls, _ = calls_in_answer(use({"tools": [WEATHER]}), TWO_CALLS, "stop")
    assert len(calls) == 2


def test_a_streamed_call_whose_end_fails_still_counts_as_made():
    # chat_completion/serving.py: tools_streamed is set once a call delta is sent
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Par'
    assert streamed("hermes", text)[3]


def test_required_finishes_as_tool_calls_only_after_stop(monkeypatch):
    # chat_completion/serving.py (non-streamed): "required" and finish_reason "stop",
    # whether the calls were forced as bare JSON (VLLM_ENFORCE_STRICT_TOOL_CALLING=0) or
    # in the parser's own format (its default)
    monkeypatch.setenv("VLLM_ENFORCE_STRICT_TOOL_CALLING", "0")
    tool_use = use({"tools": [WEATHER], "tool_choice": "required"})
    output = '[{"name": "get_weather", "parameters": {}}]'
    assert calls_in_answer(tool_use, output, "stop")[2] == "tool_calls"
    assert calls_in_answer(tool_use, output, "length")[2] == "length"
    # parser/abstract_parser.py _extract_tool_calls: json.dumps(tc.parameters)
    compact = '[{"name":"get_weather","parameters":{"city":"Z\\u00fcrich"}}]'
    (call,) = calls_in_answer(tool_use, compact, "stop")[1]
    assert call["function"]["arguments"] == '{"city": "Zürich"}'
    monkeypatch.delenv("VLLM_ENFORCE_STRICT_TOOL_CALLING")
    tool_use = use({"tools": [WEATHER], "tool_choice": "required"})
    output = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    assert calls_in_answer(tool_use, output, "stop")[:3:2] == ("", "tool_calls")
    assert calls_in_answer(tool_use, output, "length")[2] == "length"
    # the parser's own reading (hermes_tool_parser.py: json.dumps of the arguments)
    compact = '<tool_call>{"name":"get_weather","arguments":{"city":"Z\\u00fcrich"}}</tool_call>'
    (call,) = calls_in_answer(tool_use, compact, "stop")[1]
    assert call["function"]["arguments"] == '{"city": "Zürich"}'
    named = use({"tools": [WEATHER], "tool_choice": {"function": {"name": "get_weather"}}})
    assert calls_in_answer(named, output, "stop")[2] == "stop"
    # only whitespace around forced calls: content "" (vLLM's `content or ""` after its
    # parser's whitespace-only content became None); under "auto", none
    assert calls_in_answer(tool_use, " \n" + output, "stop")[0] == ""
    assert calls_in_answer(use({"tools": [WEATHER]}), " \n" + output, "stop")[0] is None


# -- the tools the template gets, and refusals -----------------------------------------------


def test_template_tools_are_vllm_model_dump():
    # renderers/online_renderer.py: [tool.model_dump() for tool in request.tools]
    given = [{"function": {"name": "get_time", "strict": True, "x-extra": 1}, "type": "function"}]
    (tool,) = checked_tools(given)
    assert json.dumps(tool) == json.dumps(
        {
            "type": "function",
            "function": {
                "name": "get_time",
                "description": None,
                "parameters": None,
                "strict": True,
            },
        }
    )
    (deferred,) = checked_tools([{"function": {"name": "f"}, "defer_loading": True}])
    assert deferred["function"]["defer_loading"] is True and deferred["defer_loading"] is True


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        ({"tools": []}, "`tools` must not be an empty array. Either provide at least one "
         "tool or omit the field entirely. (parameter=tools)", "tools"),
        ({"tool_choice": "auto"}, "When using `tool_choice`, `tools` must be set. "
         "(parameter=tool_choice)", "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "Invalid value for `tool_choice`: "
         'sometimes! Only named tools, "none", "auto" or "required" are supported. '
         "(parameter=tool_choice)", "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"function": {"name": "x"}}},
         "The tool specified in `tool_choice` does not match any of the specified `tools` "
         "(parameter=tool_choice)", "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}},
         "Invalid value for `function`: `None` in `tool_choice`! Correct usage: `{\"type\": "
         '"function", "function": {"name": "my_function"}}` (parameter=tool_choice.function)',
         "tool_choice.function"),
        ({"tools": [WEATHER], "tool_choice": {"type": "custom",
                                               "function": {"name": "get_weather"}}},
         "Input should be 'function'", "tool_choice.type"),
    ],
)  # fmt: skip
def test_refusals_carry_vllm_parameter_suffix(body, message, param):
    with pytest.raises(APIError) as error:
        use(body)
    assert error.value.message.startswith(message) and error.value.param == param


def test_auto_without_a_parser_has_no_param():
    # renderers/online_renderer.py: create_error_response with no parameter
    with pytest.raises(APIError) as error:
        use({"tools": [WEATHER]}, frontend_config())
    assert error.value.param is None
