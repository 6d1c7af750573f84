"""A real `python -m aioserve serve` process for end-to-end tests, and how to talk to it.

`start_server` runs the default model's GGUF on a free port of 127.0.0.1 with
`--max-model-len 1024 --seed 0 --api-key --dtype float32`, under the model name of vLLM's recorded
samples; its output goes to a log file whose tail is shown if it does not start, and it is
killed at the end whatever happens (conftest.py's `server_process` fixture gives one per
test module). The rest are the raw-HTTP and /metrics helpers the tests read it with.

float32 on every host: the tests compare texts exactly across requests that compute the same
tokens in other shapes (streamed against whole, alone against 63 others, a prompt whose
prefix is cached against its first run). In bfloat16 (what `--dtype auto` picks on a CPU
with bfloat16 arithmetic) the default model's first answer to the tests' question is a near
tie ("The" and "L" two bfloat16 steps apart in the logits), and which shape computed it can
flip it, as it would in vLLM; batch-invariant results are VLLM_BATCH_INVARIANT=1's to give.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.child_process import start_logged
from tests.server.conftest import MODEL
from tests.server.openai_helpers import Reply, client

API_KEY = "e2e-secret"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 1024
TIMEOUT = aiohttp.ClientTimeout(total=120)
START_LIMIT_S = 300
"""How long the server may take to load the model and answer /health."""


# --- the server process ------------------------------------------------------------------


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log: Path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _log_tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:]


def wait_until_healthy(
    process: subprocess.Popen, url: str, log: Path, limit: float = START_LIMIT_S
) -> None:
    """Wait until GET /health answers 200; fail with the log's tail if it exits or times out."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode}:\n{_log_tail(log)}")
        try:
            if fetch("GET", url + "/health", timeout=5).status == 200:
                return
        except (aiohttp.ClientError, TimeoutError):
            pass  # not listening yet
        time.sleep(0.5)
    pytest.fail(f"the server was not healthy after {limit} s:\n{_log_tail(log)}")


@contextlib.contextmanager
def start_server(gguf: Path, log: Path) -> Iterator[Server]:
    """`python -m aioserve serve` on `gguf`, healthy; killed when the block ends."""
    port = free_port()
    argv = [sys.executable, "-m", "aioserve", "serve", str(gguf)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN)]
    argv += ["--seed", "0", "--api-key", API_KEY, "--enforce-eager", "--dtype", "float32"]
    argv += ["--served-model-name", MODEL]  # the name in vLLM's recorded requests
    environment = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    process = start_logged(argv, log, environment)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(process, url, log)
        assert [m.id for m in client(url, API_KEY).models.list()] == [MODEL]
        yield Server(url, process, log)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


@contextlib.contextmanager
def serve_model(
    model: str | Path, name: str, log: Path, *options: str, env: dict[str, str] | None = None
) -> Iterator[str]:
    """`python -m aioserve serve` on `model` as `name`, with `options` (and the environment
    variables `env`), healthy; its URL. Killed when the block ends."""
    port = free_port()
    argv = [sys.executable, "-m", "aioserve", "serve", str(model)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", name, *options]
    environment = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"} | (env or {})
    process = start_logged(argv, log, environment)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(process, url, log)
        yield url
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


def async_client(server: Server) -> openai.AsyncOpenAI:
    """The official async client on the server; use it as `async with` in one event loop."""
    return openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120
    )


# --- raw HTTP and metrics --------------------------------------------------------------------


def fetch(
    method: str,
    url: str,
    *,
    body: Any = None,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 120,
) -> Reply:
    """One request with aiohttp (a JSON `body` or `raw` bytes), the whole answer read."""

    async def call() -> Reply:
        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        sent = {"Content-Type": "application/json", **(headers or {})}
        limit = aiohttp.ClientTimeout(total=timeout)
        async with aiohttp.ClientSession(timeout=limit) as session:
            async with session.request(method, url, data=data, headers=sent) as response:
                return Reply(response.status, dict(response.headers), await response.read())

    return asyncio.run(call())


OPENAI_ERROR_TYPES = {
    400: openai.BadRequestError.__name__,
    401: openai.AuthenticationError.__name__,
    404: openai.NotFoundError.__name__,
}


def openai_error(reply: Reply) -> dict[str, Any]:
    """The error object of an OpenAI error body, checked for its shape, code and type."""
    body = reply.json()
    assert list(body) == ["error"], body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == reply.status
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    if reply.status in OPENAI_ERROR_TYPES:
        assert error["type"] == OPENAI_ERROR_TYPES[reply.status]
    return error


async def read_metrics_with(session: aiohttp.ClientSession, url: str) -> list[Sample]:
    """Every sample of GET /metrics through an open session, parsed by prometheus-client."""
    async with session.get(url + "/metrics") as response:
        assert response.status == 200
        text = await response.text()
    # The parser raises on anything that is not the Prometheus text format.
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def read_metrics(url: str) -> list[Sample]:
    """Every sample of GET /metrics, parsed by prometheus-client."""

    async def call() -> list[Sample]:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            return await read_metrics_with(session, url)

    return asyncio.run(call())


def metric(samples: list[Sample], name: str, **labels: str) -> float:
    """The value of the one sample called `name` whose labels include `labels`."""
    (value,) = [s.value for s in samples if s.name == name and labels.items() <= s.labels.items()]
    return value


def moved(before: list[Sample], after: list[Sample], name: str, **labels: str) -> float:
    """How much the sample `name` (with `labels`) grew between two reads of /metrics."""
    return metric(after, name, **labels) - metric(before, name, **labels)


def wait_until_metrics_idle(url: str, limit: float = 10) -> list[Sample]:
    """/metrics once no request runs or waits and the KV cache is empty; fails after `limit` s."""
    deadline = time.monotonic() + limit
    while True:
        samples = read_metrics(url)
        busy = {
            name: metric(samples, name)
            for name in (
                "vllm:num_requests_running",
                "vllm:num_requests_waiting",
                "vllm:kv_cache_usage_perc",
            )
        }
        if not any(busy.values()):
            return samples
        assert time.monotonic() < deadline, f"still busy after {limit} s: {busy}"
        time.sleep(0.1)
