"""POST /v1/messages and /v1/messages/count_tokens over real HTTP, read by the official
`anthropic` client: a message is what /v1/chat/completions answers for the same
conversation (greedy; the same template and tokens, so the same text and usage), its stop
reasons are vLLM 0.32's (end_turn, max_tokens, stop_sequence with the string), a stream's
named events come in vLLM's order and join into the non-streamed text, count_tokens counts
the prompt the message ran, and refusals are 400s (404 for an unknown model) in
Anthropic's error shape. Tools: test_anthropic_tools.py."""

from __future__ import annotations

import anthropic
import pytest

from tests.server.conftest import MODEL, serve_built
from tests.server.openai_helpers import post
from tests.server.serve_process import fetch
from tests.server.test_responses_api import _named_events

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0}
SYSTEM = "You are terse."
CONVERSATION = [
    {"role": "user", "content": "Name three colours."},
    {"role": "assistant", "content": "Red, green and blue."},
    {"role": "user", "content": "And three fruits?"},
]


def api(url: str, **keys: str) -> anthropic.Anthropic:
    """The official client on `url`: no retries, a 120 s timeout."""
    keys = keys or {"api_key": "unused"}
    return anthropic.Anthropic(base_url=url, max_retries=0, timeout=120, **keys)


def chat(url: str, messages: list, **fields) -> dict:
    """The greedy chat completion of `messages`: its one choice and usage."""
    body = {"model": MODEL, "messages": messages, "temperature": 0, **fields}
    reply = post(url, "/v1/chat/completions", body)
    assert reply.status == 200, reply.body
    return reply.json()


def message(url: str, **fields) -> dict:
    """The greedy /v1/messages answer, as JSON."""
    reply = post(url, "/v1/messages", {"model": MODEL, **GREEDY, **fields})
    assert reply.status == 200, reply.body
    return reply.json()


def streamed(url: str, **fields) -> list[tuple[str, dict]]:
    reply = post(url, "/v1/messages", {"model": MODEL, **GREEDY, "stream": True, **fields})
    assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/event-stream")
    return _named_events(reply.body)


def test_a_message_is_the_chat_answer(openai_server):
    got = api(openai_server).messages.create(
        model=MODEL, max_tokens=40, system=SYSTEM, messages=CONVERSATION, extra_body=GREEDY
    )
    expected = chat(
        openai_server, [{"role": "system", "content": SYSTEM}, *CONVERSATION], max_tokens=40
    )
    choice = expected["choices"][0]
    assert [block.type for block in got.content] == ["text"]
    assert got.content[0].text == choice["message"]["content"]
    assert got.usage.input_tokens == expected["usage"]["prompt_tokens"]
    assert got.usage.output_tokens == expected["usage"]["completion_tokens"]
    assert got.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[choice["finish_reason"]]
    assert got.id.startswith("chatcmpl-") and got.model == MODEL
    assert (got.type, got.role, got.stop_sequence) == ("message", "assistant", None)
    # vLLM's JSON: its keys in its order, nulls left out.
    raw = message(openai_server, max_tokens=40, system=SYSTEM, messages=CONVERSATION)
    assert list(raw) == ["id", "type", "role", "content", "model", "stop_reason", "usage"]
    assert raw["content"] == [{"type": "text", "text": got.content[0].text}]
    assert raw["usage"] == {
        "input_tokens": got.usage.input_tokens,
        "output_tokens": got.usage.output_tokens,
    }


def test_text_blocks_are_chat_parts_and_billing_headers_are_left_out(openai_server):
    system = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.0; cch=1a2b3c;"},
        {"type": "text", "text": "You are "},
        {"type": "text", "text": "terse.", "cache_control": {"type": "ephemeral"}},
    ]
    parts = [{"type": "text", "text": "Name three "}, {"type": "text", "text": "colours."}]
    got = message(
        openai_server, max_tokens=16, system=system, messages=[{"role": "user", "content": parts}]
    )
    expected = chat(
        openai_server,
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}],
        max_tokens=16,
    )
    assert got["content"][0]["text"] == expected["choices"][0]["message"]["content"]
    assert got["usage"]["input_tokens"] == expected["usage"]["prompt_tokens"]


def test_a_system_message_in_the_conversation_stays_where_it_is(openai_server):
    # SmolLM2's template takes a system message anywhere, so it is not merged (vLLM's probe).
    messages = [
        CONVERSATION[0],
        {"role": "system", "content": "Answer in French."},
        CONVERSATION[0],
    ]
    got = message(openai_server, max_tokens=12, messages=messages)
    expected = chat(openai_server, messages, max_tokens=12)
    assert got["content"][0]["text"] == expected["choices"][0]["message"]["content"]


