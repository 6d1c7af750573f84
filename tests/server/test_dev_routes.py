"""VLLM_SERVER_DEV_MODE=1's POST /reset_prefix_cache: a prompt cached before the reset is
computed again after it (vllm:prefix_cache_hits_total, read from /metrics); the reset
fails, changing nothing, while a request holds blocks; vLLM's query parameters aioserve
cannot honour are 400s naming them; without the variable the route does not exist.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.server.conftest import MODEL, serve_built, wait_until_idle
from tests.server.openai_helpers import post
from tests.server.serve_process import moved, read_metrics

HITS = "vllm:prefix_cache_hits_total"


pytestmark = pytest.mark.usefixtures("no_api_key_env")


@pytest.fixture
def dev_server(server_loop, engine, monkeypatch) -> Iterator[str]:
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    with serve_built(server_loop, engine) as url:
        wait_until_idle(engine, server_loop)
        yield url


def _prompt(engine, first: int) -> list[int]:
    """Token ids filling two KV blocks and a few slots more: two blocks to cache."""
    return [(first + i) % 1000 + 10 for i in range(2 * engine.settings.block_size + 5)]


def _complete(url: str, prompt: list[int]) -> None:
    reply = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert reply.status == 200, reply.body


def test_a_reset_makes_a_cached_prompt_compute_again(dev_server, engine):
    prompt = _prompt(engine, 7)
    _complete(dev_server, prompt)
    before = read_metrics(dev_server)
    _complete(dev_server, prompt)
    cached = moved(before, read_metrics(dev_server), HITS)
    assert cached == 2 * engine.settings.block_size
    reply = post(dev_server, "/reset_prefix_cache")
    assert reply.status == 200 and reply.json() == {"success": True}
    before = read_metrics(dev_server)
    _complete(dev_server, prompt)
    assert moved(before, read_metrics(dev_server), HITS) == 0


def test_the_reset_fails_while_a_request_holds_blocks(dev_server, engine, server_loop):
    prompt = _prompt(engine, 300)
    _complete(dev_server, prompt)
    client = openai.OpenAI(base_url=dev_server + "/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(
        model=MODEL, prompt=[1, 2, 3], max_tokens=64, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))  # running now, its blocks held
    reply = post(dev_server, "/reset_prefix_cache")
    assert reply.status == 200 and reply.json() == {"success": False}
    for _ in stream:
        pass
    wait_until_idle(engine, server_loop)
    before = read_metrics(dev_server)
    _complete(dev_server, prompt)  # still cached: the failed reset forgot nothing
    assert moved(before, read_metrics(dev_server), HITS) == 2 * engine.settings.block_size


@pytest.mark.parametrize("query", ["reset_running_requests=true", "reset_external=1"])
def test_what_aioserve_cannot_reset_is_a_400_naming_it(dev_server, query):
    reply = post(dev_server, "/reset_prefix_cache?" + query)
    assert reply.status == 400
    assert reply.json()["error"]["param"] == query.split("=")[0]


def test_without_dev_mode_there_is_no_route(server_loop, engine, monkeypatch):
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    with serve_built(server_loop, engine) as url:
        assert post(url, "/reset_prefix_cache").status == 404
