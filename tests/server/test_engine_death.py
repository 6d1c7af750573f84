"""Honest health: a dead or stalled engine says so on /health, ends its requests, exits non-zero.

The first tests serve the whole app (build_app) around a stand-in engine on the test
server loop and break its model step on purpose: a device error kills the engine (/health
503 within a second, the open stream gets an error event, the waiting request a 500 JSON
body); one failing step fails only its request; steps failing in a row kill it; a hung
step turns /health 503 once it has run past the stall limit. The last two run a real
`python -m aioserve serve` on the tiny model with faults injected through
engine_faults/sitecustomize.py: killed under load it exits with status 1; with a hung
step, SIGTERM still ends it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from transformers import AutoTokenizer

from aioserve.config.frontend import frontend_config
from aioserve.engine.async_engine import AsyncEngine
from aioserve.engine.stand_in_parts import engine_parts_around
from aioserve.runner.stand_in_runner import StandInRunner
from aioserve.server.app import build_app
from aioserve.server.state import ServerState
from tests.child_process import start_logged
from tests.server.conftest import MODEL, BackgroundLoop, serve_app
from tests.server.serve_process import fetch, free_port, openai_error, wait_until_healthy
from tests.server.test_systemd_notify import HangingStep

FAULTS = Path(__file__).parent / "engine_faults"
LONG = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": 400, "ignore_eos": True}
STALL_FLOOR_S = 0.5


class FailingStep:
    """Wraps the runner's step: raises `error` on every step while `failing` is set."""

    def __init__(self, execute: Callable, error: Exception) -> None:
        self.failing = threading.Event()
        self._execute = execute
        self._error = error

    def __call__(self, step):
        if self.failing.is_set():
            raise self._error
        return self._execute(step)


@dataclass
class Served:
    url: str
    engine: AsyncEngine


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture
def serve(server_loop: BackgroundLoop, tokenizer) -> Iterator[Callable[[], Served]]:
    """`serve()`: the app around a fresh stand-in engine (20 ms steps), on a free port."""
    with ExitStack() as stack:

        def start() -> Served:
            runner = StandInRunner(len(tokenizer), step_seconds=0.02)
            parts = engine_parts_around(
                runner,
                vocab_size=len(tokenizer),
                num_blocks=256,
                max_model_len=1024,
                tokenizer=tokenizer,
                async_scheduling=True,
            )
            engine = AsyncEngine(parts)
            engine.loop_clock.floor = STALL_FLOOR_S
            stack.callback(lambda: server_loop.run(engine.shutdown(timeout=1)))
            app = build_app(
                ServerState(engine, [MODEL], frontend=frontend_config(disable_log_stats=True))
            )
            return Served(stack.enter_context(serve_app(server_loop, app)), engine)

        yield start


async def health(session: aiohttp.ClientSession, url: str) -> tuple[int, bytes]:
    async with session.get(url + "/health") as response:
        return response.status, await response.read()


async def until_unhealthy(session: aiohttp.ClientSession, url: str, limit: float) -> float:
    """Seconds until /health answers 503 (polled every 20 ms); fails after `limit` s."""
    started = time.monotonic()
    while (elapsed := time.monotonic() - started) < limit:
        status, body = await health(session, url)
        if status != 200:
            assert status == 503, body
            error = json.loads(body)["error"]
            assert error["code"] == 503 and error["message"].startswith("unhealthy: ")
            return elapsed
        await asyncio.sleep(0.02)
    pytest.fail(f"/health still 200 after {limit} s")


async def open_stream(session: aiohttp.ClientSession, url: str) -> aiohttp.ClientResponse:
    """A streamed completion whose first event has arrived."""
    response = await session.post(url + "/v1/completions", json={**LONG, "stream": True})
    assert response.status == 200
    assert (await response.content.readuntil(b"\n\n")).startswith(b"data: {")
    return response


async def post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with session.post(url + "/v1/completions", json=body) as response:
        return response.status, await response.json()


def sse_events(body: bytes) -> list[Any]:
    """The events of an SSE body: JSON objects, then "[DONE]"."""
    events = [e.removeprefix(b"data: ") for e in body.split(b"\n\n") if e]
    return [e.decode() if e == b"[DONE]" else json.loads(e) for e in events]


