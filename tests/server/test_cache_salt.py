"""`cache_salt` over real HTTP: a salted request shares prefix-cache blocks only with
requests of the same salt (vLLM 0.32's prefix-cache isolation), counted by the usage's
`prompt_tokens_details.cached_tokens`; salts vLLM refuses are 400s naming the field."""

from __future__ import annotations

import random

import pytest

from aioserve.config.frontend import frontend_config
from tests.server.conftest import MODEL
from tests.server.openai_helpers import post

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16  # the shared test engine's
MESSAGES = [{"role": "user", "content": "Which is the longest river of Europe, and how long?"}]


@pytest.fixture
def url(start_openai_server) -> str:
    return start_openai_server(frontend=frontend_config(enable_prompt_tokens_details=True))


def cached_tokens(url: str, route: str, body: dict) -> int:
    reply = post(url, route, {"model": MODEL, "max_tokens": 1, "temperature": 0, **body})
    assert reply.status == 200, reply.body
    return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_completions_hit_only_blocks_cached_under_their_own_salt(url):
    prompt = random.Random(11).choices(range(100, 40000), k=3 * BLOCK_SIZE + 2)
    full_blocks = 3 * BLOCK_SIZE

    def cached(**salt) -> int:
        return cached_tokens(url, "/v1/completions", {"prompt": prompt, **salt})

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-a") == full_blocks
    assert cached(cache_salt="tenant-b") == 0
    assert cached() == 0
    assert cached() == full_blocks  # unsalted requests share among themselves
    assert cached(cache_salt="tenant-b") == full_blocks


def test_a_chat_hits_only_blocks_cached_under_its_own_salt(url):
    body = {"messages": MESSAGES}
    first = cached_tokens(url, "/v1/chat/completions", {**body, "cache_salt": "x" * 128})
    again = cached_tokens(url, "/v1/chat/completions", {**body, "cache_salt": "x" * 128})
    assert first == 0 and again >= BLOCK_SIZE and again % BLOCK_SIZE == 0
    assert cached_tokens(url, "/v1/chat/completions", {**body, "cache_salt": "y"}) == 0


@pytest.mark.parametrize("salt", ["", "x" * 129, "tenant/a", "a@b", "back\\slash", "nul\x00"])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_salts_vllm_refuses_are_400s_naming_the_field(url, route, salt):
    prompt = {"prompt": "Hello"} if route == "/v1/completions" else {"messages": MESSAGES}
    reply = post(url, route, {"model": MODEL, **prompt, "cache_salt": salt})
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert error["param"] == "cache_salt"
    assert error["message"].startswith("Parameter 'cache_salt' must")
