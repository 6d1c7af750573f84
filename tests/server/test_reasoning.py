"""The reasoning parsers' split of recorded answers, whole and fed at every cut: every
split of an answer into two pieces and into single characters gives the same reasoning
and content as the whole, and no `<think>`/`</think>` leaks into either field. Then
through the server: the fields a chat answer's text goes to, streamed and not."""

from __future__ import annotations

import dataclasses

import pytest

from aioserve.server.reasoning import (
    THINK_END,
    THINK_START,
    ReasoningSplitter,
    count_reasoning_tokens,
    reasoning_closed,
    split_whole,
)
from tests.server.conftest import MODEL
from tests.server.openai_helpers import client, post, sse_events

# (answer as the model wrote it, reasoning, content), for deepseek_r1 and thinking qwen3
# (qwen3 gives an empty reasoning as null when not streamed: vLLM's parser/qwen3.py).
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
    # A <think> inside the reasoning is dropped (vLLM's streaming skips the token; its qwen3
    # grammar absorbs it), and a whole one cut by max_tokens never shows.
    ("Hi there <think>thought</think>answer", "Hi there thought", "answer"),
    ("<think>a<think>b</think>c", "ab", "c"),
    ("<think>", "", None),
    (" <think>", "", None),
]  # fmt: skip


def split_answer(
    parser: str, text: str, kwargs: dict | None = None, prompt_closed: bool = False
) -> tuple[str | None, str | None]:
    return split_whole(ReasoningSplitter(parser, kwargs, prompt_closed), text)


def streamed(parser: str, pieces: list[str], kwargs: dict | None = None) -> tuple[str, str]:
    splitter = ReasoningSplitter(parser, kwargs)
    ends = [i == len(pieces) - 1 for i in range(len(pieces))]
    splits = [splitter.feed(piece, last) for piece, last in zip(pieces, ends, strict=True)]
    return "".join(s.reasoning for s in splits), "".join(s.content for s in splits)


def every_cut(answer: str) -> list[list[str]]:
    return [[answer[:i], answer[i:]] for i in range(len(answer) + 1)] + [list(answer)]


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize(("answer", "reasoning", "content"), ANSWERS)
def test_every_cut_gives_the_whole_answers_split(parser, answer, reasoning, content):
    whole_reasoning = None if parser == "qwen3" and not reasoning else reasoning
    assert split_answer(parser, answer) == (whole_reasoning, content)
    for pieces in every_cut(answer):
        assert streamed(parser, pieces) == (reasoning, content or ""), pieces


@pytest.mark.parametrize(("answer", "reasoning", "content"), ANSWERS[:5] + ANSWERS[9:])
def test_markers_never_leak(answer, reasoning, content):
    for field in (reasoning, content or ""):
        assert THINK_START not in field and THINK_END not in field


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_a_tool_call_ends_qwen3s_reasoning():
    """vLLM's qwen3 grammar ends the reasoning at <tool_call> (parser/qwen3.py); the call
    goes on to the tool parser. deepseek_r1 has no such rule: it stays reasoning."""
    answer = "let me call\n" + CALL
    assert split_answer("qwen3", answer) == ("let me call\n", CALL)
    for pieces in every_cut(answer):
        assert streamed("qwen3", pieces) == ("let me call\n", CALL), pieces
    assert split_answer("deepseek_r1", answer) == (answer, None)
    assert split_answer("qwen3", "<think>plan</think>\n\n" + CALL) == ("plan", "\n\n" + CALL)


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_an_answer_to_a_prompt_that_closed_the_reasoning_is_all_content(parser):
    answer = "Blue.</think> still content"
    assert split_answer(parser, answer, prompt_closed=True) == (None, answer)
    for pieces in every_cut(answer):
        splitter = ReasoningSplitter(parser, prompt_closed=True)
        splits = [splitter.feed(piece) for piece in pieces]
        assert "".join(s.content for s in splits) == answer
        assert not any(s.reasoning for s in splits)


def chars(ids: list[int]) -> str:
    return "".join(map(chr, ids))


@pytest.mark.parametrize(
    ("parser", "answer", "count"),
    [
        ("deepseek_r1", "ab</think>cd", len("ab</think>")),  # one character a token
        ("deepseek_r1", "<think>ab</think>", len("<think>ab</think>")),
        ("deepseek_r1", "never closed", len("never closed")),
        ("qwen3", "x" + CALL, 1),  # the call is content
        ("qwen3", "", 0),
    ],
)
def test_the_reasoning_tokens_are_those_up_to_its_end(parser, answer, count):
    splitter = ReasoningSplitter(parser)
    splitter.feed(answer, last=True)
    ids = [ord(c) for c in answer]
    assert count_reasoning_tokens(splitter, ids, chars) == count
    closed = ReasoningSplitter(parser, prompt_closed=True)
    closed.feed(answer, last=True)
    assert count_reasoning_tokens(closed, ids, chars) == 0


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


