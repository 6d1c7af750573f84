"""vLLM 0.32's Frontend flags for logs and the tokenizer, over real HTTP:
--enable-log-outputs / --enable-log-deltas, --log-error-stack and
--enable-tokenizer-info-endpoint.

Each server is the app `aioserve serve <flags>` builds (serve_built) on the session's
engine. The log lines are checked against the answers the official openai client got
(the same text, the same token ids), /tokenizer_info against the tokenizer transformers
loads from the same GGUF on its own.
"""

from __future__ import annotations

import ast
import asyncio
import json
import logging
import re

import aiohttp
import pytest

from tests.server.conftest import MODEL, serve_built
from tests.server.openai_helpers import TIMEOUT, client, post

MESSAGES = [{"role": "user", "content": "Name a colour."}]
LOG_ARGS = ("--enable-log-requests", "--enable-log-outputs")
_LINE = re.compile(r"Generated response (\S+)( \(streaming (?:delta|complete)\))?: output: (.*)")


def _get(url: str) -> tuple[int, bytes]:
    async def go() -> tuple[int, bytes]:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            async with session.get(url) as response:
                return response.status, await response.read()

    return asyncio.run(go())


def _generated(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str, str, str]]:
    """(request id, stream marker, output repr, finish reason) of each INFO output line."""
    lines = []
    for record in caplog.records:
        message = record.getMessage()
        if record.levelno == logging.INFO and (match := _LINE.match(message)):
            output, _, reason = match.group(3).rpartition(", finish_reason: ")
            lines.append((match.group(1), match.group(2) or "", output, reason))
    return lines


# --- GET /tokenizer_info ---------------------------------------------------------------------


def test_tokenizer_info_is_off_by_default(server_loop, engine):
    with serve_built(server_loop, engine) as url:
        status, body = _get(url + "/tokenizer_info")
    assert status == 404 and json.loads(body)["error"]["code"] == 404


def test_tokenizer_info_matches_the_tokenizer(server_loop, engine, hf_tokenizer):
    with serve_built(server_loop, engine, "--enable-tokenizer-info-endpoint") as url:
        status, body = _get(url + "/tokenizer_info")
        openapi = json.loads(_get(url + "/openapi.json")[1])
    assert status == 200
    info = json.loads(body)
    assert info["tokenizer_class"] == type(hf_tokenizer).__name__
    assert "vocab_file" not in info and "merges_file" not in info
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert info[name] == str(getattr(hf_tokenizer, name)), name
    assert info["model_max_length"] == hf_tokenizer.model_max_length  # past 64 bits
    assert info["chat_template"] == hf_tokenizer.chat_template
    decoder = {str(i): token.content for i, token in hf_tokenizer.added_tokens_decoder.items()}
    assert info["added_tokens_decoder"] == decoder
    assert "get" in openapi["paths"]["/tokenizer_info"]


def test_tokenizer_info_shows_the_configured_chat_template(server_loop, engine, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    argv = ("--enable-tokenizer-info-endpoint", "--chat-template", str(template))
    with serve_built(server_loop, engine, *argv) as url:
        info = json.loads(_get(url + "/tokenizer_info")[1])
    assert info["chat_template"] == template.read_text()
    assert info["tokenizer_class"] and info["eos_token"] == "<|im_end|>"


# --- --enable-log-outputs --------------------------------------------------------------------


def test_whole_chat_answers_are_logged_per_choice(server_loop, engine, caplog):
    caplog.set_level(logging.DEBUG, logger="aioserve.server")
    with serve_built(server_loop, engine, *LOG_ARGS) as url:
        chat = client(url).chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=4,
            n=2,
            temperature=1,
            seed=5,
            extra_body={"return_token_ids": True},
        )
        completion = client(url).completions.create(model=MODEL, prompt="Hi", max_tokens=3)
    lines = _generated(caplog)
    expected = [
        (chat.id, "", repr(choice.message.content), choice.finish_reason)
        for choice in sorted(chat.choices, key=lambda c: c.index)
    ]
    assert lines == expected
    assert not [line for line in lines if line[0] == completion.id]  # vLLM 0.32: no log
    details = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    for choice in chat.choices:
        ids = choice.model_dump()["token_ids"]
        assert f"Generated response {chat.id} details: output_token_ids: {ids}" in details


