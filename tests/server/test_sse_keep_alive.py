"""--sse-keep-alive-interval: SSE comments while a completions or chat stream waits.

The reference is vLLM 0.32's with_sse_keep_alive (entrypoints/serve/utils/sse_keep_alive.py):
the comment `: keep-alive` and a blank line each time `interval` seconds pass without a
chunk; applied by the completions and chat routes (so /invocations, which calls them, too)
and no other; 0 (the default) sends none; a negative value is refused at start.

`stream_events` itself is tested on a stub app with events at set times (intervals of
tenths of a second); the routes over real HTTP on the default model, a model step made
slow by a wrapper around the runner's `execute` (it runs on the model thread, so the
event loop is free to send the comments, as it is when a real prefill is slow). The
official `openai` client reads those streams through the comments.

Model steps take what they take on a busy host, so the route tests check what holds
whatever they take: the comments are there during the slow step, the stream is never
silent for much longer than the interval, and the chunks are the same as without them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator

import aiohttp
import openai
from aiohttp import web

from aioserve.server.errors import APIError, error_middleware
from aioserve.server.sse import KEEP_ALIVE, stream_events
from tests.server.conftest import MODEL, serve_app, serve_built, wait_until_idle

TIMEOUT = aiohttp.ClientTimeout(total=120)
COMMENT = b": keep-alive"
SLACK_S = 0.75
"""How late a comment may come after its interval on a busy host."""


def test_the_comment_is_vllms_bytes():
    assert KEEP_ALIVE == b": keep-alive\n\n"  # vLLM's SSE_KEEP_ALIVE_COMMENT


# --- stream_events on a stub app ------------------------------------------------------------


class Script:
    """Events after set delays; records how the generator ended."""

    def __init__(self, *steps: tuple[float, dict | Exception]) -> None:
        self.steps = steps
        self.closed = asyncio.Event()
        self.cancelled = False

    async def events(self) -> AsyncIterator[dict]:
        try:
            for delay, item in self.steps:
                await asyncio.sleep(delay)
                if isinstance(item, Exception):
                    raise item
                yield item
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        finally:
            self.closed.set()


def stub_app(script: Script, keep_alive: float) -> web.Application:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await stream_events(request, script.events(), keep_alive=keep_alive)

    app = web.Application(middlewares=[error_middleware])
    app.router.add_get("/stream", handler)
    return app


async def read_lines(url: str) -> tuple[int, list[tuple[float, bytes]]]:
    """The status and each non-blank line of the answer, with when it came (s after the
    request was sent)."""
    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        async with session.get(url) as response:
            lines = [
                (time.monotonic() - started, line.rstrip(b"\n"))
                async for line in response.content
                if line.strip()
            ]
            return response.status, lines


def run_stub(server_loop, script: Script, keep_alive: float) -> tuple[int, list[bytes]]:
    with serve_app(server_loop, stub_app(script, keep_alive)) as url:
        status, lines = asyncio.run(read_lines(url + "/stream"))
    return status, [line for _, line in lines]


def test_comments_fill_the_wait_for_the_first_event_and_between_events(server_loop):
    script = Script((1.0, {"n": 1}), (1.0, {"n": 2}), (0.05, {"n": 3}))
    status, lines = run_stub(server_loop, script, keep_alive=0.4)  # comments at 0.4 and 0.8
    assert status == 200
    comment = KEEP_ALIVE.strip()
    assert lines == [comment, comment, b'data: {"n":1}', comment, comment]  + [
        b'data: {"n":2}', b'data: {"n":3}', b"data: [DONE]"
    ]  # fmt: skip


def test_no_comments_without_an_interval(server_loop):
    script = Script((0.3, {"n": 1}), (0.3, {"n": 2}))
    assert run_stub(server_loop, script, keep_alive=0) == (
        200,
        [b'data: {"n":1}', b'data: {"n":2}', b"data: [DONE]"],
    )


def test_an_error_before_any_comment_is_a_json_error_and_after_one_an_error_event(server_loop):
    refused = APIError("bad prompt")
    script = Script((0.0, refused))
    with serve_app(server_loop, stub_app(script, keep_alive=0.2)) as url:

        async def get() -> tuple[int, dict]:
            async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
                async with session.get(url + "/stream") as response:
                    return response.status, await response.json()

        status, body = asyncio.run(get())
    assert status == 400 and body["error"]["message"] == "bad prompt"
    # Once a comment has started the response, the error is an event in it (vLLM's stream
    # has started by then too).
    status, lines = run_stub(server_loop, Script((0.3, APIError("late"))), keep_alive=0.2)
    assert status == 200 and lines[0] == KEEP_ALIVE.strip()
    assert json.loads(lines[1].removeprefix(b"data: "))["error"]["message"] == "late"
    assert lines[2:] == [b"data: [DONE]"]


def test_a_client_gone_during_a_wait_cancels_and_closes_the_events(server_loop, caplog):
    caplog.set_level(logging.ERROR)
    script = Script((0.0, {"n": 1}), (30.0, {"n": 2}))
    with serve_app(server_loop, stub_app(script, keep_alive=0.1)) as url:

        async def leave_after_two_comments() -> list[bytes]:
            seen = []
            async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
                async with session.get(url + "/stream") as response:
                    async for line in response.content:
                        if line.strip():
                            seen.append(line.strip())
                        if seen.count(KEEP_ALIVE.strip()) == 2:
                            break
            return seen

        seen = asyncio.run(leave_after_two_comments())
        assert seen[0] == b'data: {"n":1}'
        server_loop.run(asyncio.wait_for(script.closed.wait(), 10))
    assert script.cancelled  # the pending step was cancelled, then the generator closed
    # Closed once its step had ended: nothing went wrong on the way.
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


# --- the routes, over HTTP -------------------------------------------------------------------


def slow_model_step(monkeypatch, engine, on_call: int, seconds: float) -> None:
    """Make the engine's `on_call`-th model step from now take `seconds` longer."""
    execute = engine.runner.execute
    calls = 0

    def slow(step):
        nonlocal calls
        calls += 1
        if calls == on_call:
            time.sleep(seconds)
        return execute(step)

    monkeypatch.setattr(engine.runner, "execute", slow)


