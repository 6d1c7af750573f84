"""Load shedding over real HTTP: --max-num-queued-reqs and --max-num-queued-tokens.

Each test serves the whole app (build_app) around a stand-in runner, whose step takes a
fixed time, with the real SmolLM2 tokenizer (from the tiny model's folder), and sends it a
burst of concurrent requests. What must hold: the excess gets 503 with Retry-After and an
OpenAI error body, before any tokenization; every admitted request completes; the
sequences in flight never pass the cap (n > 1 counting n); /metrics counts the shed ones
by reason, under vLLM's name; streams are shed before any SSE byte; afterwards nothing
runs or waits and the KV pool is whole.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from aioserve.config.frontend import frontend_config
from aioserve.engine.async_engine import AsyncEngine
from aioserve.engine.stand_in_parts import engine_parts_around
from aioserve.runner.stand_in_runner import StandInRunner
from aioserve.server.app import build_app
from aioserve.server.metrics import AdmissionRejections
from aioserve.server.state import ServerState
from tests.server.conftest import MODEL, BackgroundLoop, serve_app, wait_until_idle
from tests.server.openai_helpers import Reply, client
from tests.server.serve_process import metric, read_metrics

BURST = 64
BUSY = "The engine is currently busy and cannot accept new requests."
BACKLOG = "The engine has reached its prefill token backlog limit."
REJECTIONS = "vllm:admission_rejections_total"


@dataclass
class Served:
    url: str
    engine: AsyncEngine
    peak_in_flight: list[int]  # the most sequences registered at once (one item)
    tokenized: list[int]  # prompts tokenized (one item)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture
def serve(server_loop: BackgroundLoop, tokenizer) -> Iterator[Callable[..., Served]]:
    """`serve(step_seconds=..., max_num_queued_reqs=...)`: an app around a stand-in engine."""
    with ExitStack() as stack:

        def start(step_seconds: float = 0.02, **caps: int) -> Served:
            runner = StandInRunner(len(tokenizer), step_seconds=step_seconds)
            parts = engine_parts_around(
                runner,
                vocab_size=len(tokenizer),
                num_blocks=512,
                max_model_len=1024,
                tokenizer=tokenizer,
                async_scheduling=False,
                **caps,
            )
            engine = AsyncEngine(parts)
            stack.callback(lambda: server_loop.run(engine.shutdown()))
            served = Served("", engine, [0], [0])
            scheduler = engine.scheduler
            add_request, tokenize_prompt = scheduler.add_request, engine.tokenize_prompt

            def counted_add(request):
                add_request(request)
                in_flight = scheduler.num_running + scheduler.num_waiting
                served.peak_in_flight[0] = max(served.peak_in_flight[0], in_flight)

            def counted_tokenize(prompt):
                served.tokenized[0] += isinstance(prompt, str)  # not the ids given to generate
                return tokenize_prompt(prompt)

            scheduler.add_request = counted_add
            engine.tokenize_prompt = counted_tokenize
            app = build_app(
                ServerState(engine, [MODEL], frontend=frontend_config(disable_log_stats=True))
            )
            served.url = stack.enter_context(serve_app(server_loop, app))
            return served

        yield start


def burst(url: str, path: str, bodies: list[dict[str, Any]]) -> list[Reply]:
    """POST every body at once; the replies in the same order."""

    async def one(session: aiohttp.ClientSession, body: dict[str, Any]) -> Reply:
        async with session.post(url + path, json=body) as response:
            return Reply(response.status, dict(response.headers), await response.read())

    async def all_at_once() -> list[Reply]:
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            return await asyncio.gather(*(one(session, body) for body in bodies))

    return asyncio.run(all_at_once())


def completion(max_tokens: int = 32, **fields: Any) -> dict[str, Any]:
    return {"prompt": "Tell me a story about a cat", "max_tokens": max_tokens, **fields}


def assert_shed(reply: Reply, message: str) -> None:
    """A 503 at once: Retry-After and the OpenAI error body, no event stream."""
    assert reply.status == 503
    assert reply.headers["Retry-After"] == "1"
    assert reply.headers["Content-Type"].startswith("application/json")
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
    assert error["message"].startswith(message)


def split(replies: list[Reply], message: str) -> tuple[list[Reply], list[Reply]]:
    """(admitted, shed), checking that every reply is one or the other."""
    admitted = [r for r in replies if r.status == 200]
    shed = [r for r in replies if r.status != 200]
    for reply in shed:
        assert_shed(reply, message)
    return admitted, shed


def assert_idle_after(served: Served, server_loop: BackgroundLoop) -> None:
    wait_until_idle(served.engine, server_loop)
    engine = served.engine
    assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0
    assert engine.load_shedder.num_reserved == 0


def test_a_burst_beyond_max_num_queued_reqs_is_shed_at_once(serve, server_loop):
    served = serve(max_num_queued_reqs=8)
    replies = burst(served.url, "/v1/completions", [completion() for _ in range(BURST)])
    admitted, shed = split(replies, BUSY)
    assert len(admitted) >= 8 and shed, [r.status for r in replies]
    for reply in admitted:
        (choice,) = reply.json()["choices"]
        assert choice["finish_reason"] == "length"
        assert reply.json()["usage"]["completion_tokens"] == 32
    assert served.peak_in_flight[0] == 8
    # Shed before tokenization: only the admitted prompts were tokenized.
    assert served.tokenized[0] == len(admitted)
    samples = read_metrics(served.url)
    assert metric(samples, REJECTIONS, reason="max_num_queued_reqs") == len(shed)
    assert metric(samples, REJECTIONS, reason="max_num_queued_tokens") == 0
    assert_idle_after(served, server_loop)


def test_a_request_with_n_samples_takes_n_places(serve, server_loop):
    served = serve(max_num_queued_reqs=8)
    replies = burst(served.url, "/v1/completions", [completion(n=3) for _ in range(16)])
    admitted, shed = split(replies, BUSY)
    assert admitted and shed
    assert all(len(r.json()["choices"]) == 3 for r in admitted)
    assert served.peak_in_flight[0] == 6  # a third request of 3 would make 9
    # Prompts times samples: 2 prompts of n=4 fill the cap, 3 of n=3 pass it even when idle.
    (fits,) = burst(served.url, "/v1/completions", [completion(4, prompt=["a", "b"], n=4)])
    assert fits.status == 200 and len(fits.json()["choices"]) == 8
    (too_many,) = burst(served.url, "/v1/completions", [completion(4, prompt=["a"] * 3, n=3)])
    assert_shed(too_many, BUSY)
    assert metric(read_metrics(served.url), REJECTIONS, reason="max_num_queued_reqs") == (
        len(shed) + 1
    )
    assert_idle_after(served, server_loop)


def test_a_burst_beyond_max_num_queued_tokens_is_shed(serve, server_loop):
    served = serve(step_seconds=0.05, max_num_queued_tokens=8)
    bodies = [
        {"messages": [{"role": "user", "content": f"Question {i}?"}], "max_tokens": 8}
        for i in range(BURST)
    ]
    admitted, shed = split(burst(served.url, "/v1/chat/completions", bodies), BACKLOG)
    assert admitted and shed
    assert all(r.json()["choices"][0]["finish_reason"] == "length" for r in admitted)
    samples = read_metrics(served.url)
    assert metric(samples, REJECTIONS, reason="max_num_queued_tokens") == len(shed)
    assert metric(samples, REJECTIONS, reason="max_num_queued_reqs") == 0
    assert_idle_after(served, server_loop)


def test_streams_are_shed_before_any_event(serve, server_loop):
    served = serve(max_num_queued_reqs=1)
    api = client(served.url)
    long_stream = api.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=500, stream=True
    )
    try:
        next(iter(long_stream))  # admitted and streaming: the one place is taken
        with pytest.raises(openai.InternalServerError) as error:
            api.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True
            )
        assert error.value.status_code == 503
        assert error.value.response.headers["retry-after"] == "1"
        assert error.value.body["message"].startswith(BUSY)
        raw = burst(served.url, "/v1/completions", [completion(stream=True)])
        assert_shed(raw[0], BUSY)
        assert not raw[0].body.startswith(b"data:")
    finally:
        long_stream.close()
    assert_idle_after(served, server_loop)
    assert metric(read_metrics(served.url), REJECTIONS, reason="max_num_queued_reqs") == 2


def test_the_rejections_counter_is_vllms():
    """Name, type, help text and labels as on vLLM's own /metrics page."""
    vllm_page = (Path(__file__).parent / "vllm_samples" / "24_metrics.txt").read_text()
    name = REJECTIONS.removesuffix("_total")
    (vllm,) = [f for f in text_string_to_metric_families(vllm_page) if f.name == name]
    shedder = SimpleNamespace(rejections={"max_num_queued_reqs": 0, "max_num_queued_tokens": 3})
    registry = CollectorRegistry()
    registry.register(AdmissionRejections(MODEL, shedder))
    exposed = text_string_to_metric_families(generate_latest(registry).decode())
    (ours,) = [f for f in exposed if f.name == name]
    assert (ours.name, ours.type, ours.documentation) == (vllm.name, vllm.type, vllm.documentation)
    totals = [s for s in ours.samples if s.name == REJECTIONS]
    assert [set(s.labels) for s in totals] == [{"model_name", "reason"}] * 2
    assert {s.labels["reason"]: s.value for s in totals} == shedder.rejections
