"""vLLM arguments that aioserve honours at the one value it runs with: the parallel sizes at 1
(-tp/-pp/-dp, what vLLM scripts and systemd units often spell out), the "uni" executor,
recompute preemption and cascade attention off. Any other value is refused at start-up with
a message naming the flag and the value; parsing through `serve`'s own parser and through
LLM(**kwargs) gives the same answers.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from aioserve.config.declaration import ConfigError
from aioserve.config.engine import engine_config_from_args, engine_config_from_kwargs
from aioserve.config.parser import UNSUPPORTED_GROUP_TITLE, add_engine_arguments


@pytest.fixture(autouse=True)
def _default_kvcache_env(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="test", allow_abbrev=False)
    add_engine_arguments(parser)
    return parser


def _config(*argv: str):
    return engine_config_from_args(_parser().parse_args(list(argv)))


@pytest.mark.parametrize(
    "argv",
    [
        ["-tp", "1", "-pp", "1", "-dp", "1"],
        ["--tensor-parallel-size", "1", "--pipeline-parallel-size=1", "--data-parallel-size", "1"],
        ["--distributed-executor-backend", "uni", "--tensor-parallel-size", "1"],
    ],
)
def test_one_device_values_are_accepted(argv):
    config = _config(*argv)
    parallel = config.parallel
    assert (parallel.tensor_parallel_size, parallel.pipeline_parallel_size) == (1, 1)
    assert parallel.data_parallel_size == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-tp", "2"], "--tensor-parallel-size 2: tensor parallelism is not supported"),
        (["-pp", "4"], "--pipeline-parallel-size 4: pipeline parallelism is not supported"),
        (["-dp", "0"], "--data-parallel-size 0: data parallelism is not supported"),
        (["-tp", "two"], "--tensor-parallel-size must be an integer, got 'two'"),
        (
            ["--distributed-executor-backend", "mp"],
            "executor backend 'mp' is not supported by aioserve yet "
            "(--distributed-executor-backend accepts uni)",
        ),
        (
            ["--distributed-executor-backend", "torchrun"],
            "--distributed-executor-backend must be one of uni; got 'torchrun'",
        ),
        (
            ["--preemption-mode", "swap"],
            "preemption mode 'swap' is not supported by aioserve yet "
            "(--preemption-mode accepts recompute)",
        ),
        (["--no-disable-cascade-attn"], "--disable-cascade-attn false asks for cascade attention"),
    ],
)
def test_other_values_are_refused_naming_the_flag(argv, message):
    with pytest.raises(ConfigError) as error:
        _config(*argv)
    assert message in str(error.value)


def test_every_problem_of_a_command_line_is_reported_at_once():
    with pytest.raises(ConfigError) as error:
        _config("-tp", "2", "-pp", "2", "--preemption-mode", "swap")
    text = str(error.value)
    assert "--tensor-parallel-size 2" in text and "--pipeline-parallel-size 2" in text
    assert "'swap'" in text


def test_recompute_and_cascade_off_are_accepted():
    config = _config("--preemption-mode", "recompute", "--disable-cascade-attn")
    assert config.scheduler.preemption_mode == "recompute"
    assert config.model.disable_cascade_attn is True


def test_keywords_take_the_same_values():
    config = engine_config_from_kwargs(
        tensor_parallel_size=1, pipeline_parallel_size=1, distributed_executor_backend="uni"
    )
    assert config.parallel.distributed_executor_backend == "uni"
    with pytest.raises(ValueError, match=r"^tensor_parallel_size 8: tensor parallelism"):
        engine_config_from_kwargs(tensor_parallel_size=8)


def test_help_lists_them_as_supported():
    text = _parser().format_help()
    unsupported = text[text.index(f"\n{UNSUPPORTED_GROUP_TITLE}:") :]
    for flag in ("--tensor-parallel-size", "--preemption-mode", "--disable-cascade-attn"):
        assert flag in text and flag not in unsupported
    assert "--data-parallel-rank" in unsupported


def test_serve_warns_of_the_cascade_flag_in_vllms_words(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "aioserve",
            "serve",
            str(tmp_path / "absent"),
            "--disable-cascade-attn",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert "--disable-cascade-attn is deprecated and has no effect" in output
    assert done.returncode == 2  # the absent model, after the warning