async def post_lines(url: str, body: dict) -> list[tuple[float, bytes]]:
    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        async with session.post(url, json=body) as response:
            assert response.status == 200, await response.text()
            return [
                (time.monotonic() - started, line.rstrip(b"\n"))
                async for line in response.content
                if line.strip()
            ]


def chat_body(**more) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
    } | more


def data_lines(lines: list[tuple[float, bytes]]) -> list[bytes]:
    return [line for _, line in lines if not line.startswith(b":")]


def test_a_slow_first_token_gets_comments_each_interval_and_the_same_chunks(
    server_loop, engine, monkeypatch
):
    with serve_built(server_loop, engine, "--sse-keep-alive-interval", "1") as url:
        plain = asyncio.run(post_lines(url + "/v1/chat/completions", chat_body()))
        slow_model_step(monkeypatch, engine, on_call=1, seconds=2.6)  # the prefill
        lines = asyncio.run(post_lines(url + "/v1/chat/completions", chat_body()))
    comments = [at for at, line in lines if line == COMMENT]
    first_data = next(at for at, line in lines if line.startswith(b"data:"))
    assert first_data > 2.6
    assert len([at for at in comments if at < first_data]) >= 2
    assert comments[0] > 0.95  # not before the interval
    assert_never_silent(lines, interval=1.0)
    assert {line for _, line in lines if line.startswith(b":")} == {COMMENT}
    # Nothing but the comments changed: the same chunks (ids and times aside).
    assert _contents(data_lines(lines)) == _contents(data_lines(plain))
    wait_until_idle(engine, server_loop)