def test_a_template_that_wants_the_system_message_first_gets_them_merged(
    server_loop, engine, no_api_key_env
):
    template = (
        "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
        "{{ raise_exception('System message must be first') }}{% endif %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with serve_built(server_loop, engine, "--chat-template", template) as url:
        inline = {"role": "system", "content": [{"type": "text", "text": " Answer in French."}]}
        messages = [CONVERSATION[0], inline, CONVERSATION[0]]
        got = message(url, max_tokens=8, system=SYSTEM, messages=messages)
        merged = {"role": "system", "content": SYSTEM + " Answer in French."}  # vLLM joins with ""
        expected = chat(url, [merged, CONVERSATION[0], CONVERSATION[0]], max_tokens=8)
    assert got["content"][0]["text"] == expected["choices"][0]["message"]["content"]
    assert got["usage"]["input_tokens"] == expected["usage"]["prompt_tokens"]


def test_a_stop_sequence_ends_the_message_with_it(openai_server):
    whole = message(openai_server, max_tokens=40, messages=CONVERSATION)["content"][0]["text"]
    stop = whole.split()[2]
    got = api(openai_server).messages.create(
        model=MODEL, max_tokens=40, messages=CONVERSATION, stop_sequences=[stop], extra_body=GREEDY
    )
    assert (got.stop_reason, got.stop_sequence) == ("stop_sequence", stop)
    assert got.content[0].text == whole[: whole.index(stop)]
    expected = chat(openai_server, CONVERSATION, max_tokens=40, stop=[stop])
    assert got.content[0].text == expected["choices"][0]["message"]["content"]
    assert got.usage.output_tokens == expected["usage"]["completion_tokens"]
    events = streamed(openai_server, max_tokens=40, messages=CONVERSATION, stop_sequences=[stop])
    (delta,) = [data for name, data in events if name == "message_delta"]
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}


def test_max_tokens_ends_the_message_with_max_tokens(openai_server):
    got = api(openai_server).messages.create(
        model=MODEL, max_tokens=5, messages=CONVERSATION, extra_body=GREEDY
    )
    assert (got.stop_reason, got.stop_sequence, got.usage.output_tokens) == ("max_tokens", None, 5)
    expected = chat(openai_server, CONVERSATION, max_tokens=5)
    assert got.content[0].text == expected["choices"][0]["message"]["content"]


def test_a_stream_has_vllms_events_and_the_same_text(openai_server):
    whole = message(openai_server, max_tokens=24, system=SYSTEM, messages=CONVERSATION)
    events = streamed(openai_server, max_tokens=24, system=SYSTEM, messages=CONVERSATION)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"} and "ping" not in names
    start = events[0][1]["message"]
    assert start == {
        "id": start["id"], "type": "message", "role": "assistant", "content": [], "model": MODEL,
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": whole["usage"]["input_tokens"], "output_tokens": 0},
    }  # fmt: skip
    assert start["id"].startswith("chatcmpl-")
    assert events[1][1] == {
        "type": "content_block_start", "content_block": {"type": "text", "text": ""}, "index": 0
    }  # fmt: skip
    deltas = [data for name, data in events if name == "content_block_delta"]
    assert all(list(d) == ["type", "delta", "index"] and d["index"] == 0 for d in deltas)
    assert "".join(d["delta"]["text"] for d in deltas) == whole["content"][0]["text"]
    assert events[-3][1] == {"type": "content_block_stop", "index": 0}
    assert events[-2][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": whole["stop_reason"], "stop_sequence": None},
        "usage": whole["usage"],
    }
    assert events[-1][1] == {"type": "message_stop"}
    # The client's stream helper builds the same message.
    with api(openai_server).messages.stream(
        model=MODEL, max_tokens=24, system=SYSTEM, messages=CONVERSATION, extra_body=GREEDY
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole["content"][0]["text"]
    assert final.stop_reason == whole["stop_reason"]
    assert final.usage.output_tokens == whole["usage"]["output_tokens"]


def test_count_tokens_counts_the_prompt_the_message_runs(openai_server):
    client = api(openai_server)
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=CONVERSATION)
    ran = client.messages.create(
        model=MODEL, max_tokens=1, system=SYSTEM, messages=CONVERSATION, extra_body=GREEDY
    )
    assert counted.input_tokens == ran.usage.input_tokens > 0
    raw = post(
        openai_server, "/v1/messages/count_tokens", {"model": MODEL, "messages": CONVERSATION}
    ).json()
    n = chat(openai_server, CONVERSATION, max_tokens=1)["usage"]["prompt_tokens"]
    assert raw == {"input_tokens": n, "context_management": {"original_input_tokens": n}}


def test_thinking_disabled_and_adaptive_run_as_chat_with_their_effort(openai_server):
    # SmolLM2's template renders every effort alike, so "disabled" is effort "low" (vLLM's
    # probe); adaptive sets none.
    plain = message(openai_server, max_tokens=8, messages=CONVERSATION)
    for thinking in ({"type": "disabled"}, {"type": "adaptive", "display": "omitted"}):
        got = message(openai_server, max_tokens=8, messages=CONVERSATION, thinking=thinking)
        assert got["content"] == plain["content"] and got["usage"] == plain["usage"]


