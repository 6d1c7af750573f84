"""repetition_detection over real HTTP: a looping completion (streamed or not) and a chat
answer end with finish_reason "repetition" and stop_reason "repetition_detected" where their
tokens without it first repeat; bad settings are 400s naming the field. One SmolLM2 engine
(float32, eager) for the module."""

from __future__ import annotations

import pytest

from aioserve.server.state import ServerState
from tests.engine.smollm2 import float32_engine
from tests.engine.test_repetition_detection import first_stop
from tests.server.conftest import MODEL, openai_app, serve_app
from tests.server.openai_helpers import client, post

PROMPT = "1, 2, 1, 2, 1, 2, 1, 2, 1, 2,"
DETECTION = {"max_pattern_size": 8, "min_count": 3}


@pytest.fixture(scope="module")
def url(smollm2_gguf, server_loop):
    engine = float32_engine(smollm2_gguf, max_model_len=256, num_gpu_blocks_override=64)
    try:
        with serve_app(server_loop, openai_app(ServerState(engine, [MODEL]))) as base:
            yield base
    finally:
        server_loop.run(engine.shutdown())


def _complete(url: str, **more) -> dict:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0.0}
    reply = post(url, "/v1/completions", {**body, "return_token_ids": True, **more})
    assert reply.status == 200, reply.body
    return reply.json()["choices"][0]


def test_a_looping_completion_ends_where_it_first_repeats(url):
    free = _complete(url)
    assert free["finish_reason"] == "length"
    kept = first_stop(free["token_ids"], 0, 8, 3)
    assert kept < 24, free["text"]  # the model loops on this prompt
    stopped = _complete(url, repetition_detection=DETECTION)
    assert stopped["token_ids"] == free["token_ids"][:kept]
    assert (stopped["finish_reason"], stopped["stop_reason"]) == (
        "repetition",
        "repetition_detected",
    )
    assert free["text"].startswith(stopped["text"])


def test_a_stream_and_a_chat_end_as_repetition(url):
    stream = client(url).completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0.0,
        stream=True,
        extra_body={"repetition_detection": DETECTION},
    )
    reasons = [
        c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason
    ]
    assert reasons == ["repetition"]
    chat = client(url).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Repeat 'ab ' forever: ab ab ab ab ab ab"}],
        max_tokens=40,
        temperature=0.0,
        extra_body={"repetition_detection": {"max_pattern_size": 6, "min_count": 3}},
    )
    assert chat.choices[0].finish_reason == "repetition"


@pytest.mark.parametrize(
    ("detection", "message"),
    [
        ({"max_pattern_size": 4, "min_count": 1}, "min_count must be >= 2"),
        ({"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}, "min_pattern_size <="),
        ({"max_pattern_size": "4"}, "must be an integer"),
        ([4, 3], "repetition_detection must be an object"),
    ],
)
def test_bad_settings_are_400s_naming_the_field(url, detection, message):
    reply = post(
        url,
        "/v1/completions",
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "repetition_detection": detection},
    )
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert message in error["message"]
    assert error["param"].startswith("repetition_detection")
