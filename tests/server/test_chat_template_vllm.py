"""The chat template's inputs built as vLLM 0.32 builds them, and /tokenize's chat checks.

References, each named where used: vLLM 0.32's renderers/chat_utils.py
(`_parse_chat_message_content`, `_parse_chat_message_content_part`,
`_postprocess_messages`), renderers/hf.py (`_detect_content_format`,
`_convert_developer_to_system`, `_consolidate_system_messages`, `safe_apply_chat_template`),
renderers/params.py (`merge_kwargs`, `ChatParams.with_defaults`), the chat request model
(chat_completion/protocol.py: `build_chat_params`, `to_sampling_params`) and
renderers/online_renderer.py (`validate_chat_template`). Each expected rendering below
was checked by running vLLM 0.32's own functions (or its server) on the same messages and
template.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack

import pytest
from aiohttp import web

from aioserve.config.frontend import frontend_config, frontend_config_from_args
from aioserve.config.parser import build_engine_parser
from aioserve.server import routes
from aioserve.server.chat_template import (
    BOTH_GENERATION_FLAGS,
    UNTRUSTED_TEMPLATE,
    _detect_content_format,
    render_chat,
    template_kwargs,
)
from aioserve.server.errors import APIError, error_middleware
from aioserve.server.openai_routes import add_openai_routes
from aioserve.server.protocol import parse_chat_request
from aioserve.server.state import STATE, ServerState
from tests.server.conftest import MODEL, serve_app
from tests.server.openai_helpers import post

pytestmark = pytest.mark.slow

# Each message's role and its content as JSON: what the template is given.
DUMP = "{% for m in messages %}{{ m.role }}={{ m.content | tojson }};{% endfor %}"
QUESTION = [{"role": "user", "content": "Hi"}]


def render(engine, messages, template=DUMP, content_format="auto", **kwargs) -> str:
    frontend = frontend_config(chat_template=template, chat_template_content_format=content_format)
    state = ServerState(engine, [MODEL], frontend=frontend)
    return render_chat(state, messages, add_generation_prompt=False, **kwargs)[0]


def refusal(engine, messages, template=DUMP, **kwargs) -> APIError:
    with pytest.raises(APIError) as raised:
        render(engine, messages, template, **kwargs)
    assert raised.value.status == 400
    return raised.value


def call(arguments):
    return {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}


# -- messages (chat_utils.py, _parse_chat_message_content) ---------------------------------------


@pytest.mark.parametrize(("content_format", "empty"), [("string", '""'), ("openai", "[]")])
def test_missing_content_and_an_assistants_null_content_render_empty(engine, content_format, empty):
    messages = [
        {"role": "user"},
        {"role": "assistant", "content": None, "tool_calls": [call("{}")]},
        {"role": "tool", "tool_call_id": "c"},
    ]
    text = render(engine, messages, content_format=content_format)
    # A tool message's content is a string in either format.
    assert text == f'user={empty};assistant={empty};tool="";'


def test_a_null_content_outside_an_assistant_message_is_400(engine):
    # vLLM's request model lets only the assistant message's content be null.
    error = refusal(engine, [{"role": "user", "content": None}])
    assert error.param == "messages[0].content"


def test_past_tool_call_arguments_reach_the_template_as_objects(engine):
    template = (
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{{ c.function.name }}:{{ c.function.arguments | tojson }};{% endfor %}{% endfor %}"
    )
    calls = [call('{"city": "Paris"}'), call("not json"), call("[1]"), call(""), call(None)]
    text = render(engine, [{"role": "assistant", "content": "", "tool_calls": calls}], template)
    # Invalid JSON, or JSON that is not an object, becomes {} (_postprocess_messages).
    assert text == 'f:{"city": "Paris"};f:{};f:{};f:{};f:{};'


def test_an_empty_list_of_past_tool_calls_is_dropped(engine):
    template = "{% for m in messages %}{{ 'tool_calls' in m }}{% endfor %}"
    text = render(engine, [{"role": "assistant", "content": "x", "tool_calls": []}], template)
    assert text == "False"


@pytest.mark.parametrize(
    "bad_call",
    [
        {"id": "c", "type": "custom", "custom": {"name": "f", "input": "x"}},
        {"id": "c", "type": "function", "function": "f"},
    ],
)
def test_a_past_tool_call_not_of_type_function_is_vllms_400(engine, bad_call):
    error = refusal(engine, [{"role": "assistant", "tool_calls": [bad_call]}])
    assert error.message == (
        "chat completions only support assistant tool_calls of type 'function'. "
        "(parameter=tool_calls)"
    )
    assert error.param == "tool_calls"


def test_only_the_keys_vllm_passes_on_reach_the_template(engine):
    template = "{% for m in messages %}{{ m | dictsort | map('first') | join(',') }};{% endfor %}"
    messages = [
        {"role": "user", "content": "x", "name": "bob", "foo": 1, "task": "t"},
        {"role": "tool", "content": "y", "tool_call_id": "c", "bar": 2},
    ]
    assert render(engine, messages, template) == (
        "content,name,role,task;content,role,tool_call_id;"
    )


def test_a_past_reasoning_reaches_the_template_under_both_names(engine):
    template = "{% for m in messages %}{{ m.reasoning }}|{{ m.reasoning_content }};{% endfor %}"
    messages = [
        {"role": "assistant", "content": "a", "reasoning_content": "r1"},
        {"role": "assistant", "content": "b", "reasoning": "r2"},
    ]
    assert render(engine, messages, template) == "r1|r1;r2|r2;"


# -- content parts (chat_utils.py, _parse_chat_message_content_part) -----------------------------

TEXT_LIKE_PARTS = [
    {"type": "refusal", "refusal": "no"},
    {"type": "thinking", "thinking": "hm"},
    {"type": "text", "text": None},
    {"type": "refusal"},
    {"type": "input_text", "text": "in"},
    {"type": "output_text", "text": "out"},
    {"type": "text", "text": "t", "cache_control": {"type": "ephemeral"}},
]


def test_text_like_parts_are_text_and_parts_without_text_are_skipped(engine):
    messages = [{"role": "assistant", "content": TEXT_LIKE_PARTS}]
    assert render(engine, messages, content_format="string") == (
        'assistant="no\\nhm\\nin\\nout\\nt";'
    )
    # As parts, a part keeps the fields vLLM does not know (_collect_extra_fields).
    parts = json.loads(render(engine, messages, "{{ messages[0].content | tojson }}", "openai"))
    assert parts == [
        {"type": "text", "text": "no"},
        {"type": "text", "text": "hm"},
        {"type": "text", "text": "in"},
        {"type": "text", "text": "out"},
        {"type": "text", "text": "t", "cache_control": {"type": "ephemeral"}},
    ]


def test_a_tool_messages_parts_are_joined_into_a_string_in_the_openai_format(engine):
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    messages = [{"role": "tool", "tool_call_id": "c", "content": parts}]
    assert render(engine, messages, content_format="openai") == 'tool="a\\nb";'


@pytest.mark.parametrize(
    ("part", "param"),
    [
        ({"type": "image_url", "image_url": {"url": "http://x/y.png"}}, "type"),
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "type"),
        ({"type": "foo", "text": "x"}, "type"),
        ({"text": "x"}, "type"),
        ({"type": "text", "text": 5}, "text"),
    ],
)
def test_media_and_malformed_parts_are_400(engine, part, param):
    error = refusal(engine, [{"role": "user", "content": [part]}])
    assert error.param == f"messages[0].content[0].{param}"


# -- the developer role (hf.py, _convert_developer_to_system, _consolidate_system_messages) ------

ROLES = "{% for m in messages %}<{{ m.role }}:{{ m.content }}>{% endfor %}"
WITH_SYSTEMS = [
    {"role": "system", "content": "S1"},
    {"role": "user", "content": "u"},
    {"role": "developer", "content": "D", "tools": []},
    {"role": "system", "content": [{"type": "text", "text": "S2"}, {"type": "text", "text": "S3"}]},
]


def test_developer_becomes_system_and_system_messages_merge_first(engine):
    assert render(engine, WITH_SYSTEMS, ROLES) == "<system:S1\n\nD\n\nS2\nS3><user:u>"


def test_a_template_naming_the_developer_role_gets_it_as_sent(engine):
    template = "{#- handles 'developer' #}" + ROLES
    assert render(engine, WITH_SYSTEMS, template) == (
        "<system:S1><user:u><developer:D><system:S2\nS3>"
    )


def test_without_a_developer_message_system_messages_stay_apart(engine):
    messages = [m for m in WITH_SYSTEMS if m["role"] != "developer"]
    assert render(engine, messages, ROLES) == "<system:S1><user:u><system:S2\nS3>"


# -- the content format (hf.py, _detect_content_format) ------------------------------------------


@pytest.mark.parametrize(
    ("template", "detected"),
    [
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
        ("{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
         "openai"),
        # Through a filter, a variable named content, an alias of messages, a macro.
        ("{% for m in messages %}{% for p in m['content'] | selectattr('type', 'equalto', "
         "'text') %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
        ("{% for m in messages %}{% set content = m['content'] %}{% for p in content %}"
         "{{ p.text }}{% endfor %}{% endfor %}", "openai"),
        ("{% set msgs = messages[1:] %}{% for m in msgs %}{% for p in m['content'] %}"
         "{{ p.text }}{% endfor %}{% endfor %}", "openai"),
        ("{% macro r(x) %}{% for p in x %}{{ p.text }}{% endfor %}{% endmacro %}"
         "{% for m in messages %}{{ r(m['content']) }}{% endfor %}", "openai"),
        ("{% for m in messages %}{% generation %}{% for p in m['content'] %}{{ p.text }}"
         "{% endfor %}{% endgeneration %}{% endfor %}", "openai"),
        # Not a message's content: another variable's, or content under another name.
        ("{% for d in documents %}{% for c in d['content'] %}{{ c }}{% endfor %}{% endfor %}"
         "{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
        ("{% for m in messages %}{% set c = m['content'] %}{% for p in c %}{{ p }}{% endfor %}"
         "{% endfor %}", "string"),
        ("{% for m in messages %}", "string"),
    ],
)  # fmt: skip
def test_the_content_format_is_detected_as_vllm_detects_it(template, detected):
    assert _detect_content_format(template) == detected


def test_the_models_own_template_takes_strings(engine):
    assert _detect_content_format(engine.tokenizer.chat_template) == "string"


# -- the template's variables (params.py merge_kwargs; protocol.py build_chat_params) ------------


@pytest.mark.parametrize(
    ("defaults", "requested", "fields", "expected"),
    [
        ({"x": 1, "y": 1}, {"x": 2, "y": None, "z": "auto"}, {}, {"x": 2, "y": 1}),
        (None, {"documents": [{"text": "k"}]}, {"documents": None}, {"documents": [{"text": "k"}]}),
        (None, {"documents": [{"text": "k"}]}, {"documents": [{"text": "t"}]},
         {"documents": [{"text": "t"}]}),
        ({"enable_thinking": False}, None, {"reasoning_effort": "high"},
         {"enable_thinking": True, "reasoning_effort": "high"}),
        ({"enable_thinking": True}, None, {"reasoning_effort": "none"},
         {"enable_thinking": False, "reasoning_effort": "none"}),
        # The request naming enable_thinking, even as null, keeps the effort off it.
        ({"enable_thinking": False}, {"enable_thinking": None}, {"reasoning_effort": "high"},
         {"enable_thinking": False, "reasoning_effort": "high"}),
    ],
)  # fmt: skip
def test_template_kwargs_merge_as_vllms(defaults, requested, fields, expected):
    assert template_kwargs(defaults, requested, **fields) == expected


VARIABLES = (
    "{{ x }}|{{ enable_thinking }}|{{ documents | tojson }}|{{ tools | tojson }}|"
    "{{ add_generation_prompt }}"
)


def test_kwargs_naming_apply_chat_template_arguments(engine):
    tools = [{"type": "function", "function": {"name": "f"}}]
    kwargs = {
        "x": 1,
        "tools": [{"k": 1}],  # wins over `tools`, as in vLLM
        "documents": [{"text": "d"}],
        "add_generation_prompt": True,  # the request's own field wins
        "tokenize": True,  # ignored, as are return_dict and a null chat_template
        "return_dict": True,
        "chat_template": None,
    }
    text = render(engine, QUESTION, VARIABLES, chat_template_kwargs=kwargs, tools=tools)
    assert text == '1||[{"text": "d"}]|[{"k": 1}]|False'


@pytest.mark.parametrize("name", ["messages", "conversation"])
def test_kwargs_naming_the_messages_are_400(engine, name):
    assert refusal(engine, QUESTION, chat_template_kwargs={name: []}).param == (
        "chat_template_kwargs"
    )


def test_a_template_in_the_kwargs_is_vllms_untrusted_template_400(engine):
    error = refusal(engine, QUESTION, chat_template_kwargs={"chat_template": "{{ 1 }}"})
    assert (error.message, error.param) == (UNTRUSTED_TEMPLATE, None)


def test_the_servers_default_kwargs_are_under_the_requests(engine):
    frontend = frontend_config(chat_template=VARIABLES, default_chat_template_kwargs={"x": "D"})
    state = ServerState(engine, [MODEL], frontend=frontend)
    assert render_chat(state, QUESTION)[0].startswith("D|")
    assert render_chat(state, QUESTION, chat_template_kwargs={"x": "R"})[0].startswith("R|")


def test_default_kwargs_and_reasoning_effort_reach_the_reasoning_parser(engine):
    # ChatRequest.chat_template_kwargs is what chat.py gives the reasoning parser (vLLM's
    # _effective_chat_template_kwargs): the defaults, the request's, the effort's.
    frontend = frontend_config(default_chat_template_kwargs={"enable_thinking": False, "x": 1})
    state = ServerState(engine, [MODEL], frontend=frontend)
    parsed = parse_chat_request(state, {"messages": QUESTION})
    assert parsed.chat_template_kwargs == {"enable_thinking": False, "x": 1}
    parsed = parse_chat_request(state, {"messages": QUESTION, "reasoning_effort": "low"})
    assert parsed.chat_template_kwargs["enable_thinking"] is True


def test_the_default_kwargs_flag_is_a_json_object():
    parser = build_engine_parser("aioserve serve")
    args = parser.parse_args(["--default-chat-template-kwargs", '{"enable_thinking": false}'])
    assert frontend_config_from_args(args).default_chat_template_kwargs == {
        "enable_thinking": False
    }


# -- over HTTP -----------------------------------------------------------------------------------


@pytest.fixture
def start_server(engine, server_loop) -> Iterator[Callable[..., str]]:
    """A factory: `start_server(frontend=...)` -> base URL of an app with the OpenAI routes
    and /tokenize."""
    with ExitStack() as stack:

        def start(**state_fields) -> str:
            app = web.Application(middlewares=[error_middleware])
            app[STATE] = ServerState(engine, [MODEL], **state_fields)
            add_openai_routes(app)
            routes.add_routes(app, load_tracking=False)
            return stack.enter_context(serve_app(server_loop, app))

        yield start


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        ({"messages": QUESTION, "chat_template": "{{ 1 }}"}, UNTRUSTED_TEMPLATE, None),
        (
            {"messages": QUESTION, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
            UNTRUSTED_TEMPLATE,
            None,
        ),
        (
            {"messages": QUESTION, "add_generation_prompt": True, "continue_final_message": True},
            BOTH_GENERATION_FLAGS,
            None,
        ),
        (
            {"prompt": "Hi", "add_generation_prompt": True, "continue_final_message": True},
            BOTH_GENERATION_FLAGS,
            None,
        ),
        (
            {"messages": QUESTION, "mm_processor_kwargs": {"a": 1}},
            "Per-request mm_processor_kwargs are disabled by default because they can change "
            "multimodal preprocessing resource usage. Start the server with "
            "--trust-request-mm-kwargs only when clients are trusted. "
            "(parameter=mm_processor_kwargs)",
            "mm_processor_kwargs",
        ),
        (
            {"prompt": "Hi", "media_io_kwargs": {"image": {}}},
            "Per-request media_io_kwargs are disabled by default because they can change "
            "multimodal media loading resource usage. Start the server with "
            "--trust-request-mm-kwargs only when clients are trusted. "
            "(parameter=media_io_kwargs)",
            "media_io_kwargs",
        ),
    ],
)
def test_tokenize_refuses_as_vllm(start_server, body, message, param):
    # Messages and params as vLLM 0.32's server answered the same bodies.
    reply = post(start_server(), "/tokenize", body)
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert (error["message"], error["param"]) == (message, param)


def test_tokenize_renders_with_the_servers_default_kwargs(start_server, engine):
    frontend = frontend_config(chat_template="{{ x }}", default_chat_template_kwargs={"x": "Hi"})
    url = start_server(frontend=frontend)
    reply = post(url, "/tokenize", {"messages": QUESTION})
    assert reply.json()["tokens"] == engine.tokenizer("Hi", add_special_tokens=False).input_ids


def test_chat_echo_alone_returns_the_prompts_logprobs(openai_server):
    # vLLM's top_logprobs defaults to 0, and echo asks for that many prompt logprobs.
    body = {"messages": QUESTION, "max_tokens": 1, "echo": True, "return_token_ids": True}
    reply = post(openai_server, "/v1/chat/completions", body).json()
    prompt_logprobs = reply["prompt_logprobs"]
    assert prompt_logprobs is not None
    assert len(prompt_logprobs) == len(reply["prompt_token_ids"])
    assert prompt_logprobs[0] is None and all(len(p) == 1 for p in prompt_logprobs[1:])


@pytest.mark.parametrize(
    ("fields", "rendered"),
    [
        ({"documents": [{"title": "t", "text": "x"}]}, '[{"title": "t", "text": "x"}]||'),
        ({"reasoning_effort": "none"}, "null|none|False"),
        ({"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}},
         "null|high|False"),
        # Left out, reasoning_effort and enable_thinking are undefined: vLLM passes no null.
        ({"add_special_tokens": True}, "null||"),
    ],
)  # fmt: skip
def test_chat_fields_reach_the_template(start_openai_server, engine, fields, rendered):
    template = "{{ documents | tojson }}|{{ reasoning_effort }}|{{ enable_thinking }}"
    url = start_openai_server(frontend=frontend_config(chat_template=template))
    body = {"messages": QUESTION, "max_tokens": 1, "return_token_ids": True, **fields}
    reply = post(url, "/v1/chat/completions", body)
    assert reply.status == 200, reply.body
    expected = engine.tokenizer(rendered, add_special_tokens=False).input_ids
    assert reply.json()["prompt_token_ids"] == expected


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"documents": [{"text": 1}]}, "documents"),
        ({"add_special_tokens": "yes"}, "add_special_tokens"),
    ],
)
def test_bad_chat_template_fields_are_400(openai_server, fields, param):
    reply = post(openai_server, "/v1/chat/completions", {"messages": QUESTION, **fields})
    assert reply.status == 400
    assert reply.json()["error"]["param"] == param
