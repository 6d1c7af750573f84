"""VLLM_SERVER_DEV_MODE=1's RL routes over HTTP: POST /pause in each mode with requests in
flight, streamed and not, what becomes of them and of a request sent while paused; POST
/resume, GET /is_paused; POST /abort_requests by id and all at once; vLLM 0.32's answers
to bad queries and bodies; without the variable the routes do not exist.

The reference for the tokens of a request paused and resumed is transformers' greedy
decoding of the same prompt (tests/engine/smollm2.py). That nothing runs while paused is
read from the engine: the loop has gone round after the request came in, and parked, and
the request has no token.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import aiohttp
import pytest

from aioserve.engine.request import RequestStatus
from tests.engine.smollm2 import hf_greedy
from tests.server.conftest import MODEL, BackgroundLoop, serve_built, wait_until_idle
from tests.server.openai_helpers import validation_error_body
from tests.server.serve_process import metric, read_metrics_with

T = TypeVar("T")
LONG = 400  # max_tokens of a request that an abort must end: it never gets that far
SHORT = 12  # max_tokens of a request that runs to its end
SUCCESS = "vllm:request_success_total"
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def dev_server(server_loop, engine) -> Iterator[str]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_SERVER_DEV_MODE", "1")
        patch.delenv("VLLM_API_KEY", raising=False)
        with serve_built(server_loop, engine) as url:
            yield url


@pytest.fixture(autouse=True)
def resumed_and_idle(server_loop, engine) -> Iterator[None]:
    """Every test leaves the shared engine unpaused, with no request and every block free."""
    yield
    server_loop.run(_call(engine.resume_generation))
    wait_until_idle(engine, server_loop, limit=60)


@pytest.fixture(scope="module")
def prompt(hf_tokenizer) -> list[int]:
    return hf_tokenizer("The old lighthouse keeper wrote in his logbook that").input_ids


@pytest.fixture(scope="module")
def reference(smollm2_gguf, prompt) -> list[int]:
    """transformers' greedy tokens after `prompt`: what a request of SHORT tokens gets."""
    return hf_greedy(str(smollm2_gguf), prompt, SHORT)


async def _call(fn: Callable[[], T]) -> T:
    return fn()


