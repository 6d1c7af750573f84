"""--collect-detailed-traces in the engine: which step times a request gets, and from which
steps (over the wire, in the spans: tests/server/test_detailed_traces.py).

The engines here are a tiny random Llama (and MiniLM for pooling), configured from a
command line as `aioserve serve` builds them: the flag needs --otlp-traces-endpoint, which
the engine itself does not use.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest

from aioserve import AsyncEngine
from aioserve.config.engine import engine_config_from_args
from aioserve.config.parser import build_engine_parser
from aioserve.engine import step_timing
from aioserve.engine.pooling_params import PoolingParams
from aioserve.engine.sampling_params import SamplingParams
from aioserve.runner import forward_timer
from tests.models.tiny_models import save_tiny_model, tiny_llama_config

ENDPOINT = "http://127.0.0.1:9/v1/traces"  # never reached: the engine sends nothing


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_model(tiny_llama_config(), tmp_path_factory.mktemp("tiny_llama"))


def _engine(model, modules: str | None, *more: str) -> AsyncEngine:
    argv = ["--model", str(model), "--dtype", "float32", "--max-model-len", "128"]
    argv += ["--enforce-eager", "--skip-tokenizer-init", *more]
    if modules is not None:
        argv += ["--collect-detailed-traces", modules, "--otlp-traces-endpoint", ENDPOINT]
    args = build_engine_parser("aioserve serve").parse_args(argv)
    return AsyncEngine.from_config(engine_config_from_args(args, serving=True))


async def _last(engine: AsyncEngine, request_id: str, prompt: list[int], **params):
    params.setdefault("ignore_eos", True)
    params.setdefault("temperature", 0.0)
    sampling = SamplingParams(**params)
    async for output in engine.generate({"prompt_token_ids": prompt}, sampling, request_id):
        last = output
    return last


def _times(modules: str | None, folder) -> tuple[float | None, float | None, bool]:
    """A request's forward and execute times on an engine with `modules`, and whether the
    engine wrapped its model step for the forward timer."""
    engine = _engine(folder, modules)

    async def run():
        try:
            return await _last(engine, "r", [1, 2, 3, 4, 5], max_tokens=4)
        finally:
            await engine.shutdown()

    output = asyncio.run(run())
    wrapped = "forward_and_logits" in vars(engine.runner.model_step)
    return output.metrics.model_forward_time, output.metrics.model_execute_time, wrapped


@pytest.mark.parametrize(
    ("modules", "forward", "execute"),
    [
        ("model", True, False),
        ("worker", False, True),
        ("all", True, True),
        ("worker,model", True, True),
        (None, False, False),
    ],
)
def test_each_module_adds_its_time_and_only_its_own(tiny_folder, modules, forward, execute):
    forward_s, execute_s, wrapped = _times(modules, tiny_folder)
    assert (forward_s is not None, execute_s is not None) == (forward, execute)
    assert wrapped == forward  # without "model" the runner's calls are the plain ones
    for seconds in (forward_s, execute_s):
        assert seconds is None or 0 < seconds < 60
    if forward and execute:
        assert forward_s <= execute_s


def test_without_the_flag_no_step_is_timed(tiny_folder):
    engine = _engine(tiny_folder, None)
    try:
        assert engine._step_timer is None
        assert not (
            engine.settings.collect_model_forward_time or engine.settings.collect_model_execute_time
        )
    finally:
        asyncio.run(engine.shutdown())


def test_a_request_gets_the_times_of_the_steps_it_ran_in_once_each(tiny_folder, monkeypatch):
    """With a clock that moves by 1 at each reading, a step's execute reads it at its start
    and end, its forward in between: every step counts 1 of forward and 3 of execute. Each
    request's figures are then 1 and 3 times the number of steps it had a sequence in,
    counted from the schedule (a request with n = 2 counts each step once)."""
    ticks = itertools.count()
    monkeypatch.setattr(forward_timer, "mark", lambda events: float(next(ticks)))
    monkeypatch.setattr(step_timing, "mark", lambda events: float(next(ticks)))
    engine = _engine(tiny_folder, "all", "--max-num-batched-tokens", "16")
    steps: list[set[str]] = []
    schedule = engine.scheduler.schedule

    def recorded():
        output = schedule()
        if output.chunks:
            steps.append({c.request.request_id.split("#")[0] for c in output.chunks})
        return output

    engine.scheduler.schedule = recorded

    async def run():
        try:
            first = asyncio.ensure_future(_last(engine, "long", list(range(1, 30)), max_tokens=12))
            await asyncio.sleep(0)
            both = asyncio.ensure_future(
                _last(engine, "pair", [5, 6, 7], max_tokens=3, n=2, temperature=1.0, seed=1)
            )
            outputs = [await first, await both]
            outputs.append(await _last(engine, "late", [9, 8, 7, 6], max_tokens=5))
            return outputs
        finally:
            await engine.shutdown()

    outputs = asyncio.run(run())
    counts = {o.request_id: sum(o.request_id in step for step in steps) for o in outputs}
    assert counts["long"] > counts["late"] > 0 and counts["pair"] > 0
    for output in outputs:
        m = output.metrics
        assert (m.model_forward_time, m.model_execute_time) == (
            counts[output.request_id],
            3 * counts[output.request_id],
        ), output.request_id


def test_pooling_requests_get_the_times_too(minilm_folder):
    argv = ["--collect-detailed-traces", "model,worker", "--otlp-traces-endpoint", ENDPOINT]
    args = build_engine_parser("aioserve serve").parse_args(
        ["--model", str(minilm_folder), "--dtype", "float32", *argv]
    )
    engine = AsyncEngine.from_config(engine_config_from_args(args, serving=True))

    async def run():
        try:
            return await engine.encode("a short text to embed", PoolingParams(), "e")
        finally:
            await engine.shutdown()

    metrics = asyncio.run(run()).metrics
    assert 0 < metrics.model_forward_time <= metrics.model_execute_time
    assert metrics.model_execute_time <= metrics.finished_time - metrics.arrival_time