# A template for which reasoning efforts matter: "max" thinks aloud, the others do not.
EFFORT_TEMPLATE = (
    "{% if reasoning_effort == 'max' %}Think hard, think long, think again. {% endif %}"
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
)


@pytest.mark.parametrize(("option", "effort"), [("max", "max"), ("auto", "low")])
def test_disabled_thinking_gets_the_effort_set_at_start_or_probed(
    start_openai_server, option, effort
):
    """--anthropic-disabled-thinking-effort: the template gets that effort for thinking
    "disabled"; auto probes the template ("none" renders as "low" does here: so "low")."""
    from aioserve.config.frontend import frontend_config

    url = start_openai_server(
        frontend=frontend_config(
            chat_template=EFFORT_TEMPLATE, anthropic_disabled_thinking_effort=option
        )
    )
    hi = [{"role": "user", "content": "Hi"}]
    body = {"model": MODEL, "messages": hi, "thinking": {"type": "disabled"}}
    counted = post(url, "/v1/messages/count_tokens", body).json()["input_tokens"]
    as_chat = chat(url, hi, max_tokens=1, reasoning_effort=effort)["usage"]["prompt_tokens"]
    thinking_hard = chat(url, hi, max_tokens=1, reasoning_effort="max")["usage"]["prompt_tokens"]
    assert counted == as_chat
    assert (counted == thinking_hard) == (effort == "max")


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}


@pytest.mark.parametrize(
    "fields, status, words",
    [
        ({"max_tokens": None}, 400, "the field `max_tokens` is required"),
        ({"max_tokens": 0}, 400, "max_tokens must be positive"),
        ({"messages": [{"role": "tool", "content": "hi"}]}, 400, "role must be one of"),
        ({"messages": [{"role": "user", "content": [IMAGE]}]}, 400, "is not a multimodal model"),
        (
            {"messages": [{"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [IMAGE]}]}]},
            400,
            "is not a multimodal model",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, 400, "type must be"),
        ({"stop_sequences": "Red"}, 400, "stop_sequences must be an array of strings"),
        ({"stop_sequences": list("abcde")}, 400, "VLLM_MAX_STOP_STRINGS"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 1500}, 400,
         "thinking_token_budget"),
        ({"tools": [{"name": "f", "input_schema": {}}]}, 400, "--enable-auto-tool-choice"),
        ({"tool_choice": {"type": "tool"}}, 400, "tool_choice.name is required"),
        ({"watermarking": True}, 400, "watermarking is not supported"),
        ({"model": "nope"}, 404, "The model `nope` does not exist"),
    ],
    ids=[
        "no-max-tokens", "zero-max-tokens", "role", "image", "image-in-tool-result",
        "block-type", "stop-type", "too-many-stops", "thinking-enabled", "auto-without-parser",
        "tool-without-name", "vllm-only-field", "unknown-model",
    ],
)  # fmt: skip
def test_refusals_are_in_anthropics_error_shape(openai_server, fields, status, words):
    body = {"model": MODEL, "max_tokens": 8, "messages": CONVERSATION, **fields}
    for stream in (False, True):  # a stream refused before it starts is answered the same
        reply = post(openai_server, "/v1/messages", {**body, "stream": stream})
        assert reply.status == status, reply.body
        error = reply.json()
        assert list(error) == ["type", "error"] and error["type"] == "error"
        assert list(error["error"]) == ["type", "message"]
        assert error["error"]["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
        assert words in error["error"]["message"]


def test_the_client_raises_the_refusal(openai_server):
    with pytest.raises(anthropic.BadRequestError) as raised:
        api(openai_server).messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [IMAGE]}]
        )
    assert raised.value.status_code == 400
    assert raised.value.body["error"]["type"] == "BadRequestError"
    counted = post(
        openai_server, "/v1/messages/count_tokens", {"model": MODEL, "messages": [{"role": "x"}]}
    )
    assert counted.status == 400 and counted.json()["type"] == "error"


def test_the_api_key_is_read_as_a_bearer_token(server_loop, engine, no_api_key_env):
    # As vLLM: `Authorization: Bearer` (the client's auth_token; its api_key too since
    # anthropic 2.0), not Anthropic's `x-api-key` header.
    with serve_built(server_loop, engine, "--api-key", "sekrit") as url:
        counted = api(url, auth_token="sekrit").messages.count_tokens(
            model=MODEL, messages=CONVERSATION
        )
        assert counted.input_tokens > 0
        body = {"model": MODEL, "messages": CONVERSATION}
        path = url + "/v1/messages/count_tokens"
        assert fetch("POST", path, body=body, headers={"x-api-key": "sekrit"}).status == 401
        with pytest.raises(anthropic.AuthenticationError):
            api(url, auth_token="wrong").messages.count_tokens(model=MODEL, messages=CONVERSATION)