class Scene:
    """One test's client side: an aiohttp session on the server, and the engine's state read
    on the server's loop without blocking this one."""

    def __init__(
        self, session: aiohttp.ClientSession, url: str, server_loop: BackgroundLoop, engine
    ):
        self.session, self.url, self.server_loop, self.engine = session, url, server_loop, engine

    async def on_server(self, fn: Callable[[], T]) -> T:
        future = asyncio.run_coroutine_threadsafe(_call(fn), self.server_loop.loop)
        return await asyncio.wrap_future(future)

    async def until(self, what: str, predicate: Callable[[], bool], limit: float = 60) -> None:
        """Wait until `predicate` (run on the server's loop) holds; fail after `limit` s."""
        deadline = time.monotonic() + limit
        while not await self.on_server(predicate):
            assert time.monotonic() < deadline, f"still not {what} after {limit} s"
            await asyncio.sleep(0.02)

    def sequence(self, sequence_id: str):
        return self.engine.scheduler.get(sequence_id)

    async def output_tokens(self, sequence_id: str) -> int:
        """The tokens the sequence has so far; it must still be in the engine."""

        def count() -> int:
            request = self.sequence(sequence_id)
            assert request is not None, f"{sequence_id} has ended"
            return request.num_output_tokens

        return await self.on_server(count)

    async def until_generating(self, *sequence_ids: str) -> None:
        def generating() -> bool:
            found = [self.sequence(i) for i in sequence_ids]
            return all(r is not None and r.num_output_tokens > 0 for r in found)

        await self.until(f"generating {sequence_ids}", generating)

    async def until_parked_with(self, sequence_id: str) -> None:
        """Until the engine holds `sequence_id` and its loop, having gone round since the
        request came in (its wakeup taken), is parked: nothing will run until woken."""
        engine = self.engine

        def parked() -> bool:
            return (
                self.sequence(sequence_id) is not None
                and engine.loop_clock.parked
                and not engine._wakeup.is_set()
            )

        await self.until(f"parked with {sequence_id}", parked)

    async def call(self, method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
        async with self.session.request(method, self.url + path, **kwargs) as response:
            return response.status, await response.json(content_type=None)

    async def complete(
        self, request_id: str, max_tokens: int, prompt: list[int], **more: Any
    ) -> dict:
        """A whole (not streamed) /v1/completions answer; its engine request is
        "cmpl-<request_id>-0"."""
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **GREEDY}
        status, answer = await self.call(
            "POST",
            "/v1/completions",
            json={**body, "return_token_ids": True, **more},
            headers={"X-Request-Id": request_id},
        )
        assert status == 200, answer
        return answer

    async def stream(self, path: str, request_id: str, **fields: Any) -> list[dict]:
        """Every event of a streamed answer (with its token ids); it must end with [DONE]."""
        body = {"model": MODEL, "stream": True, "return_token_ids": True, **GREEDY, **fields}
        headers = {"X-Request-Id": request_id}
        async with self.session.post(self.url + path, json=body, headers=headers) as response:
            assert response.status == 200, await response.text()
            raw = await response.read()
        assert raw.endswith(b"data: [DONE]\n\n"), raw[-300:]
        frames = raw.removesuffix(b"data: [DONE]\n\n").split(b"\n\n")
        return [json.loads(f.removeprefix(b"data: ")) for f in frames if f]

    async def metrics(self) -> list:
        return await read_metrics_with(self.session, self.url)


def play(server_loop, engine, url: str, scenario: Callable[[Scene], Any]) -> None:
    async def run() -> None:
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await scenario(Scene(session, url, server_loop, engine))

    asyncio.run(run())


def _streamed_tokens(events: list[dict]) -> list[int]:
    return [t for e in events for choice in e["choices"] for t in choice.get("token_ids") or []]


def _finish_reasons(events: list[dict]) -> list[str]:
    return [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]


async def _send_while_paused(scene: Scene, prompt: list[int]) -> asyncio.Future:
    """A request sent while paused ("held"): once the loop has gone round since it came
    in, and parked, it is queued without a token."""
    held = asyncio.ensure_future(scene.complete("held", SHORT, prompt))
    await scene.until_parked_with("cmpl-held-0")
    await _still_held(scene, held)
    return held


async def _still_held(scene: Scene, held: asyncio.Future) -> None:
    assert await scene.output_tokens("cmpl-held-0") == 0
    assert await scene.on_server(lambda: scene.sequence("cmpl-held-0").status) is (
        RequestStatus.WAITING
    )
    assert not held.done()


async def _resume(scene: Scene, held: asyncio.Future, reference: list[int]) -> None:
    """/resume: the held request then runs to its end."""
    assert await scene.call("GET", "/is_paused") == (200, {"is_paused": True})
    async with scene.session.get(scene.url + "/health") as health:
        assert health.status == 200  # paused is healthy, as in vLLM
    assert await scene.call("POST", "/resume") == (200, {"status": "resumed"})
    assert await scene.call("GET", "/is_paused") == (200, {"is_paused": False})
    choice = (await held)["choices"][0]
    assert choice["finish_reason"] == "length" and choice["token_ids"] == reference


