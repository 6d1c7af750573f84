"""The model step compiled by torch.compile gives the greedy tokens of the eager step.

Each tiny architecture runs the same chunked, mixed prefill/decode schedule on a compiled
and an eager runner with the same weights (float32); the greedy tokens must be equal. A
compile failure must leave a working eager step and a warning naming the cause.
"""

from __future__ import annotations

import logging

import pytest

from aioserve.runner import compiled_step
from tests.runner.plans import PlanMaker, run_step, tiny_runner
from tests.runner.test_model_runner import greedy_run

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "config_name", ["llama-gqa4-llama3-rope", "mistral", "qwen2-tied", "qwen3"]
)
def test_compiled_greedy_tokens_equal_eager(config_name):
    _, eager = tiny_runner(config_name)
    _, compiled = tiny_runner(config_name, compile_model=True)
    compiled.warm_up()
    assert compiled.model_step.compiled
    assert greedy_run(compiled, 4, 8, known=False) == greedy_run(eager, 4, 8, known=False)


def test_a_failed_compile_leaves_an_eager_step_and_says_why(monkeypatch, caplog):
    def broken(fn):
        def run(*args, **kwargs):
            raise RuntimeError("no C++ compiler found")

        return run

    monkeypatch.setattr(compiled_step, "_compile", broken)
    _, runner = tiny_runner(compile_model=True)
    with caplog.at_level(logging.WARNING, logger="aioserve"):
        runner.warm_up()
    assert not runner.model_step.compiled
    assert (
        "compiling the model step failed, running it eagerly: RuntimeError: no C++ compiler found"
        in caplog.text
    )
    maker = PlanMaker(4, 64)
    maker.admit("s", [5, 6, 7, 8])
    assert len(run_step(runner, maker.plan([("s", 4)])).sampled["s"]) == 1
