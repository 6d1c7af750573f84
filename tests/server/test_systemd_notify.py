"""systemd notifications: the datagram protocol, the engine heartbeat's watchdog, a real serve.

A unix datagram socket bound in the test's temporary folder stands in for systemd's
`$NOTIFY_SOCKET`. The heartbeat tests run an engine around the stand-in runner on the
test's own event loop and make its model step hang (or its loop die) on purpose; the last
test runs `python -m aioserve serve` on the tiny model and follows READY, WATCHDOG and
STOPPING from outside, as systemd would.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from aioserve.engine.async_engine import AsyncEngine, EngineDeadError
from aioserve.engine.sampling_params import SamplingParams
from aioserve.engine.stand_in_parts import engine_parts_around
from aioserve.runner.stand_in_runner import StandInRunner
from aioserve.server.systemd_notify import (
    Notifier,
    SystemdService,
    notify_socket_address,
    watchdog_interval,
)
from tests.child_process import start_logged
from tests.server.serve_process import START_LIMIT_S, fetch, free_port, metric, read_metrics

WATCHDOG_S = 0.5
"""The watchdog interval of the heartbeat tests: pings every 0.25 s while healthy."""
SILENCE_S = 2 * WATCHDOG_S + 0.3
"""A stretch without pings that systemd (WatchdogSec = WATCHDOG_S) would not forgive."""
VOCAB = 64


class FakeSystemd:
    """A unix datagram socket standing in for systemd's notification socket."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.bind(notify_socket_address(address))

    def received(self, timeout: float = 0.0) -> list[list[str]]:
        """The notifications that arrived (each its assignments), waiting `timeout` s for one."""
        messages = []
        self._socket.settimeout(timeout)  # 0: do not wait
        try:
            while True:
                messages.append(self._socket.recv(4096).decode().split("\n"))
                self._socket.settimeout(0)
        except (BlockingIOError, TimeoutError):
            return messages

    def wait_for(self, assignment: str, limit: float, process: subprocess.Popen) -> list[list[str]]:
        """The notifications up to the first with `assignment`; fails after `limit` s or an exit."""
        seen: list[list[str]] = []
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            seen += self.received(timeout=0.5)
            if any(assignment in message for message in seen):
                return seen
            assert process.poll() is None, f"the server exited with {process.returncode}"
        pytest.fail(f"no {assignment} within {limit} s; got {seen}")

    def close(self) -> None:
        self._socket.close()


def pings(messages: list[list[str]]) -> int:
    return sum("WATCHDOG=1" in message for message in messages)


def statuses(messages: list[list[str]]) -> list[str]:
    return [
        line.removeprefix("STATUS=") for m in messages for line in m if line.startswith("STATUS=")
    ]


# --- the protocol ------------------------------------------------------------------------------


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_a_notification_is_one_datagram_of_assignments(tmp_path, abstract):
    address = f"@aioserve-test-{os.getpid()}" if abstract else str(tmp_path / "notify")
    systemd = FakeSystemd(address)
    notifier = Notifier(address)
    try:
        notifier.notify("READY=1", "STATUS=Running: 0 reqs")
        notifier.notify()  # nothing to say: no datagram
        assert systemd.received(timeout=5) == [["READY=1", "STATUS=Running: 0 reqs"]]
    finally:
        notifier.close()
        systemd.close()


def test_without_notify_socket_nothing_is_sent():
    notifier = Notifier(None)
    assert not notifier.enabled
    notifier.notify("READY=1")  # a no-op, not an error
    engine = stand_in_engine()
    service = SystemdService(engine, {"WATCHDOG_USEC": "500000"})
    assert service.watchdog_s is None and not service.notifier.enabled

    async def close() -> None:
        await service.close()
        await engine.shutdown()

    asyncio.run(close())
    assert engine.stat_loggers == []


