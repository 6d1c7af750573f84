"""--stream-interval over real HTTP: a streamed completion or chat answer sends its first
token at once, then chunks of the interval's tokens (a request's stream_interval raising
the server's), and the chunks join into the non-streamed answer; stream_interval 0 is a 400
naming the field. One SmolLM2 engine (float32, eager, --stream-interval 2) for the module."""

from __future__ import annotations

import pytest

from aioserve.server.state import ServerState
from tests.engine.smollm2 import float32_engine
from tests.server.conftest import MODEL, openai_app, serve_app
from tests.server.openai_helpers import post, sse_events

BODY = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 9, "temperature": 0.0}


@pytest.fixture(scope="module")
def url(smollm2_gguf, server_loop):
    engine = float32_engine(
        smollm2_gguf, max_model_len=256, num_gpu_blocks_override=64, stream_interval=2
    )
    try:
        with serve_app(server_loop, openai_app(ServerState(engine, [MODEL]))) as base:
            yield base
    finally:
        server_loop.run(engine.shutdown())


def _streamed_token_ids(url: str, path: str, body: dict) -> list[list[int]]:
    reply = post(url, path, {**body, "stream": True, "return_token_ids": True, "ignore_eos": True})
    assert reply.status == 200, reply.body
    chunks = [event["choices"][0] for event in sse_events(reply.body) if event != "[DONE]"]
    return [c["token_ids"] for c in chunks if c.get("token_ids")]


@pytest.mark.parametrize(
    ("interval", "sizes"), [(None, [1, 2, 2, 2, 2]), (3, [1, 3, 3, 2]), (1, [1, 2, 2, 2, 2])]
)
def test_a_completion_streams_in_chunks_of_the_interval(url, interval, sizes):
    body = dict(BODY) if interval is None else {**BODY, "stream_interval": interval}
    chunks = _streamed_token_ids(url, "/v1/completions", body)
    assert [len(c) for c in chunks] == sizes
    whole = post(url, "/v1/completions", {**BODY, "return_token_ids": True, "ignore_eos": True})
    assert sum(chunks, []) == whole.json()["choices"][0]["token_ids"]


def test_a_chat_stream_is_paced_too(url):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count to twenty."}],
        "max_tokens": 7,
        "temperature": 0.0,
        "stream_interval": 4,
    }
    assert [len(c) for c in _streamed_token_ids(url, "/v1/chat/completions", body)] == [1, 4, 2]


def test_stream_interval_zero_is_a_400(url):
    reply = post(url, "/v1/completions", {**BODY, "stream": True, "stream_interval": 0})
    assert reply.status == 400
    assert reply.json()["error"]["param"] == "stream_interval"
