"""--logprobs-mode processed_logprobs over real HTTP: a chat request with temperature and
top-k lists the kept tokens' logprobs (summing to probability 1) and the dropped ones at
vLLM's JSON floor, -9999.0 (JSON has no -inf). One engine for the module."""

from __future__ import annotations

import math

import pytest

from aioserve.server.state import ServerState
from tests.engine.smollm2 import float32_engine
from tests.server.conftest import MODEL, openai_app, serve_app
from tests.server.openai_helpers import client

pytestmark = pytest.mark.slow

TOP_K = 4


@pytest.fixture(scope="module")
def processed_server(smollm2_gguf, server_loop):
    engine = float32_engine(
        smollm2_gguf, 512, logprobs_mode="processed_logprobs", num_gpu_blocks_override=64
    )
    try:
        with serve_app(server_loop, openai_app(ServerState(engine, [MODEL]))) as url:
            yield url
    finally:
        server_loop.run(engine.shutdown())


def test_chat_lists_kept_tokens_and_floors_the_dropped_ones(processed_server):
    result = client(processed_server).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=3,
        temperature=0.7,
        seed=11,
        logprobs=True,
        top_logprobs=TOP_K + 2,
        extra_body={"top_k": TOP_K},
    )
    content = result.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        values = [e.logprob for e in entry.top_logprobs]
        assert len(values) == TOP_K + 2
        kept, dropped = values[:TOP_K], values[TOP_K:]
        assert dropped == [-9999.0, -9999.0]
        assert math.log(sum(math.exp(v) for v in kept)) == pytest.approx(0.0, abs=1e-5)
        assert entry.logprob in kept and entry.logprob > -9999.0