@pytest.mark.parametrize(
    ("environ", "seconds"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "30000000"}, 30.0),
        ({"WATCHDOG_USEC": "500000", "WATCHDOG_PID": str(os.getpid())}, 0.5),
        ({"WATCHDOG_USEC": "500000", "WATCHDOG_PID": "1"}, None),  # another process's
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
    ],
)
def test_the_watchdog_interval_comes_from_watchdog_usec(environ, seconds):
    assert watchdog_interval(environ) == seconds


# --- the heartbeat -----------------------------------------------------------------------------


def stand_in_engine() -> AsyncEngine:
    """An engine whose stall limit is the test's watchdog interval (its steps take 5 ms)."""
    runner = StandInRunner(VOCAB, step_seconds=0.005)
    engine = AsyncEngine(
        engine_parts_around(
            runner, vocab_size=VOCAB, num_blocks=64, max_model_len=512, async_scheduling=False
        )
    )
    engine.loop_clock.floor = WATCHDOG_S
    return engine


async def consume(engine: AsyncEngine, request_id: str, max_tokens: int) -> None:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=0, detokenize=False)
    async for _ in engine.generate({"prompt_token_ids": [1, 2, 3, 4]}, params, request_id):
        pass


class HangingStep:
    """Wraps the runner's step: once `hang` is set, the next step blocks until `release`."""

    def __init__(self, runner: StandInRunner) -> None:
        self.hang = threading.Event()
        self.entered = threading.Event()
        self._released = threading.Event()
        self._execute = runner.execute

    def __call__(self, step):
        if self.hang.is_set():
            self.entered.set()
            self._released.wait(timeout=120)  # the thread ends by itself whatever happens
        return self._execute(step)

    def release(self) -> None:
        self.hang.clear()
        self._released.set()


def test_pings_stop_while_a_model_step_hangs_and_resume_after(tmp_path, monkeypatch, caplog):
    systemd = FakeSystemd(str(tmp_path / "notify"))
    engine = stand_in_engine()
    hanging = HangingStep(engine.runner)
    monkeypatch.setattr(engine.runner, "execute", hanging)
    environ = {"NOTIFY_SOCKET": systemd.address, "WATCHDOG_USEC": str(int(WATCHDOG_S * 1e6))}
    seen: dict[str, list[list[str]]] = {}

    async def scenario() -> None:
        service = SystemdService(engine, environ)
        request = None
        try:
            service.ready()
            await asyncio.sleep(0.8)
            seen["idle"] = systemd.received()
            request = asyncio.create_task(consume(engine, "long", max_tokens=400))
            await asyncio.sleep(0.8)
            seen["serving"] = systemd.received()
            hanging.hang.set()
            while not hanging.entered.is_set():
                await asyncio.sleep(0.01)
            # Detection takes up to the watchdog interval and a tick; then silence.
            await asyncio.sleep(WATCHDOG_S + 0.5)
            systemd.received()
            await asyncio.sleep(SILENCE_S)
            seen["hung"] = systemd.received()
            request.cancel()  # the client goes away: no request left, the step still hangs
            await asyncio.sleep(SILENCE_S)
            seen["hung, aborted"] = systemd.received()
            hanging.release()
            await asyncio.sleep(0.8)
            seen["released"] = systemd.received()
        finally:
            hanging.release()
            if request is not None:
                request.cancel()
            await service.close()
            await engine.shutdown()

    try:
        asyncio.run(scenario())
    finally:
        systemd.close()
    assert seen["idle"][0] == [
        "READY=1",
        "STATUS=Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0.0%",
    ]
    assert pings(seen["idle"]) >= 2, seen["idle"]  # an idle engine is healthy
    assert pings(seen["serving"]) >= 2, seen["serving"]
    assert any(s.startswith("Running: 1 reqs") for s in statuses(seen["serving"]))
    assert pings(seen["hung"]) == 0, seen["hung"]
    assert pings(seen["hung, aborted"]) == 0, seen["hung, aborted"]
    stuck = statuses(seen["hung"]) + statuses(seen["hung, aborted"])
    assert any(s.startswith("a model step has run for") for s in stuck), stuck
    assert pings(seen["released"]) >= 2, seen["released"]
    said = [r.getMessage() for r in caplog.records if r.name == "aioserve"]
    assert sum("watchdog pings stop" in m for m in said) == 1, said  # once, not every tick
    assert sum("watchdog pings resume" in m for m in said) == 1, said


