"""A request's own chat template (`--trust-request-chat-template`), over real HTTP.

As vLLM 0.32 (renderers/online_renderer.py `validate_chat_template`, the request models'
`build_chat_params`: `request.chat_template or default_template`, renderers/params.py
`get_apply_chat_template_kwargs`): with the flag, a request's `chat_template` renders its
prompt, before --chat-template, before `chat_template_kwargs.chat_template`, before the
tokenizer's; without it, either is refused with vLLM's own 400. The expected prompts are
written out by hand from each template and tokenized by transformers' tokenizer of the
model, apart from the server.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.server.conftest import MODEL, serve_built
from tests.server.openai_helpers import client, post

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Hi"}]
# Writes a fixed marker, then each message, then the variables it is given.
MARKED = (
    "<<MARK>>{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
    "{% if add_generation_prompt %}>>{% endif %}{{ greeting | default('') }}"
)
# vLLM 0.32's words (renderers/online_renderer.py, validate_chat_template).
UNTRUSTED = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)


@pytest.fixture(scope="module")
def trusted(engine, server_loop) -> Iterator[str]:
    with serve_built(server_loop, engine, "--trust-request-chat-template") as url:
        yield url


@pytest.fixture(scope="module")
def untrusted(engine, server_loop) -> Iterator[str]:
    with serve_built(server_loop, engine) as url:
        yield url


def ids(hf_tokenizer, text: str) -> list[int]:
    return hf_tokenizer(text, add_special_tokens=False).input_ids


def chat(url: str, **extra) -> openai.types.chat.ChatCompletion:
    return client(url).chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=1,
        temperature=0,
        extra_body={"return_prompt_text": True, "return_token_ids": True, **extra},
    )


def test_a_requests_template_renders_its_prompt(trusted, hf_tokenizer):
    reply = chat(trusted, chat_template=MARKED)
    expected = "<<MARK>>[user:Hi]>>"
    assert reply.model_extra["prompt_text"] == expected
    assert reply.model_extra["prompt_token_ids"] == ids(hf_tokenizer, expected)


def test_the_requests_kwargs_reach_its_template(trusted, hf_tokenizer):
    reply = chat(
        trusted,
        chat_template=MARKED,
        chat_template_kwargs={"greeting": "hello"},
        add_generation_prompt=False,
    )
    assert reply.model_extra["prompt_text"] == "<<MARK>>[user:Hi]hello"


def test_a_template_in_the_kwargs_renders_when_no_other_is_given(trusted):
    reply = chat(trusted, chat_template_kwargs={"chat_template": "kw{{ messages | length }}"})
    assert reply.model_extra["prompt_text"] == "kw1"
    # The field comes before the kwargs' template.
    both = chat(trusted, chat_template="field", chat_template_kwargs={"chat_template": "kwargs"})
    assert both.model_extra["prompt_text"] == "field"


def test_a_requests_template_comes_before_the_servers(engine, server_loop):
    argv = ("--trust-request-chat-template", "--chat-template", "server{{ messages | length }}")
    with serve_built(server_loop, engine, *argv) as url:
        assert chat(url, chat_template="request").model_extra["prompt_text"] == "request"
        # An empty one is none (vLLM's `request.chat_template or default_template`) ...
        assert chat(url, chat_template="").model_extra["prompt_text"] == "server1"
        # ... and --chat-template comes before the kwargs' template.
        kwargs = {"chat_template": "kwargs"}
        reply = chat(url, chat_template_kwargs=kwargs)
        assert reply.model_extra["prompt_text"] == "server1"


def test_without_a_request_template_the_models_own_renders(trusted, untrusted):
    assert chat(trusted).model_extra["prompt_text"] == chat(untrusted).model_extra["prompt_text"]


def test_a_stream_is_rendered_with_the_requests_template(trusted):
    stream = client(trusted).chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=1,
        stream=True,
        extra_body={"chat_template": MARKED, "return_prompt_text": True},
    )
    texts = [chunk.model_extra.get("prompt_text") for chunk in stream]
    assert "<<MARK>>[user:Hi]>>" in texts


def test_tokenize_takes_the_requests_template(trusted, hf_tokenizer):
    body = {"model": MODEL, "messages": QUESTION, "chat_template": MARKED}
    reply = post(trusted, "/tokenize", body)
    assert reply.status == 200, reply.body
    assert reply.json()["tokens"] == ids(hf_tokenizer, "<<MARK>>[user:Hi]>>")
    kwargs = {"chat_template": MARKED, "greeting": "x"}
    body = {"messages": QUESTION, "add_generation_prompt": False, "chat_template_kwargs": kwargs}
    assert post(trusted, "/tokenize", body).json()["tokens"] == ids(
        hf_tokenizer, "<<MARK>>[user:Hi]x"
    )


@pytest.mark.parametrize(
    "extra",
    [{"chat_template": MARKED}, {"chat_template_kwargs": {"chat_template": MARKED}}],
)
def test_without_the_flag_a_request_template_is_vllms_400(untrusted, extra):
    with pytest.raises(openai.BadRequestError) as raised:
        chat(untrusted, **extra)
    assert raised.value.status_code == 400
    assert raised.value.body["message"] == UNTRUSTED
    reply = post(untrusted, "/tokenize", {"messages": QUESTION, **extra})
    assert reply.status == 400
    assert reply.json()["error"]["message"] == UNTRUSTED


def test_without_the_flag_a_null_template_is_let_through(untrusted):
    reply = chat(untrusted, chat_template=None, chat_template_kwargs={"chat_template": None})
    assert reply.model_extra["prompt_text"]


def test_completions_ignore_a_chat_template_as_vllm(untrusted):
    # vLLM's CompletionRequest has no chat_template: an unknown field, ignored.
    reply = client(untrusted).completions.create(
        model=MODEL, prompt="Hi", max_tokens=1, extra_body={"chat_template": MARKED}
    )
    assert len(reply.choices) == 1


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{{ raise_exception('no such role') }}", "no such role"),
        ("{% for m in messages %}", "Unexpected end of template."),
        ("{{ messages[0].content.nope.deeper }}", "'str object' has no attribute 'nope'"),
        ("{{ 1 // 0 }}", "integer division or modulo by zero"),
    ],
)
def test_a_template_that_fails_is_a_400_with_its_reason(trusted, template, message):
    with pytest.raises(openai.BadRequestError) as raised:
        chat(trusted, chat_template=template)
    assert raised.value.status_code == 400
    assert message in raised.value.body["message"]
    reply = post(trusted, "/tokenize", {"messages": QUESTION, "chat_template": template})
    assert reply.status == 400 and message in reply.json()["error"]["message"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"chat_template": 1}, "chat_template"),
        ({"chat_template": ["{{ 1 }}"]}, "chat_template"),
        ({"chat_template_kwargs": {"chat_template": 2}}, "chat_template_kwargs"),
    ],
)
def test_a_template_that_is_not_a_string_is_a_400_naming_it(trusted, untrusted, extra, param):
    for url in (trusted, untrusted):
        with pytest.raises(openai.BadRequestError) as raised:
            chat(url, **extra)
        assert raised.value.body["param"] == param
