"""`bad_words` over real HTTP: the banned words leave the greedy output that had them, on
both routes (the bans themselves are checked against transformers in
tests/engine/test_bad_words.py), and lists vLLM refuses are 400s naming the field."""

from __future__ import annotations

import pytest

from tests.server.conftest import MODEL
from tests.server.openai_helpers import post

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def text(url: str, route: str, **fields) -> str:
    body = {"model": MODEL, "max_tokens": 12, "temperature": 0, **fields}
    reply = post(url, route, body)
    assert reply.status == 200, reply.body
    choice = reply.json()["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


@pytest.mark.parametrize(
    ("route", "prompt"),
    [("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": MESSAGES})],
)
def test_a_banned_word_leaves_the_output(openai_server, route, prompt):
    free = text(openai_server, route, **prompt)
    assert "Paris" in free
    banned = text(openai_server, route, **prompt, bad_words=["Paris"])
    assert "Paris" not in banned and banned != free


@pytest.mark.parametrize(
    ("bad_words", "message"),
    [(["Paris", ""], "bad_words cannot contain an empty string"), ("Paris", "must be an array")],
)
def test_lists_vllm_refuses_are_400s_naming_the_field(openai_server, bad_words, message):
    body = {"model": MODEL, "prompt": PROMPT, "bad_words": bad_words}
    reply = post(openai_server, "/v1/completions", body)
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert error["param"] == "bad_words" and message in error["message"]
