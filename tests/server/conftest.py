"""Fixtures for HTTP tests: one engine on the default model, apps served on a background loop.

The engine and every app run on one uvloop event loop in a background thread
(`server_loop`), as in `aioserve serve`; tests talk to them over real HTTP from the main
thread. Anything that touches the engine directly must run on that loop too
(`server_loop.run(coroutine)`): the engine's scheduler coroutine lives there.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import openai
import pytest
import uvloop
from aiohttp import web
from transformers import AutoTokenizer

from aioserve import AsyncEngine
from aioserve.config.engine import engine_config_from_args
from aioserve.config.frontend import frontend_config_from_args
from aioserve.config.parser import build_engine_parser
from aioserve.server.app import build_app
from aioserve.server.errors import error_middleware
from aioserve.server.openai_routes import add_openai_routes
from aioserve.server.state import STATE, ServerState
from tests.engine.smollm2 import float32_engine
from tests.server.openai_helpers import client

if TYPE_CHECKING:
    from tests.server.serve_process import Server

MODEL = "SmolLM2-135M-Instruct"
"""The name the test servers answer to (the name vLLM used in the reference samples)."""

T = TypeVar("T")


class BackgroundLoop:
    """A uvloop event loop running in its own thread."""

    def __init__(self) -> None:
        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="test-server-loop", daemon=True
        )
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float = 300) -> T:
        """Run `coroutine` on the loop and return its result (or raise its error)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        self.loop.close()


@pytest.fixture(scope="session")
def server_loop() -> Iterator[BackgroundLoop]:
    loop = BackgroundLoop()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def engine(smollm2_gguf, server_loop: BackgroundLoop) -> Iterator[AsyncEngine]:
    """The default model at float32 with a 2048-token context, seeded."""
    engine = float32_engine(smollm2_gguf, max_model_len=2048)
    yield engine
    server_loop.run(engine.shutdown())


@contextmanager
def serve_app(server_loop: BackgroundLoop, app: web.Application) -> Iterator[str]:
    """Serve `app` on 127.0.0.1 on a free port; yields its base URL, cleans up after."""

    async def start() -> web.AppRunner:
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner

    runner = server_loop.run(start())
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        server_loop.run(runner.cleanup())


@contextmanager
def serve_built(server_loop: BackgroundLoop, engine: AsyncEngine, *argv: str) -> Iterator[str]:
    """The app `aioserve serve <argv>` builds for `engine`, on a free port: its base URL."""
    args = build_engine_parser("aioserve serve").parse_args(argv)
    options = frontend_config_from_args(args)
    profiler = engine_config_from_args(args).profiler.profiler_config  # --profiler-config
    state = ServerState(engine, [MODEL], options, profiler=profiler)
    with serve_app(server_loop, build_app(state)) as url:
        yield url


@pytest.fixture
def no_api_key_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No VLLM_API_KEY from the environment the tests run in."""
    monkeypatch.delenv("VLLM_API_KEY", raising=False)


def openai_app(state: ServerState) -> web.Application:
    """The smallest app with the OpenAI generation routes."""
    app = web.Application(middlewares=[error_middleware])
    app[STATE] = state
    add_openai_routes(app)
    return app


@pytest.fixture(scope="session")
def openai_server(engine: AsyncEngine, server_loop: BackgroundLoop) -> Iterator[str]:
    """Base URL of an app with the OpenAI routes and default options."""
    with serve_app(server_loop, openai_app(ServerState(engine, [MODEL]))) as url:
        yield url


@pytest.fixture
def start_openai_server(
    engine: AsyncEngine, server_loop: BackgroundLoop
) -> Iterator[Callable[..., str]]:
    """A factory: `start_openai_server(frontend=frontend_config(...), draining=True)` -> base URL."""
    with ExitStack() as stack:

        def start(**state_fields: Any) -> str:
            state = ServerState(engine, [MODEL], **state_fields)
            return stack.enter_context(serve_app(server_loop, openai_app(state)))

        yield start


def fail_model_step(monkeypatch: pytest.MonkeyPatch, engine: AsyncEngine, on_call: int) -> None:
    """Make the engine's `on_call`-th model step from now raise "injected step failure"."""
    execute = engine.runner.execute
    calls = 0

    def fail_once(step):
        nonlocal calls
        calls += 1
        if calls == on_call:
            raise RuntimeError("injected step failure")
        return execute(step)

    monkeypatch.setattr(engine.runner, "execute", fail_once)


def wait_until_idle(engine: AsyncEngine, server_loop: BackgroundLoop, limit: float = 10) -> None:
    """Wait (up to `limit` seconds) until no request runs and every KV block is free."""

    async def idle() -> bool:
        kv = engine.kv_cache
        return engine.num_unfinished_requests == 0 and kv.num_free_blocks == kv.num_blocks

    deadline = time.monotonic() + limit
    while not server_loop.run(idle()) and time.monotonic() < deadline:
        time.sleep(0.05)
    kv = engine.kv_cache
    assert engine.num_unfinished_requests == 0, "a request is still running"
    assert kv.num_free_blocks == kv.num_blocks, "KV blocks were not returned to the pool"


@pytest.fixture(scope="module")
def server_process(smollm2_gguf, tmp_path_factory) -> Iterator[Server]:
    """A real `python -m aioserve serve` on the default model for one test module."""
    from tests.server.serve_process import start_server  # it imports this module

    with start_server(smollm2_gguf, tmp_path_factory.mktemp("serve") / "serve.log") as server:
        yield server


@pytest.fixture(scope="module")
def server_process_client(server_process: Server) -> openai.OpenAI:
    """The official client on `server_process`, with its API key."""
    from tests.server.serve_process import API_KEY

    return client(server_process.url, API_KEY)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_gguf):
    """The model's tokenizer as transformers loads it from the GGUF, apart from any server."""
    return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
