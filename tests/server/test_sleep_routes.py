"""--enable-sleep-mode over real HTTP (VLLM_SERVER_DEV_MODE=1): POST /sleep at each level,
/wake_up with and without tags, GET /is_sleeping, POST /release_kv_cache_memory, vLLM's
answers to bad queries and unmet preconditions, the API key, and the metrics.

One `python -m aioserve serve` process for the module (its resident set is read from
/proc/<pid>/status): its KV pool is VLLM_CPU_KVCACHE_SPACE (1 GiB in the tests), which a
level-1 sleep must give back to the kernel and a wake take again. A request sent while
asleep waits and, after the wake, gets transformers' greedy tokens on the same weights
(reloaded from the checkpoint after level 2). Without --enable-sleep-mode (the shared
in-process engine) the routes answer the same and free nothing, as vLLM's do.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from tests.child_process import start_logged
from tests.engine.smollm2 import hf_greedy
from tests.server.conftest import MODEL, serve_built, wait_until_idle
from tests.server.openai_helpers import validation_error_body
from tests.server.serve_process import (
    API_KEY,
    AUTH,
    free_port,
    metric,
    read_metrics_with,
    wait_until_healthy,
)

pytestmark = pytest.mark.slow

SHORT = 8
GREEDY = {"temperature": 0, "ignore_eos": True, "max_tokens": SHORT, "return_token_ids": True}
POOL_MIB = 1024  # VLLM_CPU_KVCACHE_SPACE=1 (tests/conftest.py)


class Sleeper:
    def __init__(self, url: str, pid: int) -> None:
        self.url, self.pid = url, pid

    def rss_mib(self) -> float:
        with open(f"/proc/{self.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def sleeper(smollm2_gguf, tmp_path_factory) -> Iterator[Sleeper]:
    port = free_port()
    argv = [sys.executable, "-m", "aioserve", "serve", str(smollm2_gguf), "--port", str(port)]
    argv += ["--host", "127.0.0.1", "--max-model-len", "512", "--seed", "0", "--dtype"]
    argv += ["float32", "--enforce-eager", "--api-key", API_KEY, "--served-model-name", MODEL]
    argv += ["--enable-sleep-mode", "--block-size", "16"]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    env |= {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    log = tmp_path_factory.mktemp("sleep") / "serve.log"
    process = start_logged(argv, log, env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(process, url, log)
        yield Sleeper(url, process.pid)
    finally:
        process.kill()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def prompt(hf_tokenizer) -> list[int]:
    return hf_tokenizer("The old lighthouse keeper wrote in his logbook that").input_ids


@pytest.fixture(scope="module")
def reference(smollm2_gguf, prompt) -> list[int]:
    return hf_greedy(str(smollm2_gguf), prompt, SHORT)


async def call(session, url: str, method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
    kwargs.setdefault("headers", AUTH)
    async with session.request(method, url + path, **kwargs) as response:
        return response.status, await response.json(content_type=None)


def run(scenario) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            await scenario(session)

    asyncio.run(main())


async def complete(session, url: str, prompt: list[int]) -> list[int]:
    body = {"model": MODEL, "prompt": prompt, **GREEDY}
    status, answer = await call(session, url, "POST", "/v1/completions", json=body)
    assert status == 200, answer
    return answer["choices"][0]["token_ids"]


async def held_until_woken(session, url: str, prompt: list[int]) -> asyncio.Future:
    """A request sent while asleep: still unanswered a while later."""
    held = asyncio.ensure_future(complete(session, url, prompt))
    await asyncio.sleep(1.0)
    assert not held.done()
    return held


async def sleep_states(session, url: str) -> dict[str, float]:
    samples = await read_metrics_with(session, url)
    return {
        s.labels["sleep_state"]: s.value for s in samples if s.name == "vllm:engine_sleep_state"
    }


def test_level_1_frees_the_pool_and_a_wake_takes_it_again(sleeper, prompt, reference):
    url = sleeper.url

    async def scenario(session) -> None:
        assert await complete(session, url, prompt) == reference
        awake_rss = sleeper.rss_mib()
        started = time.monotonic()
        assert await call(session, url, "POST", "/sleep") == (
            200,
            {"status": "sleeping", "level": 1},
        )
        slept_s = time.monotonic() - started
        asleep_rss = sleeper.rss_mib()
        assert awake_rss - asleep_rss > 0.9 * POOL_MIB, (awake_rss, asleep_rss)
        assert await call(session, url, "GET", "/is_sleeping") == (200, {"is_sleeping": True})
        assert await sleep_states(session, url) == {
            "awake": 0, "weights_offloaded": 1, "discard_all": 0
        }  # fmt: skip
        # /resume may not run steps on freed memory.
        status, answer = await call(session, url, "POST", "/resume")
        assert status == 400 and "wake" in answer["error"]["message"]
        held = await held_until_woken(session, url, prompt)

        reply = await call(session, url, "POST", "/wake_up?tags=weights")
        assert reply == (200, {"status": "sleeping", "tags": ["weights"]})
        assert not held.done()
        started = time.monotonic()
        reply = await call(session, url, "POST", "/wake_up?tags=kv_cache")
        woke_s = time.monotonic() - started
        assert reply == (200, {"status": "awake", "tags": ["kv_cache"]})
        assert await call(session, url, "GET", "/is_sleeping") == (200, {"is_sleeping": False})
        assert await held == reference
        assert sleeper.rss_mib() - asleep_rss > 0.9 * POOL_MIB
        assert await sleep_states(session, url) == {
            "awake": 1, "weights_offloaded": 0, "discard_all": 0
        }  # fmt: skip
        samples = await read_metrics_with(session, url)
        assert metric(samples, "vllm:kv_cache_usage_perc") == 0
        name = "vllm:sleep_mode_operation_duration_seconds_count"
        assert metric(samples, name, operation="sleep") >= 1
        assert metric(samples, name, operation="wake") >= 2
        gauge = "vllm:sleep_mode_operations_in_flight"
        assert metric(samples, gauge, operation="sleep") == 0
        print(f"RSS awake {awake_rss:.0f} MiB, asleep {asleep_rss:.0f} MiB; "
              f"sleep {slept_s:.2f} s, wake {woke_s:.2f} s")  # fmt: skip

    run(scenario)


def test_level_2_reloads_the_weights_from_the_checkpoint(sleeper, prompt, reference):
    url = sleeper.url

    async def scenario(session) -> None:
        awake_rss = sleeper.rss_mib()
        reply = await call(session, url, "POST", "/sleep?level=2&mode=wait")
        assert reply == (200, {"status": "sleeping", "level": 2})
        assert awake_rss - sleeper.rss_mib() > POOL_MIB + 300  # the pool and the weights
        assert (await sleep_states(session, url))["discard_all"] == 1
        held = await held_until_woken(session, url, prompt)
        assert await call(session, url, "POST", "/wake_up") == (
            200,
            {"status": "awake", "tags": None},
        )
        assert await held == reference
        assert await complete(session, url, prompt) == reference

    run(scenario)


def test_level_0_pauses_and_release_kv_cache_memory_needs_it(sleeper, prompt, reference):
    url = sleeper.url
    failed = "Call to release_kv_cache_memory method failed: release_kv_cache_memory() requires"

    async def scenario(session) -> None:
        status, answer = await call(session, url, "POST", "/release_kv_cache_memory")
        assert status == 500 and answer["error"] == {
            "message": f"{failed} a completed pause first",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
        assert await call(session, url, "POST", "/sleep?level=0&mode=keep") == (
            200,
            {"status": "sleeping", "level": 0},
        )
        assert (await sleep_states(session, url))["awake"] == 0
        paused_rss = sleeper.rss_mib()
        assert await call(session, url, "POST", "/release_kv_cache_memory") == (
            200,
            {"status": "kv_cache_released"},
        )
        assert paused_rss - sleeper.rss_mib() > 0.9 * POOL_MIB
        status, answer = await call(session, url, "POST", "/release_kv_cache_memory")
        assert status == 500
        assert answer["error"]["message"] == f"{failed} all executor memory to be resident"
        held = await held_until_woken(session, url, prompt)
        # "scheduling" alone wakes nothing that sleeps: the pool is still away.
        assert await call(session, url, "POST", "/wake_up?tags=scheduling") == (
            200,
            {"status": "sleeping", "tags": ["scheduling"]},
        )
        reply = await call(session, url, "POST", "/wake_up?tags=kv_cache&tags=scheduling")
        assert reply == (200, {"status": "awake", "tags": ["kv_cache", "scheduling"]})
        assert await held == reference

    run(scenario)


LE = (
    "{'type': 'less_than_equal', 'loc': 'query.level', 'msg': 'Input should be less than or "
    "equal to 2', 'input': '3', 'ctx': {'le': 2}}"
)
GE = (
    "{'type': 'greater_than_equal', 'loc': 'query.level', 'msg': 'Input should be greater "
    "than or equal to 0', 'input': '-1', 'ctx': {'ge': 0}}"
)
NOT_INT = (
    "{'type': 'int_parsing', 'loc': 'query.level', 'msg': 'Input should be a valid integer, "
    "unable to parse string as an integer', 'input': '1.5'}"
)
MODE = (
    "{'type': 'literal_error', 'loc': 'query.mode', 'msg': \"Input should be 'abort', 'wait' "
    "or 'keep'\", 'input': 'nap', 'ctx': {'expected': \"'abort', 'wait' or 'keep'\"}}"
)


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("level=3", validation_error_body(LE, param="query.level")),
        ("level=-1", validation_error_body(GE, param="query.level")),
        ("level=1.5", validation_error_body(NOT_INT, param="query.level")),
        ("level=3&mode=nap", validation_error_body(LE, MODE, param="query.level")),
    ],
)
def test_a_bad_sleep_query_is_vllms_validation_400(sleeper, query, expected):
    async def scenario(session) -> None:
        assert await call(session, sleeper.url, "POST", "/sleep?" + query) == (400, expected)
        assert await call(session, sleeper.url, "GET", "/is_sleeping") == (
            200,
            {"is_sleeping": False},
        )

    run(scenario)


def test_the_routes_want_the_api_key(sleeper):
    async def scenario(session) -> None:
        for method, path in [
            ("POST", "/sleep"),
            ("POST", "/wake_up"),
            ("GET", "/is_sleeping"),
            ("POST", "/release_kv_cache_memory"),
        ]:
            assert (await call(session, sleeper.url, method, path, headers={}))[0] == 401, path
        assert await call(session, sleeper.url, "GET", "/is_sleeping") == (
            200,
            {"is_sleeping": False},
        )

    run(scenario)


def test_without_sleep_mode_sleep_only_pauses(server_loop, engine, monkeypatch, prompt):
    """vLLM without its sleep allocator: the same answers, the engine paused, no memory
    freed (the pool's storage is where it was)."""
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    pool = engine.runner.kv_caches[0][0]
    with serve_built(server_loop, engine) as url:

        async def scenario(session) -> None:
            no_key: dict = {"headers": {}}
            assert await call(session, url, "POST", "/sleep?level=2", **no_key) == (
                200,
                {"status": "sleeping", "level": 2},
            )
            assert pool.untyped_storage().nbytes() > 0
            assert await call(session, url, "GET", "/is_sleeping", **no_key) == (
                200,
                {"is_sleeping": True},
            )
            held = asyncio.ensure_future(
                call(
                    session,
                    url,
                    "POST",
                    "/v1/completions",
                    headers={},
                    json={"model": MODEL, "prompt": prompt, **GREEDY},
                )  # fmt: skip
            )
            await asyncio.sleep(0.5)
            assert not held.done()
            assert await call(session, url, "POST", "/wake_up", **no_key) == (
                200,
                {"status": "awake", "tags": None},
            )
            assert (await held)[0] == 200

        run(scenario)
    wait_until_idle(engine, server_loop)