def assert_ends_with_error_event(body: bytes, message: str) -> None:
    *chunks, error, done = sse_events(body)
    assert done == "[DONE]"
    assert all("choices" in chunk for chunk in chunks)
    assert error["error"]["code"] == 500 and error["error"]["type"] == "InternalServerError"
    assert message in error["error"]["message"]


def test_a_device_error_kills_the_engine_and_every_request_hears_it(serve):
    served = serve()
    failing = FailingStep(
        served.engine.runner.execute,
        torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
    )
    served.engine.runner.execute = failing

    async def scenario() -> tuple[float, bytes, int, dict, int]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            assert (await health(session, served.url))[0] == 200
            stream = await open_stream(session, served.url)
            waiting = asyncio.create_task(post(session, served.url, LONG))
            while served.engine.num_unfinished_requests < 2:
                await asyncio.sleep(0.01)
            failing.failing.set()
            to_unhealthy = await until_unhealthy(session, served.url, limit=5)
            streamed = await stream.read()
            status, body = await waiting
            late_status, _ = await post(session, served.url, LONG)
        return to_unhealthy, streamed, status, body, late_status

    to_unhealthy, streamed, status, body, late_status = asyncio.run(scenario())
    assert to_unhealthy < 1.0
    assert served.engine.is_dead
    assert_ends_with_error_event(streamed, "illegal memory access")
    assert status == 500 and body["error"]["type"] == "InternalServerError"
    assert "illegal memory access" in body["error"]["message"]
    assert late_status == 500  # the engine refuses new requests


def test_one_failing_step_fails_only_its_request(serve):
    served = serve()
    failing = FailingStep(served.engine.runner.execute, RuntimeError("injected step failure"))
    served.engine.runner.execute = failing
    failing.failing.set()
    failed = fetch("POST", served.url + "/v1/completions", body=LONG)
    failing.failing.clear()
    assert failed.status == 500
    assert "injected step failure" in openai_error(failed)["message"]
    assert fetch("GET", served.url + "/health").status == 200
    body = {**LONG, "max_tokens": 8}
    assert fetch("POST", served.url + "/v1/completions", body=body).status == 200
    assert not served.engine.is_dead


def test_steps_failing_in_a_row_kill_the_engine(serve):
    served = serve()
    failing = FailingStep(served.engine.runner.execute, RuntimeError("injected step failure"))
    served.engine.runner.execute = failing
    failing.failing.set()
    replies = [fetch("POST", served.url + "/v1/completions", body=LONG) for _ in range(3)]
    assert [r.status for r in replies] == [500, 500, 500]
    assert served.engine.is_dead
    assert "3 model steps in a row failed" in openai_error(replies[-1])["message"]
    assert fetch("GET", served.url + "/health").status == 503


def test_a_hung_step_makes_health_503_once_past_the_stall_limit(serve):
    served = serve()
    hanging = HangingStep(served.engine.runner)
    served.engine.runner.execute = hanging

    async def scenario() -> tuple[int, float, bytes, float]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            assert (await post(session, served.url, {**LONG, "max_tokens": 4}))[0] == 200
            await asyncio.sleep(2 * STALL_FLOOR_S)
            idle = (await health(session, served.url))[0]  # idle for long: healthy
            stream = await open_stream(session, served.url)
            hanging.hang.set()
            while not hanging.entered.is_set():
                await asyncio.sleep(0.01)
            hung_at = time.monotonic()
            await until_unhealthy(session, served.url, limit=STALL_FLOOR_S + 2)
            to_unhealthy = time.monotonic() - hung_at
            _, body = await health(session, served.url)
            stream.close()
            hanging.release()
            released_at = time.monotonic()
            while (await health(session, served.url))[0] != 200:
                assert time.monotonic() - released_at < 2, "still unhealthy after the step ended"
                await asyncio.sleep(0.02)
            return idle, to_unhealthy, body, time.monotonic() - released_at

    try:
        idle, to_unhealthy, body, to_healthy = asyncio.run(scenario())
    finally:
        hanging.release()
    assert idle == 200
    # Counted from when the test saw the step hang, a few ms after it began.
    assert STALL_FLOOR_S - 0.1 < to_unhealthy < STALL_FLOOR_S + 1.0
    assert b"a model step has run for" in body
    assert to_healthy < 1.0  # the step came back: healthy again
    assert not served.engine.is_dead