BASE = {"messages": QUESTION, "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def answer(url: str, **fields) -> dict:
    reply = post(url, "/v1/chat/completions", BASE | fields)
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
    for parser in ("deepseek_r1", "qwen3"):
        assert not reasoning_closed(parser, "<|im_start|>assistant\n<think>\n")
        assert reasoning_closed(parser, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert not reasoning_closed(parser, "earlier <think>a</think> turn, then <think>\n")
        assert not reasoning_closed(parser, "no markers at all")
    # An earlier turn's closed reasoning: vLLM's qwen3 stops at the turn boundary, its
    # deepseek_r1 scans the whole prompt (basic_parsers.py is_reasoning_end).
    history = "<|im_start|>assistant\n<think>a</think>b<|im_end|>\n<|im_start|>assistant\n"
    assert not reasoning_closed("qwen3", history)
    assert reasoning_closed("deepseek_r1", history)


FORCED = r"Because red\.</think>Red"  # with include_reasoning false, constrained from token 1


def test_hidden_reasoning_hides_its_tokens_too(parsed_by, openai_server):
    """vLLM nulls logprobs and token_ids when a parser hides the reasoning
    (chat_completion/serving.py), and counts the reasoning's tokens in the usage."""
    fields = {
        "structured_outputs": {"regex": FORCED}, "logprobs": True, "return_token_ids": True,
        "max_tokens": 30, "ignore_eos": False,
    }  # fmt: skip
    plain = post(openai_server, "/v1/chat/completions", BASE | fields).json()["choices"][0]
    ids = plain["token_ids"]
    texts = [entry["token"] for entry in plain["logprobs"]["content"]]
    assert "".join(texts) == "Because red.</think>Red<|im_end|>"  # the EOS token's too
    ends = [len("".join(texts[: k + 1])) for k in range(len(texts))]
    reasoning_tokens = next(
        k + 1 for k, end in enumerate(ends) if end >= len("Because red.</think>")
    )
    url = parsed_by("deepseek_r1")
    hidden = fields | {"include_reasoning": False}
    reply = post(url, "/v1/chat/completions", BASE | hidden).json()
    choice = reply["choices"][0]
    assert choice["message"]["content"] == "Red" and choice["message"]["reasoning"] is None
    assert choice["logprobs"] is None and choice["token_ids"] is None
    usage = reply["usage"]
    assert usage["completion_tokens"] == len(ids)
    assert usage["completion_tokens_details"] == {"reasoning_tokens": reasoning_tokens}
    events = sse_events(
        post(url, "/v1/chat/completions", BASE | hidden | {"stream": True,
             "stream_options": {"include_usage": True}}).body
    )  # fmt: skip
    chunks = [event for event in events if event != "[DONE]"]
    deltas = [choice["delta"] for chunk in chunks for choice in chunk["choices"]]
    assert all("reasoning" not in delta for delta in deltas)
    assert all(
        c["logprobs"] is None and c.get("token_ids") is None
        for chunk in chunks
        for c in chunk["choices"]
    )
    assert "".join(delta.get("content") or "" for delta in deltas) == "Red"
    # No chunk for a token of hidden reasoning: the role, the content's, the finish.
    assert len(deltas) <= 2 + (len(ids) - reasoning_tokens)
    assert chunks[-1]["usage"]["completion_tokens_details"] == {
        "reasoning_tokens": reasoning_tokens
    }


def test_reasoning_deltas_carry_no_content_key(parsed_by):
    """vLLM writes only a delta's set fields: a reasoning delta is {"reasoning": ...}."""
    url = parsed_by("deepseek_r1")
    body = BASE | {"stream": True, "stream_options": {"include_usage": True}}
    events = [e for e in sse_events(post(url, "/v1/chat/completions", body).body) if e != "[DONE]"]
    deltas = [choice["delta"] for event in events for choice in event["choices"]]
    reasoning = [delta for delta in deltas if "reasoning" in delta]
    assert reasoning and all("content" not in delta for delta in reasoning)
    assert events[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] == 8


def test_an_answer_after_a_closed_reasoning_in_the_prompt_is_content(parsed_by, openai_server):
    """The history's assistant turn closes a reasoning, so deepseek_r1 (whose prompt check
    scans the whole prompt, as vLLM's) reads the answer as content, streamed and not."""
    history = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "<think>easy</think>Blue."},
        {"role": "user", "content": "Another one."},
    ]
    plain = answer(openai_server, messages=history)["content"]
    url = parsed_by("deepseek_r1")
    message = answer(url, messages=history)
    assert (message["reasoning"], message["content"]) == (None, plain)
    stream = client(url).chat.completions.create(
        model=MODEL, messages=history, max_tokens=8, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = "".join(c.delta.content or "" for chunk in stream for c in chunk.choices)
    assert content == plain


def test_enable_in_reasoning_constrains_from_the_first_token(parsed_by, engine, monkeypatch):
    """--structured-outputs-config '{"enable_in_reasoning": true}': the reasoning is held
    to the constraint too; by default the constraint waits for the end of the thinking."""
    url = parsed_by("deepseek_r1")

    def with_in_reasoning(on: bool) -> None:
        config = dataclasses.replace(engine.settings.structured_outputs, enable_in_reasoning=on)
        settings = dataclasses.replace(engine.settings, structured_outputs=config)
        monkeypatch.setattr(engine, "settings", settings)

    fields = {"structured_outputs": {"regex": "Red"}, "ignore_eos": False}
    with_in_reasoning(True)
    message = answer(url, **fields)
    assert message["reasoning"] == "Red" and message["content"] is None
    with_in_reasoning(False)
    message = answer(url, **fields)
    assert message["reasoning"] != "Red"  # free until a </think> (none in 8 tokens here)
