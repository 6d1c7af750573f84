"""POST /v1/chat/completions and the chat template, against the openai client and vLLM's samples.

References: vLLM 0.32's recorded answers on the same model (vllm_samples/: shapes, SSE
framing, error bodies, and its 37 prompt token ids for the capital question), the
`openai` client parsing our answers, the tokenizer's own `apply_chat_template`, and
AsyncEngine.generate called directly for the text.
"""

from __future__ import annotations

import asyncio
import uuid

import aiohttp
import pytest

from aioserve.config.frontend import frontend_config
from aioserve.engine.sampling_params import SamplingParams
from aioserve.server.chat_template import render_chat
from aioserve.server.errors import APIError
from aioserve.server.state import ServerState
from tests.server.conftest import MODEL, wait_until_idle
from tests.server.openai_helpers import (
    TIMEOUT,
    client,
    distinct_shapes,
    post,
    sample,
    sample_stream,
    shape,
    sse_events,
)

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# vLLM 0.32's rendering of QUESTION (vllm_samples/12_tokenize_chat.json), and its text.
VLLM_QUESTION_TOKENS = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
    407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1,
    520, 9531, 198,
]  # fmt: skip
QUESTION_TEXT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def chat(base_url: str, **fields):
    return client(base_url).chat.completions.create(model=MODEL, **fields)


# -- the chat template --------------------------------------------------------------------------


def test_render_chat_matches_vllms_tokens(engine):
    text, token_ids = render_chat(ServerState(engine, [MODEL]), QUESTION)
    assert text == QUESTION_TEXT
    assert token_ids == VLLM_QUESTION_TOKENS


def test_generation_prompt_and_continuing_the_final_message(engine):
    state = ServerState(engine, [MODEL])
    text, _ = render_chat(state, QUESTION, add_generation_prompt=False)
    assert text == QUESTION_TEXT.removesuffix("<|im_start|>assistant\n")
    partial = [*QUESTION, {"role": "assistant", "content": "The capital is"}]
    text, _ = render_chat(state, partial, add_generation_prompt=False, continue_final_message=True)
    assert text == QUESTION_TEXT + "The capital is"
    with pytest.raises(APIError, match="continue_final_message"):
        render_chat(state, partial, continue_final_message=True)


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        # A string template: parts are joined with newlines (vLLM's "string" format).
        ({"chat_template": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"},
         "<user>a\nb<user>c"),
        # A template that loops over the content gets OpenAI parts ("auto" detects it).
        ({"chat_template": "{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]"
                           "{% endfor %}{% endfor %}"},
         "[a][b][c]"),
        # Forced "string" on the tokenizer's own template.
        ({"chat_template_content_format": "string"}, None),
    ],
)  # fmt: skip
def test_content_parts_reach_the_template_in_the_configured_format(engine, options, expected):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": "c"},
    ]
    text, token_ids = render_chat(
        ServerState(engine, [MODEL], frontend=frontend_config(**options)),
        messages,
        add_generation_prompt=False,
    )
    if expected is None:
        joined = [messages[0] | {"content": "a\nb"}, messages[1]]
        expected = engine.tokenizer.apply_chat_template(joined, tokenize=False)
    assert text == expected
    assert token_ids == engine.tokenizer(expected, add_special_tokens=False).input_ids


