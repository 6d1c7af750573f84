"""Tool-call parsers on recorded outputs of each format, whole and streamed cut anywhere.

Each output is fed as it would stream, cut at every character boundary (a superset of its
token boundaries): the content pieces must join to the content, each call must be
announced once with its name, and its argument pieces must join to JSON equal to the
expected arguments; reading the whole output at once must give the same calls.
"""

from __future__ import annotations

import json

import pytest

from aioserve.server.tool_calls.forced import NamedCallParser, RequiredCallsParser
from aioserve.server.tool_calls.parsers import new_tool_parser
from aioserve.server.tool_calls.streaming import ToolCallStream

WEATHER = ("get_weather", {"city": "Paris", "unit": "celsius"})
TIME = ("get_time", {"zone": "CET"})
TRICKY = ("search", {"q": 'a "quoted" } brace ] <tool_call>', "n": [1, 2.5, None, True]})

CASES = {
    "hermes": [
        (
            'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
            '{"zone": "CET"}}\n</tool_call>',
            "Let me check.\n",
            [WEATHER, TIME],
        ),
        (
            '<tool_call>{"arguments": ' + json.dumps(TRICKY[1]) + ', "name": "search"}</tool_call>',
            "",
            [TRICKY],
        ),
        ("No tools needed: 1 < 2.", "No tools needed: 1 < 2.", []),
    ],
    "llama3_json": [
        (
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
            '"celsius"}}; {"name": "get_time", "parameters": {"zone": "CET"}}',
            "",
            [WEATHER, TIME],
        ),
        ('{"name": "search", "arguments": ' + json.dumps(TRICKY[1]) + "}", "", [TRICKY]),
        ("The weather is fine {really}.", "The weather is fine {really}.", []),
        ('{"name": "Bob", "age": 30}', '{"name": "Bob", "age": 30}', []),
    ],
    "mistral": [
        (
            'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
            '"celsius"}}, {"name": "get_time", "arguments": {"zone": "CET"}}]',
            "Sure. ",
            [WEATHER, TIME],
        ),
        (
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
            '[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}',
            "",
            [WEATHER, TIME],
        ),
        ("Just text [TOOL] here.", "Just text [TOOL] here.", []),
    ],
    "pythonic": [
        (
            "[get_weather(city='Paris', unit=\"celsius\"), get_time(zone='CET')]",
            "",
            [WEATHER, TIME],
        ),
        ("[search(q='a \"quoted\" } brace ] <tool_call>', n=[1, 2.5, None, True])]", "", [TRICKY]),
        ("Nothing to call.", "Nothing to call.", []),
        ("[Note] a list of no call", "[Note] a list of no call", []),
    ],
}


def stream(parser, text: str, cuts: list[int]):
    """Feed `text` cut at `cuts`; (content, {index: (name, arguments)}, ids per index)."""
    calls_stream = ToolCallStream(parser)
    content, names, arguments, ids = "", {}, {}, {}
    bounds = [0, *cuts, len(text)]
    for i, (start, end) in enumerate(zip(bounds, bounds[1:], strict=False)):
        piece, deltas = calls_stream.feed(text[start:end], last=i == len(bounds) - 2)
        content += piece or ""
        for delta in deltas or []:
            index = delta["index"]
            if "id" in delta:
                assert index not in names, "a call announced twice"
                assert index == len(names), "calls announced out of order"
                names[index] = delta["function"]["name"]
                ids[index] = delta["id"]
                arguments[index] = ""
            else:
                assert "name" not in delta["function"], "a name sent twice"
            arguments[index] += delta["function"]["arguments"]
    return content, [(names[i], arguments[i]) for i in sorted(names)], ids


def expected_calls(calls):
    return [(name, args) for name, args in calls]


@pytest.mark.parametrize(
    ("parser_name", "case"),
    [(name, i) for name, cases in CASES.items() for i in range(len(cases))],
)
def test_whole_and_streamed_at_every_cut(parser_name, case):
    text, content, calls = CASES[parser_name][case]
    parser = new_tool_parser(parser_name)
    whole = parser.read(text, final=True)
    assert whole.content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == expected_calls(calls)
    cut_sets = [[cut] for cut in range(1, len(text))]
    cut_sets.append(list(range(1, len(text))))  # one character at a time
    for cuts in cut_sets:
        streamed_content, streamed_calls, ids = stream(parser, text, cuts)
        where = f"cut at {cuts[:3]}"
        assert streamed_content == content, where
        assert [(n, json.loads(a)) for n, a in streamed_calls] == expected_calls(calls), where
        assert len(set(ids.values())) == len(ids)


def test_a_call_cut_short_is_content_when_the_output_ends():
    text = '<tool_call>{"name": "get_time", "arguments": {"zone": "CE'
    parsed = new_tool_parser("hermes").read(text, final=True)
    assert parsed.calls == [] and parsed.content == text


def test_forced_outputs():
    required = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, ' \
        '{"name": "get_time", "parameters": {"zone": "CET"}}]'  # fmt: skip
    named = '{"city": "Paris", "unit": "celsius"}'
    for parser, text, calls in (
        (RequiredCallsParser(), required, [WEATHER, TIME]),
        (NamedCallParser("get_weather"), named, [WEATHER]),
    ):
        for cuts in [[cut] for cut in range(1, len(text))]:
            content, streamed, _ = stream(parser, text, cuts)
            assert content == ""
            assert [(n, json.loads(a)) for n, a in streamed] == calls


def test_a_streamed_call_cut_short_is_not_sent_again_as_content():
    stream = ToolCallStream(new_tool_parser("hermes"))
    content, deltas = stream.feed('Hi <tool_call>{"name": "f", "arguments": {"a": 1', last=False)
    assert content == "Hi " and deltas[0]["function"]["name"] == "f"
    assert stream.feed("", last=True) == (None, None)
    assert stream.made_calls  # vLLM's tools_streamed: the call was sent (serving.py)
