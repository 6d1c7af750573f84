"""--logits-processors over real HTTP with the official client: `vllm_xargs` reaches the
processors (SamplingParams.extra_args) on /v1/completions, streamed or not, and on
/v1/chat/completions; a request without it is left alone; a processor's refusal and a
malformed vllm_xargs are 400s naming vllm_xargs. One engine for the module (SmolLM2,
float32, eager)."""

from __future__ import annotations

import pytest

from aioserve.server.state import ServerState
from tests.engine.smollm2 import float32_engine
from tests.server.conftest import MODEL, openai_app, serve_app
from tests.server.openai_helpers import client, post

PROMPT = "The river that runs through the old town"


@pytest.fixture(scope="module")
def engine(smollm2_gguf, server_loop):
    engine = float32_engine(
        smollm2_gguf,
        max_model_len=256,
        logits_processors=["tests.engine.example_processors:ForceToken"],
        num_gpu_blocks_override=64,
    )
    yield engine
    server_loop.run(engine.shutdown())


@pytest.fixture(scope="module")
def url(engine, server_loop):
    with serve_app(server_loop, openai_app(ServerState(engine, [MODEL]))) as base:
        yield base


@pytest.fixture(scope="module")
def target(engine) -> tuple[int, str]:
    """A token the model would not pick after PROMPT, and its text."""
    [token] = engine.tokenizer(" banana", add_special_tokens=False).input_ids
    return token, engine.tokenizer.decode([token])


def test_completions_pass_vllm_xargs_to_the_processors(url, target):
    token, text = target
    forced = client(url).completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0.0,
        extra_body={"vllm_xargs": {"target_token": token}},
    )
    assert forced.choices[0].text == text * 4
    plain = client(url).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.0
    )
    assert plain.choices[0].text != text * 4


def test_a_stream_and_a_chat_are_forced_too(url, target):
    token, text = target
    stream = client(url).completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=3,
        temperature=0.9,
        seed=5,
        stream=True,
        extra_body={"vllm_xargs": {"target_token": token}},
    )
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == text * 3
    chat = client(url).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=3,
        temperature=0.0,
        extra_body={"vllm_xargs": {"target_token": token}},
    )
    assert chat.choices[0].message.content == text * 3


@pytest.mark.parametrize(
    ("xargs", "message"),
    [
        ({"target_token": "seven"}, "target_token must be an integer"),
        ({"target_token": {"id": 7}}, "vllm_xargs['target_token'] must be a string, a number"),
        ({"ids": [1, [2]]}, "vllm_xargs['ids'] must be a string, a number"),
        ([1, 2], "vllm_xargs must be an object"),
    ],
)
def test_refused_xargs_are_400s_naming_vllm_xargs(url, xargs, message):
    reply = post(
        url,
        "/v1/completions",
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "vllm_xargs": xargs},
    )
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert message in error["message"]
    assert error["param"] == "vllm_xargs"
