"""The reasoning parsers' split of recorded answers, whole and fed at every cut: every
split of an answer into two pieces and into single characters gives the same reasoning
and content as the whole, and no `<think>`/`</think>` leaks into either field. Then
through the server: the fields a chat answer's text goes to, streamed and not."""

from __future__ import annotations

import dataclasses

import pytest

from aioserve.server.reasoning import THINK_END, THINK_START, ReasoningSplitter, split_answer
from tests.server.conftest import MODEL
from tests.server.openai_helpers import client, post

# (answer as the model wrote it, reasoning, content), for deepseek_r1 and thinking qwen3.
ANSWERS = [
    ("<think>\nTwo and two make four.\n</think>\n\nThe answer is 4.",
     "\nTwo and two make four.\n", "\n\nThe answer is 4."),
    ("Two and two make four.</think>The answer is 4.", "Two and two make four.",
     "The answer is 4."),
    ("  <think>x < y and y <\\think> z</think>done", "x < y and y <\\think> z", "done"),
    ("<think>still thinking when the tokens ran out", "still thinking when the tokens ran out",
     None),
    ("<think></think>Only an answer.", "", "Only an answer."),
    ("Thinking about </thin", "Thinking about </thin", None),
    ("<thi", "<thi", None),
    ("", "", None),
    ("<think>a</think>b</think>c", "a", "b</think>c"),
]  # fmt: skip


def streamed(parser: str, pieces: list[str], kwargs: dict | None = None) -> tuple[str, str]:
    splitter = ReasoningSplitter(parser, kwargs)
    ends = [i == len(pieces) - 1 for i in range(len(pieces))]
    splits = [splitter.feed(piece, last) for piece, last in zip(pieces, ends, strict=True)]
    return "".join(s.reasoning for s in splits), "".join(s.content for s in splits)


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize(("answer", "reasoning", "content"), ANSWERS)
def test_every_cut_gives_the_whole_answers_split(parser, answer, reasoning, content):
    assert split_answer(parser, answer) == (reasoning, content)
    cuts = [[answer[:i], answer[i:]] for i in range(len(answer) + 1)] + [list(answer)]
    for pieces in cuts:
        assert streamed(parser, pieces) == (reasoning, content or ""), pieces


@pytest.mark.parametrize(("answer", "reasoning", "content"), ANSWERS[:5])
def test_markers_never_leak(answer, reasoning, content):
    for field in (reasoning, content or ""):
        assert THINK_START not in field and THINK_END not in field


def test_qwen3_without_thinking_is_all_content():
    kwargs = {"enable_thinking": False}
    answer = "No thinking here: <b>bold</b>"
    assert split_answer("qwen3", answer, kwargs) == (None, answer)
    assert streamed("qwen3", list(answer), kwargs) == ("", answer)
    # deepseek_r1 always thinks first, whatever the kwargs.
    assert split_answer("deepseek_r1", answer, kwargs) == (answer, None)


# --- through the server, on the default model (which never closes a reasoning) ------------

QUESTION = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture
def parsed_by(openai_server, engine, monkeypatch):
    """Set the engine's --reasoning-parser for one test."""

    def use(parser: str) -> str:
        settings = dataclasses.replace(engine.settings, reasoning_parser=parser)
        monkeypatch.setattr(engine, "settings", settings)
        return openai_server

    return use


def answer(url: str, **fields) -> dict:
    body = {"messages": QUESTION, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    reply = post(url, "/v1/chat/completions", body | fields)
    assert reply.status == 200, reply.body
    return reply.json()["choices"][0]["message"]


def streamed_fields(url: str, **fields) -> tuple[str, str]:
    stream = client(url).chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=8, temperature=0, stream=True,
        extra_body={"ignore_eos": True, **fields},
    )  # fmt: skip
    reasoning = content = ""
    for chunk in stream:
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning") or ""
            content += choice.delta.content or ""
    return reasoning, content


def test_an_unclosed_reasoning_is_all_reasoning_with_deepseek_r1(parsed_by, openai_server):
    plain = answer(openai_server)["content"]
    url = parsed_by("deepseek_r1")
    message = answer(url)
    assert (message["reasoning"], message["content"]) == (plain, None)
    assert streamed_fields(url) == (plain, "")
    dropped = answer(url, include_reasoning=False)
    assert (dropped["reasoning"], dropped["content"]) == (None, None)


def test_qwen3_without_thinking_answers_in_content(parsed_by, openai_server):
    plain = answer(openai_server)["content"]
    url = parsed_by("qwen3")
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    message = answer(url, **kwargs)
    assert (message["reasoning"], message["content"]) == (None, plain)
    assert streamed_fields(url, **kwargs) == ("", plain)
    assert answer(url)["reasoning"] == plain  # thinking, by default


def test_a_prompt_that_closes_its_reasoning_is_seen_as_closed():
    from aioserve.server.reasoning import reasoning_closed

    assert not reasoning_closed("<|im_start|>assistant\n<think>\n")
    assert reasoning_closed("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not reasoning_closed("earlier <think>a</think> turn, then <think>\n")
    assert not reasoning_closed("no markers at all")
