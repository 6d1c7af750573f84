"""`aioserve bench serve` against a live `aioserve serve` process on the tiny model."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from aioserve import cli
from tests.child_process import die_with_parent

STARTUP_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_until_healthy(process: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the server exited with status {process.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"the server did not answer /health within {STARTUP_TIMEOUT_S} s")


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("traces")


@pytest.fixture(scope="module")
def live_server(tiny_model, trace_dir):
    """`aioserve serve` on the tiny model, on a free port, its profiler's traces going to
    `trace_dir`; terminated (or killed) at the end."""
    port = _free_port()
    command = [sys.executable, "-m", "aioserve", "serve", tiny_model,
               "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512",
               "--enforce-eager"]  # fmt: skip
    process = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "VLLM_TORCH_PROFILER_DIR": str(trace_dir)},
        preexec_fn=die_with_parent,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_healthy(process, url)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_bench_serve_against_aioserve(live_server, tiny_model, tmp_path, backend):
    argv = [
        "bench", "serve", "--base-url", live_server, "--backend", backend,
        "--tokenizer", tiny_model, "--dataset-name", "random",
        "--random-input-len", "16", "--random-output-len", "4", "--num-prompts", "3",
        "--max-concurrency", "2", "--save-result", "--save-detailed",
        "--result-dir", str(tmp_path), "--result-filename", "live.json",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    result = json.loads((tmp_path / "live.json").read_text())
    assert (result["completed"], result["failed"]) == (3, 0), result["errors"]
    assert result["total_output_tokens"] == 3 * 4  # ignore_eos: every request runs to 4
    if backend == "openai":
        assert result["total_input_tokens"] == 3 * 16
    assert result["mean_ttft_ms"] > 0
    # vLLM's count: requests active within one second, so up to all three, not 2 at once.
    assert 1 <= result["max_concurrent_requests"] <= 3


def _bench(base_url: str, tiny_model: str, *more: str) -> int:
    argv = [
        "bench", "serve", "--base-url", base_url, "--tokenizer", tiny_model,
        "--dataset-name", "random", "--random-input-len", "8", "--random-output-len", "2",
        "--num-prompts", "2", *more,
    ]  # fmt: skip
    return cli.main(argv)


def test_profile_traces_the_timed_requests(live_server, tiny_model, trace_dir):
    before = set(trace_dir.iterdir())
    assert _bench(live_server, tiny_model, "--profile") == 0
    new = set(trace_dir.iterdir()) - before
    [trace] = [path for path in new if path.name.endswith(".pt.trace.json.gz")]
    assert trace.stat().st_size > 0
    # Beside it, as vLLM's workers write one, the table of op times (engine/step_profiler.py).
    [table] = new - {trace}
    assert table.name.endswith(".profiler_out.txt") and table.stat().st_size > 0


def test_profile_stops_the_run_where_the_server_has_no_profiler(live_server, tiny_model, capsys):
    argv = ("--profile", "--model", tiny_model)
    assert _bench(live_server + "/elsewhere", tiny_model, *argv) == 2
    error = capsys.readouterr().err
    assert "--profile: " + live_server + "/elsewhere/start_profile answered 404" in error
    assert "(start the server with VLLM_TORCH_PROFILER_DIR)" in error