def test_streamed_chat_logs_deltas_then_the_whole_text(server_loop, engine, caplog):
    caplog.set_level(logging.INFO, logger="aioserve.server")
    with serve_built(server_loop, engine, *LOG_ARGS) as url:
        chunks = list(
            client(url).chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, stream=True
            )
        )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    lines = _generated(caplog)
    deltas = [line for line in lines if line[1] == " (streaming delta)"]
    assert [ast.literal_eval(output) for _, _, output, _ in deltas] == [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert deltas[-1][3] == "length" and {reason for *_, reason in deltas[:-1]} <= {"None"}
    assert lines[-1] == (chunks[0].id, " (streaming complete)", repr(text), "streaming_complete")


def test_no_enable_log_deltas_keeps_only_the_whole_text(server_loop, engine, caplog):
    caplog.set_level(logging.INFO, logger="aioserve.server")
    argv = (*LOG_ARGS, "--no-enable-log-deltas", "--max-log-len", "3")
    with serve_built(server_loop, engine, *argv) as url:
        chunks = list(
            client(url).chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, stream=True
            )
        )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text) > 3
    # Cut to --max-log-len.
    assert _generated(caplog) == [
        (chunks[0].id, " (streaming complete)", repr(text[:3]), "streaming_complete")
    ]


def test_responses_are_logged_whole(server_loop, engine, caplog):
    caplog.set_level(logging.INFO, logger="aioserve.server")
    with serve_built(server_loop, engine, *LOG_ARGS) as url:
        response = client(url).responses.create(model=MODEL, input="Hi", max_output_tokens=4)
        streamed = post(
            url, "/v1/responses", {"input": "Hi", "max_output_tokens": 3, "stream": True}
        )
    assert streamed.status == 200
    lines = _generated(caplog)
    assert lines[0] == (response.id, "", repr(response.output_text), "length")
    assert lines[1][1:] == (" (streaming complete)", lines[1][2], "length")
    assert len(lines) == 2


def test_outputs_are_not_logged_without_the_flag_or_with_requests_unlogged(
    server_loop, engine, caplog
):
    caplog.set_level(logging.INFO, logger="aioserve.server")
    for argv in (("--enable-log-requests",), (*LOG_ARGS, "--disable-log-requests")):
        with serve_built(server_loop, engine, *argv) as url:
            client(url).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert _generated(caplog) == []


# --- --log-error-stack -----------------------------------------------------------------------


def _error_logs(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if " caught. Request id: " in r.getMessage()]


def test_error_responses_are_logged_with_their_stack(server_loop, engine, caplog):
    caplog.set_level(logging.INFO, logger="aioserve.server")
    with serve_built(server_loop, engine, "--log-error-stack") as url:
        bad = post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1})
        missing = _get(url + "/v1/nothing")[0]
    assert bad.status == 400 and missing == 404
    first, second = _error_logs(caplog)
    assert first.levelno == logging.ERROR and first.getMessage().startswith("APIError caught")
    assert "answered 400" in first.getMessage() and first.exc_info[2] is not None  # the stack
    assert "HTTPNotFound" in second.getMessage() and "answered 404" in second.getMessage()


def test_error_stacks_follow_vllm_server_dev_mode_unless_set(
    server_loop, engine, caplog, monkeypatch
):
    caplog.set_level(logging.INFO, logger="aioserve.server")
    body = {"model": MODEL, "prompt": "x", "max_tokens": -1}
    with serve_built(server_loop, engine) as url:
        assert post(url, "/v1/completions", body).status == 400
    assert _error_logs(caplog) == []
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    with serve_built(server_loop, engine, "--no-log-error-stack") as url:
        post(url, "/v1/completions", body)
    assert _error_logs(caplog) == []
    with serve_built(server_loop, engine) as url:
        post(url, "/v1/completions", body)
    assert len(_error_logs(caplog)) == 1