def test_abort_mode_ends_the_requests_in_flight_and_holds_new_ones(
    dev_server, server_loop, engine, prompt, reference
):
    async def scenario(scene: Scene) -> None:
        before = await scene.metrics()
        streamed = asyncio.ensure_future(
            scene.stream(
                "/v1/chat/completions",
                "s",
                messages=[{"role": "user", "content": "Tell me a long story."}],
                max_tokens=LONG,
            )
        )
        whole = asyncio.ensure_future(scene.complete("w", LONG, prompt))
        await scene.until_generating("chatcmpl-s", "cmpl-w-0")
        assert await scene.call("POST", "/pause") == (200, {"status": "paused"})  # abort

        events = await streamed  # the stream ends: a last chunk saying "abort", then [DONE]
        assert _finish_reasons(events) == ["abort"]
        assert events[-1]["choices"][0]["finish_reason"] == "abort"
        assert 0 < sum(bool(e["choices"][0]["delta"].get("content")) for e in events) < LONG
        answer = await whole  # the whole answer: what was generated, finish_reason "abort"
        assert answer["choices"][0]["finish_reason"] == "abort"
        assert 0 < answer["usage"]["completion_tokens"] < LONG
        tokens = answer["choices"][0]["token_ids"]
        assert tokens[: len(reference)] == reference[: len(tokens)]
        kv = engine.kv_cache
        assert await scene.on_server(lambda: kv.num_free_blocks) == kv.num_blocks
        after = await scene.metrics()
        # Recorded as finished, as vLLM's engine core sends these aborts back.
        assert (
            metric(after, SUCCESS, finished_reason="abort")
            - metric(before, SUCCESS, finished_reason="abort")
            == 2
        )

        await _resume(scene, await _send_while_paused(scene, prompt), reference)

    play(server_loop, engine, dev_server, scenario)


def test_keep_mode_freezes_the_requests_with_their_blocks_until_resumed(
    dev_server, server_loop, engine, prompt, reference
):
    async def scenario(scene: Scene) -> None:
        streamed = asyncio.ensure_future(
            scene.stream("/v1/completions", "s", prompt=prompt, max_tokens=SHORT)
        )
        whole = asyncio.ensure_future(scene.complete("w", SHORT, prompt))
        await scene.until_generating("cmpl-s-0", "cmpl-w-0")
        reply = await scene.call("POST", "/pause?mode=keep&clear_cache=false")
        assert reply == (200, {"status": "paused"})
        made = {i: await scene.output_tokens(i) for i in ("cmpl-s-0", "cmpl-w-0")}
        assert all(0 < n < SHORT for n in made.values()), made  # frozen mid-way

        held = asyncio.ensure_future(scene.complete("held", SHORT, prompt))
        await scene.until_parked_with("cmpl-held-0")
        for sequence_id, count in made.items():  # not one step since the pause
            assert await scene.output_tokens(sequence_id) == count
            assert await scene.on_server(lambda i=sequence_id: scene.sequence(i).status) is (
                RequestStatus.RUNNING
            )
        assert await scene.output_tokens("cmpl-held-0") == 0
        kv = engine.kv_cache
        assert await scene.on_server(lambda: kv.num_free_blocks) < kv.num_blocks  # KV kept
        assert not streamed.done() and not whole.done() and not held.done()

        assert await scene.call("POST", "/resume") == (200, {"status": "resumed"})
        events = await streamed
        assert _finish_reasons(events) == ["length"]
        assert _streamed_tokens(events) == reference
        for answer in (await whole, await held):
            choice = answer["choices"][0]
            assert choice["finish_reason"] == "length" and choice["token_ids"] == reference

    play(server_loop, engine, dev_server, scenario)


def test_keep_mode_clearing_the_cache_makes_the_frozen_requests_compute_again(
    dev_server, server_loop, engine, prompt, reference
):
    """vLLM 0.32's engine core clears the cache in "keep" too (its route's docstring says
    it would not): the running requests are preempted, their blocks freed, and they
    compute their KV again once resumed."""

    async def scenario(scene: Scene) -> None:
        whole = asyncio.ensure_future(scene.complete("w", SHORT, prompt))
        await scene.until_generating("cmpl-w-0")
        assert await scene.call("POST", "/pause?mode=keep") == (200, {"status": "paused"})
        kv = engine.kv_cache
        assert await scene.on_server(lambda: kv.num_free_blocks) == kv.num_blocks
        request = await scene.on_server(lambda: scene.sequence("cmpl-w-0"))
        assert request.status is RequestStatus.PREEMPTED and 0 < request.num_output_tokens
        assert not whole.done()
        assert await scene.call("POST", "/resume") == (200, {"status": "resumed"})
        choice = (await whole)["choices"][0]
        assert choice["finish_reason"] == "length" and choice["token_ids"] == reference

    play(server_loop, engine, dev_server, scenario)


