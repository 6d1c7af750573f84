"""--compilation-config (-cc, and -O with JSON or a dotted key): the levels and JSON keys
aioserve honours, as the command line, the dotted keys and LLM(...) give them; every other
key and value refused by name; and the decode sizes each setting leads the engine to pad to.
What is not given is the default --optimization-level's (2: compiled, graphs): how the
levels fill it is tests/config/test_optimization_level.py's.

That a level-0 engine runs eagerly and a sized one pads its decodes, with transformers'
tokens, is tests/engine/test_compilation_config_engine.py's.
"""

from __future__ import annotations

import pytest

from aioserve.cli import build_engine_parser
from aioserve.config.compilation import CompilationSettings
from aioserve.config.declaration import ConfigError
from aioserve.config.engine import engine_config_from_args, engine_config_from_kwargs
from aioserve.engine import resolution


@pytest.fixture(autouse=True)
def _default_kvcache_env(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)


def _settings(*argv: str) -> CompilationSettings:
    args = build_engine_parser("aioserve serve").parse_args(list(argv))
    return engine_config_from_args(args).compilation.compilation_config


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], CompilationSettings(level=3)),
        (["-cc", "3"], CompilationSettings(level=3)),
        (["-cc", "0"], CompilationSettings(level=0)),
        (["--compilation-config", "1"], CompilationSettings(level=1)),
        (["--compilation-config", "2"], CompilationSettings(level=2)),
        (["-cc", '{"level": 0}'], CompilationSettings(level=0)),
        # The older vLLM's -O forms that cannot be a level still set --compilation-config.
        (["-O.level=0"], CompilationSettings(level=0)),
        (["-O.mode", "0"], CompilationSettings(level=0)),
        (["-O", '{"level": 3, "mode": 3}'], CompilationSettings(level=3)),
        (['-O={"level": 1}'], CompilationSettings(level=1)),
        (["-cc.cudagraph_mode=NONE"], CompilationSettings(level=3, cudagraph_mode="NONE")),
        (["-O", '{"cudagraph_mode": "FULL_DECODE_ONLY"}'],
         CompilationSettings(level=3, cudagraph_mode="FULL_DECODE_ONLY")),
        (["-cc", '{"use_cudagraph": false}'], CompilationSettings(level=3, cudagraph_mode="NONE")),
        (["-cc", '{"use_cudagraph": true}'],
         CompilationSettings(level=3, cudagraph_mode="FULL_DECODE_ONLY")),
        (["-cc", '{"cudagraph_capture_sizes": [8, 1, 4, 4]}'],
         CompilationSettings(level=3, cudagraph_capture_sizes=(1, 4, 8))),
        (["-O.max_capture_size=16"], CompilationSettings(level=3, max_capture_size=16)),
        (["-cc", '{"max_cudagraph_capture_size": 16, "cudagraph_capture_sizes": [2, 16]}'],
         CompilationSettings(level=3, cudagraph_capture_sizes=(2, 16), max_capture_size=16)),
    ],
)  # fmt: skip
def test_levels_and_keys_aioserve_honours(argv, expected):
    assert _settings(*argv) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("4", "--compilation-config level must be 0, 1, 2 or 3, got 4"),
        ('{"level": -1}', "--compilation-config key 'level' must be 0, 1, 2 or 3, got -1"),
        ('{"mode": "VLLM_COMPILE"}', "key 'mode' must be 0, 1, 2 or 3, got 'VLLM_COMPILE'"),
        ('{"level": 3, "mode": 0}', "keys 'level' and 'mode' name one setting and disagree"),
        ('{"cudagraph_mode": "PIECEWISE"}',
         "cudagraph_mode 'PIECEWISE' is not supported by aioserve yet: it captures whole decode "
         "steps only (it takes NONE, FULL_DECODE_ONLY)"),
        ('{"cudagraph_mode": "FULL_AND_PIECEWISE"}', "'FULL_AND_PIECEWISE' is not supported"),
        ('{"cudagraph_mode": "SOMETIMES"}',
         "key 'cudagraph_mode' must be one of NONE, FULL_DECODE_ONLY, got 'SOMETIMES'"),
        ('{"use_cudagraph": false, "cudagraph_mode": "FULL_DECODE_ONLY"}', "disagree"),
        ('{"use_cudagraph": "no"}', "key 'use_cudagraph' must be true or false"),
        ('{"cudagraph_capture_sizes": []}', "key 'cudagraph_capture_sizes' must be a list"),
        ('{"cudagraph_capture_sizes": [0, 4]}', "key 'cudagraph_capture_sizes' takes positive"),
        ('{"max_capture_size": 8, "cudagraph_capture_sizes": [2, 16]}',
         "max_capture_size (8) must be the largest of cudagraph_capture_sizes (16)"),
        ('{"inductor_compile_config": {}}', "key 'inductor_compile_config' is not supported by aioserve yet"),
        ('{"full_cuda_graph": true}', "key 'full_cuda_graph' is not supported by aioserve yet"),
        ('{"levle": 3}', "has no key 'levle' (aioserve takes level, mode,"),
        ("[3]", "must be a level 0-3 or a JSON object, got [3]"),
    ],
)  # fmt: skip
def test_other_values_are_refused_naming_the_flag(value, message):
    with pytest.raises(ConfigError) as error:
        _settings("--compilation-config", value)
    assert message in str(error.value)
    assert str(error.value).startswith("--compilation-config ")


