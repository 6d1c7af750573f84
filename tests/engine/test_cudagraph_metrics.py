"""--cudagraph-metrics in a built engine: each model step's CUDAGraphStat, as the runner ran
it, reaches the stat loggers, and the server's stats line tabulates them.

Three prompts of 6, 3 and 7 tokens run in one 16-token step (vLLM counts a prefill step
too, unpadded, mode NONE), then five decode steps of three sequences: padded to the one
decode size, 4, when there is one. The CPU captures no graph, so a padded step is "NONE"
too (runner/cudagraph_stats.py). The padded steps are also counted where the runner runs
them (tests/runner/plans.py `record_padded_sizes`).
"""

from __future__ import annotations

import logging
from collections import Counter

import pytest

from aioserve import LLM, SamplingParams
from aioserve.engine.settings import EngineSettings
from aioserve.engine.stats import StepStats
from aioserve.runner.cudagraph_stats import CUDAGraphSettings, CUDAGraphStat
from aioserve.runner.pooling_runner import PoolingRunner
from aioserve.server.stats_log import engine_stats_line
from tests.models.tiny_models import save_tiny_model, tiny_llama_config
from tests.runner.plans import record_padded_sizes

PROMPTS = [[5, 17, 99, 3, 42, 7], [8, 1, 200], [31, 64, 2, 2, 90, 11, 13]]
NEW_TOKENS = 6
PREFILL = CUDAGraphStat(16, 16, 0, "NONE")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_model(tiny_llama_config(), tmp_path_factory.mktemp("tiny_llama"))


class _Recorder:
    """A stat logger that keeps each step's CUDAGraphStat."""

    def __init__(self) -> None:
        self.stats: list[CUDAGraphStat | None] = []

    def record(self, stats: StepStats) -> None:
        self.stats.append(stats.cudagraph)


def _run(folder, caplog, **options) -> tuple[EngineSettings, list[CUDAGraphStat | None], list[str]]:
    """Generate from PROMPTS with `options`, then log the stats line once: the engine's
    settings, each step's stat and the lines logged."""
    llm = LLM(
        model=str(folder),
        dtype="float32",
        max_model_len=256,
        block_size=16,
        max_num_seqs=8,
        skip_tokenizer_init=True,
        **options,
    )
    settings = llm.engine.settings
    try:
        recorder, line = _Recorder(), engine_stats_line(settings)
        llm.engine.stat_loggers.extend([recorder, line])
        padded = []
        if llm.engine.runner.decode_graphs is not None:
            padded = record_padded_sizes(llm.engine.runner)
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        prompts = [{"prompt_token_ids": prompt} for prompt in PROMPTS]
        llm.generate(prompts, params, use_tqdm=False)
        assert padded == [4] * (NEW_TOKENS - 1) or not padded
        with caplog.at_level(logging.INFO, logger="aioserve.stats"):
            line.log()
    finally:
        llm.close()
    return settings, recorder.stats, [r.getMessage() for r in caplog.records]


def test_padded_decodes_and_the_prefill_are_counted_and_logged(tiny_folder, caplog):
    _, stats, lines = _run(
        tiny_folder,
        caplog,
        cudagraph_metrics=True,
        compilation_config={"level": 0, "cudagraph_capture_sizes": [4]},
    )
    decode = CUDAGraphStat(3, 4, 1, "NONE")
    assert Counter(stats) == {PREFILL: 1, decode: NEW_TOKENS - 1}
    assert stats[0] == PREFILL
    assert len(lines) == 2 and lines[0].startswith("Engine 000: Avg prompt throughput")
    assert lines[1] == (
        "**CUDAGraph Config Settings:**\n\n"
        "- Mode: NONE\n"
        "- Capture sizes: [4]\n\n"
        "**CUDAGraph Stats:**\n\n"
        "| Unpadded Tokens | Padded Tokens | Num Paddings | Runtime Mode | Count |\n"
        "|-----------------|---------------|--------------|--------------|-------|\n"
        "| 3               | 4             | 1            | NONE         | 5     |\n"
        "| 16              | 16            | 0            | NONE         | 1     |\n"
    )


def test_under_enforce_eager_every_step_runs_unpadded(tiny_folder, caplog):
    _, stats, lines = _run(
        tiny_folder, caplog, cudagraph_metrics=True, enforce_eager=True, cuda_graph_sizes=[4]
    )
    assert Counter(stats) == {PREFILL: 1, CUDAGraphStat(3, 3, 0, "NONE"): NEW_TOKENS - 1}
    assert lines[1].startswith(
        "**CUDAGraph Config Settings:**\n\n- Mode: NONE\n- Capture sizes: []\n\n"
    )


def test_without_the_flag_nothing_is_observed_or_logged(tiny_folder, caplog):
    settings, stats, lines = _run(
        tiny_folder, caplog, compilation_config={"level": 0, "cudagraph_capture_sizes": [4]}
    )
    assert settings.observability.cudagraphs is None
    assert len(stats) == NEW_TOKENS and not any(stats)
    assert len(lines) == 1 and lines[0].startswith("Engine 000: Avg prompt throughput")


def test_a_pooling_step_runs_its_prompts_unpadded():
    step = PoolingRunner._pack(["a", "b"], [[1, 2, 3], [4, 5]])
    assert PoolingRunner.graph_stat(step) == CUDAGraphStat(5, 5, 0, "NONE")
    assert PoolingRunner.graph_settings == CUDAGraphSettings("NONE", ())