def test_wait_mode_answers_once_the_running_requests_are_done(
    dev_server, server_loop, engine, prompt, reference
):
    """Frozen first ("keep"), so that they are surely mid-way when "wait" lets them go on."""

    async def scenario(scene: Scene) -> None:
        streamed = asyncio.ensure_future(
            scene.stream("/v1/completions", "s", prompt=prompt, max_tokens=SHORT)
        )
        whole = asyncio.ensure_future(scene.complete("w", SHORT, prompt))
        await scene.until_generating("cmpl-s-0", "cmpl-w-0")
        await scene.call("POST", "/pause?mode=keep&clear_cache=false")
        assert await scene.output_tokens("cmpl-w-0") < SHORT
        held = await _send_while_paused(scene, prompt)
        assert await scene.call("POST", "/pause?mode=wait") == (200, {"status": "paused"})
        # Answered once both had run to their end; the held request did not start.
        assert await scene.on_server(lambda: scene.engine.num_unfinished_requests) == 1
        await _still_held(scene, held)
        events = await streamed
        assert _finish_reasons(events) == ["length"]
        assert _streamed_tokens(events) == reference
        choice = (await whole)["choices"][0]
        assert choice["finish_reason"] == "length" and choice["token_ids"] == reference

        await _resume(scene, held, reference)

    play(server_loop, engine, dev_server, scenario)


def test_abort_requests_by_id_then_all(dev_server, server_loop, engine, prompt, reference):
    async def scenario(scene: Scene) -> None:
        before = await scene.metrics()
        chat = asyncio.ensure_future(
            scene.stream(
                "/v1/chat/completions",
                "a",
                messages=[{"role": "user", "content": "Count to a thousand."}],
                max_tokens=LONG,
            )
        )
        pair = asyncio.ensure_future(scene.complete("b", LONG, prompt, n=2, temperature=1))
        await scene.until_generating("chatcmpl-a", "cmpl-b-0#0", "cmpl-b-0#1")

        reply = await scene.call(
            "POST", "/abort_requests", json={"request_ids": ["chatcmpl-a", "nobody"]}
        )
        assert reply == (200, {"status": "aborted", "aborted": 2})  # each id given counts
        assert _finish_reasons(await chat) == ["abort"]
        assert not pair.done()
        progress = await scene.output_tokens("cmpl-b-0#0")
        await scene.until(
            "generating on", lambda: scene.sequence("cmpl-b-0#0").num_output_tokens > progress
        )

        # Everything in flight: the n = 2 request's two sequences and its parent, as vLLM counts.
        assert await scene.call("POST", "/abort_requests", json={}) == (
            200,
            {"status": "aborted", "aborted": 3},
        )
        answer = await pair
        assert [c["finish_reason"] for c in answer["choices"]] == ["abort", "abort"]
        kv = engine.kv_cache
        assert await scene.on_server(lambda: kv.num_free_blocks) == kv.num_blocks
        after = await scene.metrics()
        # As a client's abort, not recorded as finished requests (vLLM's engine.abort).
        assert metric(after, SUCCESS, finished_reason="abort") == metric(
            before, SUCCESS, finished_reason="abort"
        )
        assert await scene.call("GET", "/is_paused") == (200, {"is_paused": False})
        choice = (await scene.complete("after", SHORT, prompt))["choices"][0]
        assert choice["token_ids"] == reference  # not paused: it runs

    play(server_loop, engine, dev_server, scenario)