# --- a real server -----------------------------------------------------------------------------


def start_faulty_server(tiny_model: str, tmp_path: Path) -> tuple[subprocess.Popen, str, Path]:
    """`python -m aioserve serve` on the tiny model, faults read from tmp_path; healthy."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    argv = [sys.executable, "-m", "aioserve", "serve", tiny_model, "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--enforce-eager", "--max-model-len", "512"]
    argv += ["--num-gpu-blocks-override", "64", "--served-model-name", MODEL]
    argv += ["--shutdown-timeout", "1"]
    environment = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    python_path = os.pathsep.join(p for p in (str(FAULTS), environment.get("PYTHONPATH")) if p)
    environment |= {"PYTHONPATH": python_path, "AIOSERVE_TEST_FAULTS": str(tmp_path)}
    process = start_logged(argv, log, environment)
    try:
        wait_until_healthy(process, url, log)
    except BaseException:
        process.kill()
        process.wait(timeout=30)
        raise
    return process, url, log


def test_serve_killed_under_load_ends_every_stream_with_an_error_and_exits_1(tiny_model, tmp_path):
    process, url, log = start_faulty_server(tiny_model, tmp_path)

    async def scenario() -> tuple[list[int], float | None, list[bytes], int, dict]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            streams = [await open_stream(session, url) for _ in range(3)]
            waiting = asyncio.create_task(post(session, url, LONG))
            await asyncio.sleep(0.2)
            (tmp_path / "kill").touch()
            killed_at = time.monotonic()
            statuses: list[int] = []  # /health every 10 ms until the server stops listening
            unhealthy_after = None
            while time.monotonic() - killed_at < 5:
                try:
                    statuses.append((await health(session, url))[0])
                except aiohttp.ClientConnectionError:
                    statuses.append(0)
                if statuses[-1] != 200 and unhealthy_after is None:
                    unhealthy_after = time.monotonic() - killed_at
                if statuses[-1] == 0:
                    break
                await asyncio.sleep(0.01)
            bodies = [await stream.read() for stream in streams]
            status, body = await waiting
            return statuses, unhealthy_after, bodies, status, body

    try:
        (tmp_path / "slow").touch()  # steps of 20 ms: the streams are far from their end
        statuses, unhealthy_after, bodies, status, body = asyncio.run(scenario())
        exit_status = process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    text = log.read_text()
    # 200 until the device error, within 1 s 503 (0: no longer listening), never 200 again.
    assert unhealthy_after is not None and unhealthy_after < 1.0, statuses
    first_unhealthy = next(i for i, s in enumerate(statuses) if s != 200)
    assert set(statuses[first_unhealthy:]) <= {503, 0}, statuses
    for streamed in bodies:
        assert_ends_with_error_event(streamed, "illegal memory access")
    assert status == 500 and "illegal memory access" in body["error"]["message"]
    assert exit_status == 1, text[-3000:]
    assert "exiting with status 1" in text


def test_sigterm_ends_serve_while_a_model_step_hangs(tiny_model, tmp_path):
    process, url, log = start_faulty_server(tiny_model, tmp_path)
    try:
        (tmp_path / "hang").touch()
        request = threading.Thread(
            target=lambda: fetch("POST", url + "/v1/completions", body=LONG, timeout=60),
            daemon=True,
        )
        request.start()
        time.sleep(1.0)  # the request is in, its step hangs
        process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        # --shutdown-timeout 1, then up to SHUTDOWN_WAIT_S (5 s) for the step, then the exit.
        exit_status = process.wait(timeout=20)
        took = time.monotonic() - started
    finally:
        (tmp_path / "hang").unlink(missing_ok=True)
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    text = log.read_text()
    assert exit_status == 0, text[-3000:]
    assert took < 15
    assert "leaving it behind" in text