def test_the_python_api_takes_a_level_or_a_dict():
    assert engine_config_from_kwargs(compilation_config=0).compilation.compilation_config == (
        CompilationSettings(level=0)
    )
    config = engine_config_from_kwargs(compilation_config={"cudagraph_capture_sizes": [4]})
    assert config.compilation.compilation_config.cudagraph_capture_sizes == (4,)
    with pytest.raises(ConfigError, match="^compilation_config must be a level 0-3 or a JSON"):
        engine_config_from_kwargs(compilation_config=2.5)


def test_the_sizes_are_given_once():
    with pytest.raises(ConfigError, match="--cuda-graph-sizes and --compilation-config's"):
        _settings("--cuda-graph-sizes", "8", "-cc", '{"cudagraph_capture_sizes": [2]}')
    with pytest.raises(ConfigError, match="give one"):
        _settings("--cuda-graph-sizes", "8", "-O.max_capture_size=16")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--cudagraph-capture-sizes", "8", "1", "4", "4"],
            CompilationSettings(level=3, cudagraph_capture_sizes=(1, 4, 8)),
        ),
        (["--max-cudagraph-capture-size", "16"], CompilationSettings(level=3, max_capture_size=16)),
        (
            [
                "-cc",
                "1",
                "--cudagraph-capture-sizes",
                "2",
                "6",
                "--max-cudagraph-capture-size",
                "6",
            ],
            CompilationSettings(level=1, cudagraph_capture_sizes=(2, 6), max_capture_size=6),
        ),
        (
            ["-cc.cudagraph_mode=NONE", "--max-cudagraph-capture-size", "4"],
            CompilationSettings(level=3, cudagraph_mode="NONE", max_capture_size=4),
        ),
    ],
)
def test_vllm_032s_shorthands_fold_into_the_settings(argv, expected):
    assert _settings(*argv) == expected


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--cudagraph-capture-sizes", "2", "-O", '{"cudagraph_capture_sizes": [4]}'],
            "mutually exclusive",
        ),
        (["--max-cudagraph-capture-size", "2", "-O.max_capture_size=4"], "mutually exclusive"),
        (
            ["--cudagraph-capture-sizes", "2", "--max-cudagraph-capture-size", "4"],
            "must be the largest",
        ),
        (["--cudagraph-capture-sizes", "2", "--cuda-graph-sizes", "8"], "give one"),
        (["--cudagraph-capture-sizes", "0"], "--cudagraph-capture-sizes"),
    ],
)
def test_the_shorthands_are_refused_beside_what_they_repeat(argv, message):
    with pytest.raises((ConfigError, SystemExit, ValueError), match=message):
        _settings(*argv)


@pytest.mark.parametrize(
    ("platform", "requested", "settings", "expected"),
    [
        # Exact sizes, where --cuda-graph-sizes 4 would mean 1, 2 and 4; past max_num_seqs cut.
        ("cpu", [], CompilationSettings(cudagraph_capture_sizes=(4,)), [4]),
        ("cuda", [], CompilationSettings(cudagraph_capture_sizes=(2, 6, 32)), [2, 6]),
        # The largest of the default list.
        ("cpu", [], CompilationSettings(max_capture_size=4), [1, 2, 4]),
        ("cuda", [], CompilationSettings(max_capture_size=2), [1, 2]),
        # No graphs, and no padding on any platform.
        ("cuda", [], CompilationSettings(cudagraph_mode="NONE"), []),
        ("cpu", [4], CompilationSettings(cudagraph_mode="NONE"), []),
        ("cpu", [], CompilationSettings(max_capture_size=4, cudagraph_mode="NONE"), []),
        # The level is the CPU's compile, not the graphs.
        ("cuda", [], CompilationSettings(level=0), [1, 2, 4, 8]),
        ("cpu", [], CompilationSettings(cudagraph_mode="FULL_DECODE_ONLY"), []),
    ],
)
def test_the_decode_sizes_each_setting_pads_to(
    monkeypatch, platform, requested, settings, expected
):
    monkeypatch.setattr(resolution, "current_platform", lambda: platform)
    assert resolution.resolve_decode_graph_sizes(requested, 8, False, settings) == expected
    assert resolution.resolve_decode_graph_sizes(requested, 8, True, settings) == []