def test_chat_template_from_a_file_with_extra_kwargs(engine, tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text("{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    state = ServerState(engine, [MODEL], frontend=frontend_config(chat_template=str(path)))
    text, _ = render_chat(state, QUESTION, chat_template_kwargs={"greeting": "Hi! "})
    assert text == "Hi! What is the capital of France?"


@pytest.mark.parametrize(
    ("messages", "kwargs", "param"),
    [
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {},
         "messages[0].content[0].type"),
        ([{"content": "no role"}], {}, "messages[0].role"),
        (["just text"], {}, "messages[0]"),
        ([{"role": "user", "content": 5}], {}, "messages[0].content"),
        ([{"role": "user", "content": [{"type": "text", "text": 5}]}], {},
         "messages[0].content[0].text"),
        (QUESTION, {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        # transformers' refusal, which vLLM reports with no param.
        (QUESTION, {"add_generation_prompt": True, "continue_final_message": True}, None),
    ],
)  # fmt: skip
def test_malformed_messages_are_400(engine, messages, kwargs, param):
    with pytest.raises(APIError) as raised:
        render_chat(ServerState(engine, [MODEL]), messages, **kwargs)
    assert raised.value.status == 400
    assert raised.value.param == param


def test_template_errors_are_400(engine):
    frontend = frontend_config(chat_template="{{ raise_exception('no') }}")
    state = ServerState(engine, [MODEL], frontend=frontend)
    with pytest.raises(APIError) as raised:
        render_chat(state, QUESTION)
    assert raised.value.status == 400 and "no" in raised.value.message


# -- the route ----------------------------------------------------------------------------------


def test_greedy_chat_is_the_engines_text_with_vllms_prompt_count(
    openai_server, engine, server_loop
):
    result = chat(openai_server, messages=QUESTION, max_tokens=8, temperature=0)

    async def direct():
        params = SamplingParams(temperature=0.0, max_tokens=8)
        prompt = {"prompt_token_ids": VLLM_QUESTION_TOKENS}
        outputs = [o async for o in engine.generate(prompt, params, f"direct-{uuid.uuid4()}")]
        return outputs[-1].outputs[0]

    expected = server_loop.run(direct())
    (choice,) = result.choices
    assert choice.message.content == expected.text
    assert choice.message.role == "assistant"
    assert choice.finish_reason == expected.finish_reason
    assert result.id.startswith("chatcmpl-")
    assert result.object == "chat.completion"
    assert result.usage.prompt_tokens == 37  # vLLM's count (vllm_samples/07_chat.json)
    assert result.usage.completion_tokens == len(expected.token_ids)
    wait_until_idle(engine, server_loop)


@pytest.mark.parametrize("name", ["07_chat", "10_chat_stop_length"])
def test_chat_has_vllms_shape(openai_server, name):
    reference = sample(name)
    body = {**reference["request"]["body"], "max_tokens": 5}
    reply = post(openai_server, "/v1/chat/completions", body)
    assert reply.status == 200
    assert shape(reply.json()) == shape(reference["response"]["body"])
    usage = reply.json()["usage"]
    assert usage["prompt_tokens"] == reference["response"]["body"]["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    ("stream_options", "name"),
    [(None, "08_chat_stream"), ({"include_usage": True}, "09_chat_stream_usage")],
)
def test_stream_is_framed_and_shaped_like_vllms(openai_server, stream_options, name):
    request = {"model": MODEL, "messages": QUESTION, "max_tokens": 6, "temperature": 0}
    streamed = {**request, "stream": True}
    if stream_options:
        streamed["stream_options"] = stream_options
    reply = post(openai_server, "/v1/chat/completions", streamed)
    assert reply.status == 200
    assert reply.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    events = sse_events(reply.body)
    assert distinct_shapes(events) == distinct_shapes(sse_events(sample_stream(name)))
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    whole = post(openai_server, "/v1/chat/completions", request).json()
    content = "".join(e["choices"][0]["delta"]["content"] for e in events if e["choices"])
    assert content == whole["choices"][0]["message"]["content"]
    if stream_options:
        assert events[-1]["usage"] == {
            "prompt_tokens": 37,
            "total_tokens": 37 + whole["usage"]["completion_tokens"],
            "completion_tokens": whole["usage"]["completion_tokens"],
        }


def test_n2_stream_opens_each_choice_with_its_role(openai_server):
    request = {
        "messages": QUESTION,
        "temperature": 0.9,
        "seed": 11,
        "n": 2,
        "max_completion_tokens": 5,
    }
    whole = chat(openai_server, **request)
    assert [c.index for c in whole.choices] == [0, 1]
    chunks = list(chat(openai_server, **request, stream=True))
    assert [(c.choices[0].index, c.choices[0].delta.role) for c in chunks[:2]] == [
        (0, "assistant"),
        (1, "assistant"),
    ]
    texts = {0: "", 1: ""}
    finishes = {}
    for chunk in chunks:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}


def test_return_prompt_text_sends_the_rendered_prompt(openai_server, hf_tokenizer):
    # The reference: vLLM's rendering of QUESTION, which transformers' own template gives.
    assert QUESTION_TEXT == hf_tokenizer.apply_chat_template(
        QUESTION, tokenize=False, add_generation_prompt=True
    )
    request = {"messages": QUESTION, "max_tokens": 2, "n": 2, "temperature": 0.9, "seed": 5}
    assert chat(openai_server, **request).model_extra["prompt_text"] is None
    asked = {**request, "extra_body": {"return_prompt_text": True}}
    assert chat(openai_server, **asked).model_extra["prompt_text"] == QUESTION_TEXT
    # vLLM cuts a truncated prompt's token ids only: the text stays the rendered template.
    cut = {**request, "extra_body": {"return_prompt_text": True, "truncate_prompt_tokens": 8}}
    reply = chat(openai_server, **cut)
    assert (reply.model_extra["prompt_text"], reply.usage.prompt_tokens) == (QUESTION_TEXT, 8)
    # Streamed: on each choice's first chunk (its role), as vLLM sends it, and on no other.
    chunks = [c.model_extra for c in chat(openai_server, **asked, stream=True)]
    assert [c.get("prompt_text") for c in chunks[:2]] == [QUESTION_TEXT, QUESTION_TEXT]
    assert all("prompt_text" not in c for c in chunks[2:])


def test_logprobs_under_greedy_name_the_sampled_token(openai_server):
    result = chat(
        openai_server, messages=QUESTION, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    (choice,) = result.choices
    content = choice.logprobs.content
    assert len(content) == result.usage.completion_tokens
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == entry.logprob
    if choice.finish_reason == "length":
        assert "".join(e.token for e in content) == choice.message.content
    without_top = chat(openai_server, messages=QUESTION, max_tokens=2, temperature=0, logprobs=True)
    assert all(e.top_logprobs == [] for e in without_top.choices[0].logprobs.content)


def test_content_parts_and_max_completion_tokens(openai_server, engine):
    parts = [
        {"type": "text", "text": "What is the capital"},
        {"type": "text", "text": "of France?"},
    ]
    result = chat(
        openai_server,
        messages=[{"role": "user", "content": parts}],
        max_completion_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    joined = [{"role": "user", "content": "What is the capital\nof France?"}]
    text = engine.tokenizer.apply_chat_template(joined, tokenize=False, add_generation_prompt=True)
    assert result.usage.prompt_tokens == len(
        engine.tokenizer(text, add_special_tokens=False).input_ids
    )
    assert result.usage.completion_tokens == 3


def test_response_role_and_continuing_a_message(start_openai_server):
    url = start_openai_server(frontend=frontend_config(response_role="bot"))
    assert chat(url, messages=QUESTION, max_tokens=1).choices[0].message.role == "bot"
    start = "The capital of France is"
    partial = [*QUESTION, {"role": "assistant", "content": start}]
    request = {
        "messages": partial,
        "max_tokens": 2,
        "temperature": 0,
        "extra_body": {"add_generation_prompt": False, "continue_final_message": True},
    }
    result = chat(url, **request)
    (choice,) = result.choices
    assert choice.message.role == "assistant"  # the role of the continued message
    assert not choice.message.content.startswith(start)
    # With echo, the reply starts with the message it continues, streamed or not.
    request["extra_body"]["echo"] = True
    echoed = chat(url, **request).choices[0].message.content
    assert echoed == start + choice.message.content
    chunks = list(chat(url, **request, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == echoed


def test_prompt_tokens_details_count_the_prefix_cache(start_openai_server):
    url = start_openai_server(frontend=frontend_config(enable_prompt_tokens_details=True))
    for _ in range(2):
        result = chat(url, messages=QUESTION, max_tokens=1, temperature=0)
    # The second time, the prompt's full 16-token blocks come from the prefix cache.
    assert result.usage.prompt_tokens_details.cached_tokens == 32
    chunks = list(
        chat(
            url,
            messages=QUESTION,
            max_tokens=1,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32


@pytest.mark.parametrize(
    "name",
    ["14_err_chat_max_tokens_neg", "20_err_temperature_neg", "22_err_stream_max_tokens_neg"],
)
def test_errors_equal_vllms(openai_server, name):
    reference = sample(name)
    reply = post(openai_server, "/v1/chat/completions", reference["request"]["body"])
    assert reply.status == reference["response"]["status"]
    assert reply.headers["Content-Type"].startswith("application/json")
    assert reply.json() == reference["response"]["body"]


@pytest.mark.parametrize(
    ("name", "status", "param"),
    [("16_err_unknown_model_chat", 404, "model"), ("18_err_missing_messages", 400, "messages")],
)
def test_errors_like_vllms(openai_server, name, status, param):
    reference = sample(name)
    reply = post(openai_server, "/v1/chat/completions", reference["request"]["body"])
    assert reply.status == status == reference["response"]["status"]
    error = reply.json()["error"]
    assert shape(error) == shape(reference["response"]["body"]["error"])
    assert error["param"] == param


@pytest.mark.parametrize(
    ("fields", "param", "shown"),
    [
        ({"messages": []}, "messages", "value=[]"),
        ({"messages": "hi"}, "messages", "value=hi"),
        ({"top_logprobs": 2}, "top_logprobs", "logprobs must be true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "value=21"),
        ({"logprobs": 1}, "logprobs", "value=1"),
        ({"max_completion_tokens": -1}, "max_completion_tokens", "value=-1"),
        ({"max_tokens": 2049}, "max_tokens", "cannot be greater than max_model_len=2048"),
        (
            {"max_completion_tokens": 4096},
            "max_completion_tokens",
            "max_completion_tokens=4096 cannot be greater",
        ),
        ({"continue_final_message": True}, None, "are not compatible"),
        ({"chat_template_kwargs": "x"}, "chat_template_kwargs", "value=x"),
        ({"return_prompt_text": "yes"}, "return_prompt_text", "value=yes"),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "value=null"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "'json_schema' field"),
        ({"guided_regex": "(a"}, "guided_regex", "unclosed group"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0].type",
            "value=image_url",
        ),
    ],
)
def test_bad_fields_are_400_naming_field_and_value(openai_server, fields, param, shown):
    body = {"messages": QUESTION, "max_tokens": 2, **fields}
    reply = post(openai_server, "/v1/chat/completions", body)
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert error["param"] == param
    assert shown in error["message"]


def test_draining_server_refuses_with_503(start_openai_server):
    url = start_openai_server(draining=True)
    reply = post(url, "/v1/chat/completions", {"messages": QUESTION, "stream": True})
    assert reply.status == 503
    assert reply.json()["error"]["type"] == "ServiceUnavailableError"


def test_client_leaving_a_stream_aborts_it(openai_server, engine, server_loop):
    async def leave_early():
        body = {"messages": QUESTION, "max_tokens": 500, "ignore_eos": True, "stream": True}
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            async with session.post(f"{openai_server}/v1/chat/completions", json=body) as reply:
                role = await reply.content.readuntil(b"\n\n")
                await reply.content.readuntil(b"\n\n")
                reply.close()
        return role

    role = asyncio.run(asyncio.wait_for(leave_early(), 60))
    assert b'"role":"assistant"' in role
    wait_until_idle(engine, server_loop)


def test_max_tokens_past_the_room_left_is_cut_to_it(openai_server):
    """vLLM cuts max_tokens to what the context leaves after the prompt (get_max_tokens): a
    question rendered to 2,031 tokens leaves 17 of the 2,048 (a short one took ~100 s of CI
    to write its ~2,000)."""
    question = [{"role": "user", "content": "hello " * 2000}]
    body = {"messages": question, "max_tokens": 2048, "temperature": 0, "ignore_eos": True}
    reply = post(openai_server, "/v1/chat/completions", body)
    assert reply.status == 200, reply.body
    assert reply.json()["usage"]["prompt_tokens"] == 2031
    assert reply.json()["usage"]["completion_tokens"] == 17
    assert reply.json()["choices"][0]["finish_reason"] == "length"


def test_a_token_whose_text_is_held_back_still_sends_its_chunk(openai_server):
    """Without a parser vLLM streams a chunk for every step that generated tokens, its
    content "" while a stop string might start there."""
    body = {"messages": QUESTION, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    text = post(openai_server, "/v1/chat/completions", body).json()["choices"][0]["message"][
        "content"
    ]
    held = body | {"stop": [text + " and more"], "stream": True}
    events = sse_events(post(openai_server, "/v1/chat/completions", held).body)
    deltas = [e["choices"][0]["delta"] for e in events if e != "[DONE]" and e["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    contents = [delta["content"] for delta in deltas[1:]]
    assert contents[:3] == ["", "", ""] and len(contents) == 4 and "".join(contents) == text
