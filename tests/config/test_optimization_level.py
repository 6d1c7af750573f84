"""vLLM 0.32's --optimization-level (-O) and --performance-mode: every spelling of the
level, the older -O forms that still set --compilation-config, the level's defaults and the
explicit settings that win over them, and what each performance mode changes (the batch
defaults, the decode sizes), against vLLM 0.32's rules written out here.

That an -O0 engine runs its step uncompiled is tests/engine/test_compilation_config_engine.py's;
the throughput mode's batch limits in an engine, tests/engine/test_performance_mode_engine.py's.
"""

from __future__ import annotations

import pytest

from aioserve.cli import build_engine_parser
from aioserve.config.compilation import CompilationSettings
from aioserve.config.declaration import ConfigError
from aioserve.config.engine import CompilationConfig, engine_config_from_args
from aioserve.engine import resolution
from aioserve.runner.decode_graphs import capture_sizes


@pytest.fixture(autouse=True)
def _default_kvcache_env(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)


def _compilation(*argv: str) -> CompilationConfig:
    args = build_engine_parser("aioserve serve").parse_args(list(argv))
    return engine_config_from_args(args).compilation


# --- the command line --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "level"),
    [
        ([], 2),  # vLLM 0.32's default
        (["-O0"], 0),
        (["-O=1"], 1),
        (["-O", "2"], 2),
        (["-O3"], 3),
        (["--optimization-level", "3"], 3),
        (["--optimization-level=0"], 0),
    ],
)
def test_every_spelling_of_the_level(argv, level):
    assert _compilation(*argv).optimization_level == level


@pytest.mark.parametrize(
    ("argv", "settings"),
    [
        # Not levels, so the older vLLM's --compilation-config, as its documentation says.
        (["-O", '{"level": 1}'], CompilationSettings(level=1)),
        (['-O={"level": 1}'], CompilationSettings(level=1)),
        (["-O.level=1"], CompilationSettings(level=1)),
        (["-O.cudagraph_mode", "NONE"], CompilationSettings(level=3, cudagraph_mode="NONE")),
    ],
)
def test_dash_o_with_json_or_a_key_still_sets_the_compilation_config(argv, settings):
    compilation = _compilation(*argv)
    assert compilation.optimization_level == 2
    assert compilation.compilation_config == settings


@pytest.mark.parametrize(
    "argv",
    [["-O4"], ["-O=4"], ["-O", "4"], ["--optimization-level", "4"]],
)
def test_a_level_past_3_is_refused_naming_the_flag(argv):
    with pytest.raises(
        ConfigError, match=r"^--optimization-level must be one of 0, 1, 2, 3; got 4$"
    ):
        _compilation(*argv)


def test_a_level_that_is_no_number_and_a_bare_dash_o_are_refused(capsys):
    with pytest.raises(ConfigError, match=r"^--optimization-level must be an integer, got 'fast'"):
        _compilation("-Ofast")
    with pytest.raises(SystemExit):
        _compilation("-O")
    assert "argument --optimization-level/-O: expected one argument" in capsys.readouterr().err


def test_a_performance_mode_outside_vllms_three_is_refused():
    assert _compilation().performance_mode == "balanced"
    assert _compilation("--performance-mode", "interactivity").performance_mode == "interactivity"
    with pytest.raises(ConfigError, match="^--performance-mode must be one of balanced, inter"):
        _compilation("--performance-mode", "fast")


# --- the level's defaults, and what wins over them ----------------------------------------