def test_pings_stop_when_the_engine_loop_dies(tmp_path, monkeypatch):
    systemd = FakeSystemd(str(tmp_path / "notify"))
    engine = stand_in_engine()
    environ = {"NOTIFY_SOCKET": systemd.address, "WATCHDOG_USEC": str(int(WATCHDOG_S * 1e6))}

    def broken_schedule():
        raise RuntimeError("injected scheduler failure")

    async def scenario() -> list[list[str]]:
        service = SystemdService(engine, environ)
        try:
            service.ready()
            await asyncio.sleep(0.6)
            assert pings(systemd.received()) >= 1
            monkeypatch.setattr(engine.scheduler, "schedule", broken_schedule)
            with pytest.raises(EngineDeadError):
                await consume(engine, "doomed", max_tokens=4)
            await asyncio.sleep(WATCHDOG_S / 2 + 0.1)  # the next tick finds it dead
            systemd.received()
            await asyncio.sleep(SILENCE_S)
            return systemd.received()
        finally:
            await service.close()
            await engine.shutdown()

    try:
        after_death = asyncio.run(scenario())
    finally:
        systemd.close()
    assert pings(after_death) == 0, after_death
    assert engine.is_dead


# --- a real server -----------------------------------------------------------------------------


def test_serve_says_ready_once_it_answers_pings_while_serving_and_stopping_on_sigterm(
    tiny_model, tmp_path
):
    systemd = FakeSystemd(str(tmp_path / "notify"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    argv = [sys.executable, "-m", "aioserve", "serve", tiny_model, "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--enforce-eager", "--max-model-len", "256"]
    argv += ["--num-gpu-blocks-override", "64", "--served-model-name", "tiny"]
    environment = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    environment |= {"NOTIFY_SOCKET": systemd.address, "WATCHDOG_USEC": "500000"}
    process = start_logged(argv, log, environment)
    try:
        before_ready = systemd.wait_for("READY=1", START_LIMIT_S, process)
        # Ready means answering: no retry, no wait.
        assert fetch("GET", url + "/health", timeout=10).status == 200
        before = read_metrics(url)
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 200, "ignore_eos": True}
        completion = fetch("POST", url + "/v1/completions", body=body)
        assert completion.status == 200
        after = read_metrics(url)
        while_serving = systemd.received(timeout=1)
        process.send_signal(signal.SIGTERM)
        stopping = systemd.wait_for("STOPPING=1", 60, process)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        systemd.close()
    # Nothing before READY, and READY once.
    assert before_ready[0] == [
        "READY=1",
        "STATUS=Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0.0%",
    ]
    assert sum("READY=1" in m for m in before_ready + while_serving + stopping) == 1
    serving_pings = [m for m in while_serving if "WATCHDOG=1" in m and "Running: 1 reqs" in m[-1]]
    assert serving_pings, while_serving
    assert statuses(stopping)[-1].startswith("Stopping: Running: 0 reqs")
    text = Path(log).read_text()
    assert text.index("warm-up request done") < text.index("Application startup complete.")
    # The warm-up request is not the clients': /metrics counts from their first.
    prompt_tokens = completion.json()["usage"]["prompt_tokens"]
    for name in ("vllm:prompt_tokens_total", "vllm:prefix_cache_queries_total"):
        assert metric(before, name) == 0
        assert metric(after, name) == prompt_tokens