MODE_ERROR = (
    "{'type': 'literal_error', 'loc': 'query.mode', 'msg': \"Input should be 'abort', 'wait' "
    "or 'keep'\", 'input': 'stop', 'ctx': {'expected': \"'abort', 'wait' or 'keep'\"}}"
)
CLEAR_CACHE_ERROR = (
    "{'type': 'bool_parsing', 'loc': 'query.clear_cache', 'msg': 'Input should be a valid "
    "boolean, unable to interpret input', 'input': 'maybe'}"
)


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("mode=stop", validation_error_body(MODE_ERROR, param="query.mode")),
        ("clear_cache=maybe", validation_error_body(CLEAR_CACHE_ERROR, param="query.clear_cache")),
        (
            "mode=stop&clear_cache=maybe",
            validation_error_body(MODE_ERROR, CLEAR_CACHE_ERROR, param="query.mode"),
        ),
    ],
)
def test_a_bad_pause_query_is_vllms_validation_400(
    dev_server, server_loop, engine, query, expected
):
    async def scenario(scene: Scene) -> None:
        assert await scene.call("POST", "/pause?" + query) == (400, expected)
        assert await scene.call("GET", "/is_paused") == (200, {"is_paused": False})

    play(server_loop, engine, dev_server, scenario)


def _bad_request(message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": "Bad Request", "param": param, "code": 400}}


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"", _bad_request("Invalid JSON format")),
        (b"{not json", _bad_request("Invalid JSON format")),
        (b"[]", _bad_request("Request body must be a JSON object")),
        (
            b'{"request_ids": 5}',
            _bad_request("request_ids must be a list of request ids (strings)", "request_ids"),
        ),
    ],
)
def test_a_bad_abort_body_is_a_400(dev_server, server_loop, engine, raw, expected):
    async def scenario(scene: Scene) -> None:
        assert await scene.call("POST", "/abort_requests", data=raw) == (400, expected)

    play(server_loop, engine, dev_server, scenario)


def test_pausing_an_idle_server_in_each_mode(dev_server, server_loop, engine):
    async def scenario(scene: Scene) -> None:
        for query in ("?mode=wait", "?mode=keep", "?mode=abort&clear_cache=0", ""):
            assert await scene.call("POST", "/pause" + query) == (200, {"status": "paused"})
            assert await scene.call("GET", "/is_paused") == (200, {"is_paused": True})
        assert await scene.call("POST", "/resume") == (200, {"status": "resumed"})
        assert await scene.call("POST", "/resume") == (200, {"status": "resumed"})
        assert await scene.call("GET", "/is_paused") == (200, {"is_paused": False})
        paths = (await scene.call("GET", "/openapi.json"))[1]["paths"]
        assert {"/pause", "/resume", "/is_paused", "/abort_requests"} <= set(paths)

    play(server_loop, engine, dev_server, scenario)


ROUTES = [
    ("POST", "/pause"),
    ("POST", "/resume"),
    ("GET", "/is_paused"),
    ("POST", "/abort_requests"),
]


def test_with_an_api_key_the_routes_want_it(server_loop, engine, monkeypatch):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with serve_built(server_loop, engine, "--api-key", "s3cret") as url:

        async def scenario(scene: Scene) -> None:
            for method, path in ROUTES:
                assert (await scene.call(method, path, json={}))[0] == 401, path
            headers = {"Authorization": "Bearer s3cret"}
            assert await scene.call("GET", "/is_paused", headers=headers) == (
                200,
                {"is_paused": False},
            )

        play(server_loop, engine, url, scenario)


def test_without_dev_mode_there_are_no_routes(server_loop, engine, monkeypatch):
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with serve_built(server_loop, engine) as url:

        async def scenario(scene: Scene) -> None:
            for method, path in ROUTES:
                assert (await scene.call(method, path, json={}))[0] == 404, path

        play(server_loop, engine, url, scenario)