def assert_never_silent(lines: list[tuple[float, bytes]], interval: float) -> None:
    """No stretch without a line, from the request to the end, much over `interval`."""
    times = [0.0] + [at for at, _ in lines]
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    assert max(gaps) < interval + SLACK_S, gaps


def _contents(lines: list[bytes]) -> list:
    chunks = [json.loads(line.removeprefix(b"data: ")) for line in lines[:-1]]
    assert lines[-1] == b"data: [DONE]"
    return [
        [(c.get("delta") or {}).get("content", c.get("text")) for c in chunk["choices"]]
        for chunk in chunks
    ]


def test_a_pause_between_tokens_of_a_completion_gets_comments_too(server_loop, engine, monkeypatch):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}
    body |= {"stream": True}
    with serve_built(server_loop, engine, "--sse-keep-alive-interval", "1") as url:
        plain = asyncio.run(post_lines(url + "/v1/completions", body))
        slow_model_step(monkeypatch, engine, on_call=3, seconds=2.2)  # after two tokens
        lines = asyncio.run(post_lines(url + "/v1/completions", body))
    kinds = [b":" if line.startswith(b":") else b"d" for _, line in lines]
    # Comments after the first token and before the last.
    assert b":" in kinds[kinds.index(b"d") : len(kinds) - 2], kinds
    assert_never_silent(lines, interval=1.0)
    assert _contents(data_lines(lines)) == _contents(data_lines(plain))
    wait_until_idle(engine, server_loop)


def test_the_official_client_reads_a_stream_with_comments(server_loop, engine, monkeypatch):
    with serve_built(server_loop, engine, "--sse-keep-alive-interval", "1") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        request = chat_body()
        del request["stream"]
        whole = client.chat.completions.create(**request)
        slow_model_step(monkeypatch, engine, on_call=1, seconds=2.3)
        started = time.monotonic()
        stream = client.chat.completions.create(
            **request, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        assert time.monotonic() - started > 2.3
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        slow_model_step(monkeypatch, engine, on_call=1, seconds=2.3)
        completion = client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0, stream=True
        )
        assert (
            "".join(c.choices[0].text for c in completion)
            == client.completions.create(
                model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0
            )
            .choices[0]
            .text
        )
    wait_until_idle(engine, server_loop)


def test_invocations_streams_get_them_and_the_other_streams_do_not(
    server_loop, engine, monkeypatch
):
    """vLLM applies keep-alive in its completions and chat routes, which /invocations calls;
    the Responses and Anthropic Messages streams have none."""
    with serve_built(server_loop, engine, "--sse-keep-alive-interval", "1") as url:
        slow_model_step(monkeypatch, engine, on_call=1, seconds=1.6)
        lines = asyncio.run(post_lines(url + "/invocations", chat_body()))
        assert [line for _, line in lines].count(COMMENT) >= 1
        others = [
            ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 4}),
            ("/v1/messages", {"model": MODEL, "max_tokens": 4,
                              "messages": [{"role": "user", "content": "Hi"}]}),
        ]  # fmt: skip
        for path, body in others:
            slow_model_step(monkeypatch, engine, on_call=1, seconds=1.6)
            lines = asyncio.run(post_lines(url + path, body | {"stream": True}))
            assert lines and COMMENT not in [line for _, line in lines], path
    wait_until_idle(engine, server_loop)


def test_without_the_flag_a_slow_step_sends_no_comment(server_loop, engine, monkeypatch):
    with serve_built(server_loop, engine) as url:
        slow_model_step(monkeypatch, engine, on_call=1, seconds=1.6)
        lines = asyncio.run(post_lines(url + "/v1/chat/completions", chat_body()))
    assert lines[0][0] > 1.5 and not [line for _, line in lines if line.startswith(b":")]
    wait_until_idle(engine, server_loop)