@pytest.mark.parametrize(
    ("argv", "settings"),
    [
        # 0: nothing compiled, no graphs (vLLM: mode NONE, cudagraph_mode NONE).
        (["-O0"], CompilationSettings(level=0, cudagraph_mode="NONE")),
        # 1 to 3: vLLM's VLLM_COMPILE mode (3), aioserve's one kind of graph.
        (["-O1"], CompilationSettings(level=3)),
        (["-O2"], CompilationSettings(level=3)),
        (["-O3"], CompilationSettings(level=3)),
        # What is given wins over the level's defaults.
        (["-O0", "-cc.level=3"], CompilationSettings(level=3, cudagraph_mode="NONE")),
        (["-O3", "-cc.level=0"], CompilationSettings(level=0)),
        (["-O0", "-cc.cudagraph_mode=FULL_DECODE_ONLY"],
         CompilationSettings(level=0, cudagraph_mode="FULL_DECODE_ONLY")),
        (["-O0", "-cc", '{"use_cudagraph": true}'],
         CompilationSettings(level=0, cudagraph_mode="FULL_DECODE_ONLY")),
        # Sizes given ask for graphs.
        (["-O0", "--cudagraph-capture-sizes", "2", "4"],
         CompilationSettings(level=0, cudagraph_capture_sizes=(2, 4))),
        (["-O0", "--max-cudagraph-capture-size", "4"],
         CompilationSettings(level=0, max_capture_size=4)),
        (["-O0", "--cuda-graph-sizes", "4"], CompilationSettings(level=0)),
    ],
)  # fmt: skip
def test_the_levels_defaults_fill_what_is_not_given(argv, settings):
    assert _compilation(*argv).compilation_config == settings


@pytest.mark.parametrize(
    ("argv", "compiles", "sizes"),
    [
        (["-O0"], False, []),
        (["-O1"], True, [1, 2, 4, 8]),
        ([], True, [1, 2, 4, 8]),
        (["-O0", "-cc.cudagraph_mode=FULL_DECODE_ONLY"], False, [1, 2, 4, 8]),
        (["-O0", "--cuda-graph-sizes", "4"], False, [1, 2, 4]),
        (["-O3", "-cc.level=0"], False, [1, 2, 4, 8]),
    ],
)
def test_what_a_gpu_engine_compiles_and_captures(monkeypatch, argv, compiles, sizes):
    monkeypatch.setattr(resolution, "current_platform", lambda: "cuda")
    args = build_engine_parser("aioserve serve").parse_args(list(argv))
    config = engine_config_from_args(args)
    settings = config.compilation.compilation_config
    assert settings.compiles is compiles
    requested = config.scheduler.cuda_graph_sizes
    assert resolution.resolve_decode_graph_sizes(requested, 8, False, settings) == sizes


# --- --performance-mode ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("platform", "serving", "seqs", "tokens"),
    [
        ("cpu", False, 256, 4096),  # vLLM-CPU's LLM class
        ("cpu", True, 128, 2048),  # vLLM-CPU's server
        ("cuda", True, 256, 8192),
    ],
)
def test_throughput_doubles_the_batch_defaults(platform, serving, seqs, tokens):
    for mode, factor in (("balanced", 1), ("interactivity", 1), ("throughput", 2)):
        assert resolution.batch_default("max_num_seqs", platform, serving, mode) == factor * seqs
        tokens_default = resolution.batch_default("max_num_batched_tokens", platform, serving, mode)
        assert tokens_default == factor * tokens


def _vllm_interactivity_sizes(largest: int) -> list[int]:
    """vLLM 0.32's default capture sizes in interactivity mode (VllmConfig's
    _set_cudagraph_sizes), below 256 where its list and aioserve's share their pattern."""
    sizes = list(range(1, min(largest, 32) + 1))
    if largest >= 8:
        sizes += range(8, min(largest + 1, 256), 8)
    return sorted(set(sizes))


@pytest.mark.parametrize("largest", [1, 3, 4, 7, 8, 20, 31, 32, 33, 64, 100, 255])
def test_interactivity_makes_the_small_sizes_every_size(largest):
    fine = capture_sizes([largest], 1024, fine_grained=True)
    assert fine == _vllm_interactivity_sizes(largest)


def test_interactivity_changes_the_default_sizes_only(monkeypatch):
    monkeypatch.setattr(resolution, "current_platform", lambda: "cuda")
    default = CompilationSettings(level=3)
    exact = CompilationSettings(level=3, cudagraph_capture_sizes=(2, 6))

    def sizes(requested, settings, mode):
        return resolution.resolve_decode_graph_sizes(requested, 48, False, settings, mode)

    # 48 sequences: the default largest size min(2 * 48, 512), cut at 48.
    assert sizes([], default, "interactivity") == [*range(1, 33), 40, 48]
    assert sizes([], default, "balanced") == [1, 2, 4, *range(8, 49, 8)]
    assert sizes([], exact, "interactivity") == [2, 6]
    assert sizes([3, 9], default, "interactivity") == [3, 9]
