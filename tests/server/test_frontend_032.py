"""vLLM 0.32's Frontend flags for usage, fingerprints and timings, over real HTTP:
--enable-force-include-usage, --fingerprint-mode / --fingerprint-value,
and --enable-per-request-metrics (--tokens-only: test_scale_out.py).

Each server is the app `aioserve serve <flags>` builds (serve_built) on the session's
engine; the answers are read with the official openai client, and raw where the client
would hide a key. The reference for usage is the prompt's tokens counted by transformers
and the tokens the stream delivered; for timings, the client's own clock.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time

import pytest

from aioserve import __version__
from aioserve.config.declaration import ConfigError
from aioserve.config.frontend import frontend_config_from_args
from aioserve.config.parser import build_engine_parser
from aioserve.server.fingerprint import settings_hash
from tests.server.conftest import MODEL, serve_built
from tests.server.openai_helpers import client, post, sse_events

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name a colour."}]
METRIC_KEYS = [
    "time_to_first_token_ms",
    "generation_time_ms",
    "queue_time_ms",
    "mean_itl_ms",
    "tokens_per_second",
    "speculative_decoding",
]


def _options(*argv: str):
    return frontend_config_from_args(build_engine_parser("aioserve serve").parse_args(argv))


def _stream(url: str, path: str, body: dict) -> list[dict]:
    reply = post(url, path, {**body, "stream": True})
    assert reply.status == 200, reply.body
    return sse_events(reply.body)


# --- --enable-force-include-usage -----------------------------------------------------------


def test_forced_usage_reaches_every_chunk_of_both_routes(server_loop, engine, hf_tokenizer):
    prompt_tokens = len(hf_tokenizer(PROMPT)["input_ids"])
    with serve_built(server_loop, engine, "--enable-force-include-usage") as url:
        openai = client(url)
        # The request asks for no usage; the server gives it in every chunk and at the end.
        chunks = list(
            openai.completions.create(
                model=MODEL,
                prompt=PROMPT,
                max_tokens=5,
                temperature=0,
                stream=True,
                extra_body={"return_token_ids": True},
            )
        )
        chat_chunks = list(
            openai.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                max_tokens=5,
                temperature=0,
                stream=True,
                stream_options={"include_usage": False},
            )
        )
    *text_chunks, last = chunks
    assert text_chunks and last.choices == []
    assert all(c.usage is not None and c.usage.prompt_tokens == prompt_tokens for c in chunks)
    # Continuous usage: each chunk counts the tokens streamed so far.
    streamed = 0
    for chunk in text_chunks:
        streamed += len(chunk.choices[0].model_dump()["token_ids"])
        assert chunk.usage.completion_tokens == streamed
    assert last.usage.completion_tokens == 5 and last.usage.total_tokens == prompt_tokens + 5
    *chat_text, chat_last = chat_chunks
    assert chat_last.choices == [] and chat_last.usage.completion_tokens == 5
    assert chat_text[0].choices[0].delta.role == "assistant"
    assert chat_text[0].usage.completion_tokens == 0  # the role chunk, as vLLM's
    assert all(c.usage is not None for c in chat_chunks)


def test_without_the_flag_a_stream_has_no_usage(server_loop, engine):
    with serve_built(server_loop, engine) as url:
        chunks = list(
            client(url).completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, stream=True
            )
        )
    assert chunks and all(c.usage is None for c in chunks)


# --- --fingerprint-mode / --fingerprint-value ------------------------------------------------


def test_full_and_hash_fingerprints_name_version_and_settings(server_loop, engine):
    expected = f"aioserve-{__version__}-{settings_hash(engine.settings)}"
    assert re.fullmatch(rf"aioserve-{re.escape(__version__)}-[0-9a-f]{{8}}", expected)
    with serve_built(server_loop, engine) as url:  # full, the default
        openai = client(url)
        completion = openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
        chat = openai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
        events = _stream(url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
    assert completion.system_fingerprint == chat.system_fingerprint == expected
    # In a stream without usage, the finishing chunk carries it, and only that one.
    stamped = [e for e in events if "system_fingerprint" in e]
    assert [e["choices"][0]["finish_reason"] for e in stamped] == ["length"]
    assert stamped[0]["system_fingerprint"] == expected
    # hash: the same, as aioserve has no parallelism for full to add.
    with serve_built(server_loop, engine, "--fingerprint-mode", "hash") as url:
        chat = client(url).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert chat.system_fingerprint == expected


def test_settings_hash_is_stable_and_changes_with_what_shapes_outputs(engine):
    settings = engine.settings
    assert settings_hash(settings) == settings_hash(dataclasses.replace(settings))
    for change in ({"max_model_len": 1024}, {"block_size": 32}, {"model_name": "other"}):
        assert settings_hash(dataclasses.replace(settings, **change)) != settings_hash(settings)
    # Not what the outputs do not depend on: the served names.
    renamed = dataclasses.replace(settings, served_model_names=["x"])
    assert settings_hash(renamed) == settings_hash(settings)


def test_custom_fingerprint_everywhere_and_on_each_finishing_chunk(server_loop, engine):
    argv = ("--fingerprint-mode", "custom", "--fingerprint-value", "fp-7")
    with serve_built(server_loop, engine, *argv) as url:
        openai = client(url)
        completion = openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        chat = openai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        body = {"prompt": PROMPT, "max_tokens": 2, "n": 2, "temperature": 1, "seed": 3}
        events = _stream(url, "/v1/completions", body)
        usage_events = _stream(
            url,
            "/v1/completions",
            {"prompt": PROMPT, "max_tokens": 2, "stream_options": {"include_usage": True}},
        )
    assert completion.system_fingerprint == chat.system_fingerprint == "fp-7"
    # vLLM stamps each choice's finishing chunk (n = 2: two of them) ...
    stamped = [e for e in events if "system_fingerprint" in e]
    assert sorted(e["choices"][0]["index"] for e in stamped) == [0, 1]
    assert all(e["choices"][0]["finish_reason"] == "length" for e in stamped)
    # ... or, when a usage chunk follows, that one only.
    assert [e["choices"] for e in usage_events if "system_fingerprint" in e] == [[]]
    assert usage_events[-1]["system_fingerprint"] == "fp-7"


def test_fingerprint_none_is_null_and_absent_from_streams(server_loop, engine):
    with serve_built(server_loop, engine, "--fingerprint-mode", "none") as url:
        whole = post(url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
        events = _stream(
            url,
            "/v1/chat/completions",
            {"messages": MESSAGES, "max_tokens": 2, "stream_options": {"include_usage": True}},
        )
    assert "system_fingerprint" in whole.json() and whole.json()["system_fingerprint"] is None
    assert not [e for e in events if "system_fingerprint" in e]
    assert events[-1]["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--fingerprint-mode", "custom"],
            "--fingerprint-mode custom requires --fingerprint-value",
        ),
        (["--fingerprint-value", "x"], "--fingerprint-value is used only with --fingerprint-mode"),
        (["--fingerprint-mode", "sha"], "--fingerprint-mode must be one of full, hash, custom"),
        (
            ["--enable-per-request-metrics", "--disable-log-stats"],
            "--enable-per-request-metrics requires engine statistics logging",
        ),
        (["--enable-log-outputs"], "--enable-log-outputs requires --enable-log-requests"),
    ],
)
def test_refused_combinations_name_the_flag(argv, message):
    with pytest.raises(ConfigError) as error:
        _options(*argv)
    assert str(error.value).startswith(message)


# --- --enable-per-request-metrics ------------------------------------------------------------


def _check_timings(metrics: dict, completion_tokens: int, elapsed_ms: float) -> None:
    """The timings agree with each other (vLLM's definitions) and with the client's clock."""
    assert list(metrics) == METRIC_KEYS
    assert metrics["speculative_decoding"] is None
    ttft, generation = metrics["time_to_first_token_ms"], metrics["generation_time_ms"]
    queue = metrics["queue_time_ms"]
    assert ttft > 0 and generation > 0 and queue >= 0
    assert queue + ttft + generation <= elapsed_ms
    assert metrics["mean_itl_ms"] == pytest.approx(generation / (completion_tokens - 1))
    # tokens per second: every token over the time from scheduling to the last token.
    per_second = completion_tokens / ((ttft + generation) / 1000)
    assert metrics["tokens_per_second"] == pytest.approx(per_second, rel=1e-6)


def test_metrics_in_whole_answers_of_one_sequence(server_loop, engine):
    with serve_built(server_loop, engine, "--enable-per-request-metrics") as url:
        openai = client(url)
        started = time.monotonic()
        chat = openai.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0
        )
        elapsed_ms = (time.monotonic() - started) * 1000
        _check_timings(chat.model_dump()["metrics"], chat.usage.completion_tokens, elapsed_ms)
        started = time.monotonic()
        completion = openai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6)
        elapsed_ms = (time.monotonic() - started) * 1000
        metrics = completion.model_dump()["metrics"]
        _check_timings(metrics, completion.usage.completion_tokens, elapsed_ms)
        # Not one sequence's: n = 2, or two prompts (vLLM leaves them out).
        two = openai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, n=2)
        prompts = openai.completions.create(model=MODEL, prompt=[PROMPT, "Hi"], max_tokens=2)
        response = post(url, "/v1/responses", {"input": "Hi", "max_output_tokens": 4})
    assert two.model_dump()["metrics"] is None and prompts.model_dump()["metrics"] is None
    body = response.json()
    assert list(body).index("metrics") == list(body).index("user") + 1  # vLLM's key order
    assert body["metrics"]["time_to_first_token_ms"] > 0
    assert body["metrics"]["tokens_per_second"] > 0


def test_stream_metrics_ride_on_the_usage_chunk(server_loop, engine):
    with serve_built(server_loop, engine, "--enable-per-request-metrics") as url:
        with_usage = _stream(
            url,
            "/v1/chat/completions",
            {"messages": MESSAGES, "max_tokens": 4, "stream_options": {"include_usage": True}},
        )
        without = _stream(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
        responses = post(
            url, "/v1/responses", {"input": "Hi", "max_output_tokens": 3, "stream": True}
        )
    assert [e for e in with_usage if "metrics" in e] == [with_usage[-1]]
    metrics = with_usage[-1]["metrics"]
    # vLLM writes the chunk without its null fields.
    assert list(metrics) == METRIC_KEYS[:5] and metrics["generation_time_ms"] > 0
    assert not [e for e in without if "metrics" in e]
    completed = [e for e in sse_events_named(responses.body) if e["type"] == "response.completed"]
    assert completed[0]["response"]["metrics"]["queue_time_ms"] >= 0


def sse_events_named(raw: bytes) -> list[dict]:
    """The JSON payloads of a stream of named events (event: x / data: {...})."""
    return [
        json.loads(line[len(b"data: ") :])
        for line in raw.split(b"\n")
        if line.startswith(b"data: {")
    ]


def test_without_the_flag_metrics_stay_null(server_loop, engine):
    with serve_built(server_loop, engine) as url:
        chat = post(url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
        response = post(url, "/v1/responses", {"input": "Hi", "max_output_tokens": 2})
    assert chat.json()["metrics"] is None
    assert "metrics" not in response.json()  # vLLM leaves the key out of a response
