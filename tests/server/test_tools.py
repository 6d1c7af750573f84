"""Tools as vLLM 0.32 serves them without --enable-auto-tool-choice: with tool_choice
"none" the tools reach the chat template and the answer is plain content; "auto" (the
default when tools are given) is a 400 saying it needs the flag and a parser, as are
malformed tools and tool choices (vLLM's messages). "required" and named functions, which
need no parser, are tested in test_tool_calls.py.

The reference for what the template receives is transformers' own `apply_chat_template`
with the same template, tools and messages, on the same tokenizer: the request's
usage.prompt_tokens must be the length of that rendering.
"""

from __future__ import annotations

import pytest

from aioserve.config.frontend import frontend_config
from aioserve.server import routes
from aioserve.server.state import ServerState
from tests.server.conftest import MODEL, openai_app, serve_app
from tests.server.openai_helpers import client, post

pytestmark = pytest.mark.slow

# Writes each tool's name and parameters, and each history call, where a test can count them.
TEMPLATE = (
    "{%- if tools %}Tools:{% for t in tools %} {{ t.function.name }}"
    "{{ t.function.parameters | tojson }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}call {{ c.function.name }} "
    "{{ c.function.arguments }}{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = [
    *QUESTION,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
]


def reference_prompt_tokens(engine, messages, tools) -> int:
    text = engine.tokenizer.apply_chat_template(
        messages, chat_template=TEMPLATE, tools=tools, tokenize=False, add_generation_prompt=True
    )
    return len(engine.tokenizer(text, add_special_tokens=False).input_ids)


@pytest.fixture(scope="module")
def templated_url(engine, server_loop):
    state = ServerState(engine, [MODEL], frontend=frontend_config(chat_template=TEMPLATE))
    app = openai_app(state)
    app.router.add_post("/tokenize", routes.tokenize)
    with serve_app(server_loop, app) as url:
        yield url


@pytest.mark.parametrize("messages", [QUESTION, HISTORY], ids=["question", "history"])
def test_tool_choice_none_gives_the_tools_to_the_template(engine, templated_url, messages):
    reply = client(templated_url).chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=2,
        extra_body={"ignore_eos": True},
    )
    with_tools = reference_prompt_tokens(engine, messages, [WEATHER])
    assert with_tools > reference_prompt_tokens(engine, messages, None)
    assert reply.usage.prompt_tokens == with_tools
    (choice,) = reply.choices
    assert choice.message.tool_calls is None
    assert choice.message.content and choice.finish_reason == "length"


def test_tokenize_gives_the_tools_to_the_template(engine, templated_url):
    body = {"messages": HISTORY, "tools": [WEATHER]}
    reply = post(templated_url, "/tokenize", body)
    assert reply.status == 200, reply.body
    assert reply.json()["count"] == reference_prompt_tokens(engine, HISTORY, [WEATHER])
    malformed = post(templated_url, "/tokenize", body | {"tools": [{"type": "function"}]})
    assert malformed.status == 400
    assert malformed.json()["error"]["param"] == "tools[0].function"


def test_the_exclude_flag_leaves_the_tools_out(engine, start_openai_server):
    frontend = frontend_config(chat_template=TEMPLATE, exclude_tools_when_tool_choice_none=True)
    url = start_openai_server(frontend=frontend)
    body = {"messages": QUESTION, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 1}
    reply = post(url, "/v1/chat/completions", body)
    assert reply.status == 200, reply.body
    assert reply.json()["usage"]["prompt_tokens"] == reference_prompt_tokens(engine, QUESTION, None)


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        # vLLM's create_error_response names no parameter here (online_renderer.py)
        ({"tools": [WEATHER]}, None, '"auto" tool choice requires --enable-auto-tool'),
        ({"tools": [WEATHER], "tool_choice": "auto"}, None, '"auto" tool choice'),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice", "does not match any of the specified `tools`"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function",
         "Invalid value for `function`"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {}}},
         "tool_choice.function.name", "Expected field `name`"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice",
         "Invalid value for `tool_choice`: sometimes!"),
        ({"tool_choice": "auto"}, "tool_choice", "When using `tool_choice`, `tools` must be set."),
        ({"tools": []}, "tools", "`tools` must not be an empty array"),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "a `function` object"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type",
         '"function"'),
        ({"tools": [{"function": {"name": 5}}]}, "tools[0].function.name", "a name"),
        ({"tools": [{"function": {"name": "f", "parameters": "x"}}]},
         "tools[0].function.parameters", "must be an object"),
        ({"tools": "x"}, "tools", "must be an array"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "must be a boolean"),
    ],
)  # fmt: skip
def test_tool_requests_needing_a_parser_or_malformed_are_400(openai_server, fields, param, words):
    reply = post(openai_server, "/v1/chat/completions", {"messages": QUESTION, **fields})
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert error["param"] == param
    assert words in error["message"]


def test_tool_choice_none_without_tools_is_served(openai_server):
    body = {"messages": QUESTION, "tool_choice": "none", "parallel_tool_calls": False}
    assert post(openai_server, "/v1/chat/completions", body | {"max_tokens": 1}).status == 200
