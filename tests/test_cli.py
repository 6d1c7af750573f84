"""aioserve.cli: the engine parser (model_tag, dotted JSON keys, --config YAML, --help=...),
the top-level command, and the argument inventory of vLLM's surface."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from aioserve import cli
from aioserve.config.arguments import ARGUMENTS
from aioserve.config.declaration import ConfigError
from aioserve.config.engine import engine_config_from_args
from aioserve.config.parser import UNSUPPORTED_GROUP_TITLE, build_engine_parser

INVENTORY = Path(__file__).resolve().parents[1].parent / "shared" / "reference" / "vllm_surface.md"
# `vllm serve`'s options in vLLM 0.32.0, as tools/list_vllm_serve_options.py printed them.
VLLM_032_OPTIONS = Path(__file__).resolve().parent / "vllm_serve_options_0_32.txt"


@pytest.fixture(autouse=True)
def _default_kvcache_env(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)


@pytest.fixture
def parser():
    return build_engine_parser("aioserve serve")


def _fails(parser, argv, capsys) -> str:
    """Parse `argv`, expecting argparse's exit status 2; return what it printed."""
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def _help(parser, keyword, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["org/m", f"--help={keyword}"])
    return exit_info.value.code, capsys.readouterr().out


# --- model_tag and --model ---------------------------------------------------------------


def test_model_tag_is_the_model(parser):
    assert engine_config_from_args(parser.parse_args(["org/m"])).model.model == "org/m"
    assert engine_config_from_args(parser.parse_args(["--model", "org/m"])).model.model == "org/m"
    both = parser.parse_args(["org/m", "--model", "org/m"])
    assert engine_config_from_args(both).model.model == "org/m"


def test_no_model_means_the_default_model(parser):
    config = engine_config_from_args(parser.parse_args([]))
    assert config.model.model == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_model_tag_and_a_different_model_conflict(parser, capsys):
    err = _fails(parser, ["org/a", "--model", "org/b"], capsys)
    assert (
        "aioserve serve: error: the model is given twice, as 'org/a' and as --model 'org/b'" in err
    )


def test_unknown_and_abbreviated_flags_are_argparse_errors(parser, capsys):
    assert "unrecognized arguments: --no-such-flag" in _fails(parser, ["--no-such-flag"], capsys)
    # vLLM turns prefix abbreviations off: --max-num-seq is not --max-num-seqs.
    assert "unrecognized arguments: --max-num-seq" in _fails(parser, ["--max-num-seq", "4"], capsys)


def test_unsupported_alias_is_refused_by_name(parser):
    with pytest.raises(ConfigError, match=r"^--data-parallel-rank \(-dpn\) is a vLLM argument"):
        engine_config_from_args(parser.parse_args(["org/m", "-dpn", "2"]))


# --- JSON arguments ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--hf-overrides", '{"a": 1}'], {"a": 1}),
        (["--hf-overrides.a", "1"], {"a": 1}),
        (["--hf-overrides.a=1"], {"a": 1}),
        (["--hf-overrides.a.b", "2"], {"a": {"b": 2}}),
        (["--hf-overrides.name", "llama"], {"name": "llama"}),
        (["--hf-overrides.flag", "true", "--hf-overrides.f", "0.5"], {"flag": True, "f": 0.5}),
        (["--hf-overrides.a.b", "1", "--hf-overrides.a.c", "2"], {"a": {"b": 1, "c": 2}}),
        (["--hf-overrides.l+", "x", "--hf-overrides.l+=y,3"], {"l": ["x", "y", 3]}),
        (["--hf-overrides.a.b", "2", "--hf-overrides", '{"a": {"c": 1}, "d": [1]}', "--hf-overrides.d+", "2"],
         {"a": {"c": 1, "b": 2}, "d": [1, 2]}),
        (["--hf-overrides", '{"a": 1}', "--hf-overrides.a", "5"], {"a": 5}),
    ],
)  # fmt: skip
def test_json_argument_forms(parser, argv, expected):
    config = engine_config_from_args(parser.parse_args(["org/m", *argv]))
    assert config.model.hf_overrides == expected


def test_dotted_keys_work_for_every_json_argument(parser):
    args = parser.parse_args(["--override-generation-config.temperature", "0.5"])
    assert engine_config_from_args(args).model.override_generation_config == {"temperature": 0.5}
    assert parser.parse_args(["-cc.level=3"]).compilation_config == {"level": 3}
    # The older vLLM's -O.key still sets --compilation-config's key (-O3 is vLLM 0.32's
    # --optimization-level: tests/config/test_optimization_level.py).
    assert parser.parse_args(["-O.level=3"]).compilation_config == {"level": 3}
    config = engine_config_from_args(parser.parse_args(["-O.level", "0"]))
    assert config.compilation.compilation_config.level == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--hf-overrides", "{oops"], "argument --hf-overrides: not valid JSON"),
        (["--hf-overrides.a"], "argument --hf-overrides.a: expected a value"),
        (["--hf-overrides..a", "1"], "argument --hf-overrides..a: empty key"),
        (["-cc", "3", "-cc.level", "2"], "argument --compilation-config/-cc: cannot set keys of the non-object value 3"),
        (["--max-num-seqs.a", "1"], "unrecognized arguments: --max-num-seqs.a"),
    ],
)  # fmt: skip
def test_bad_json_arguments_name_the_flag(parser, capsys, argv, message):
    assert message in _fails(parser, argv, capsys)


def test_non_object_json_is_refused_by_validation(parser):
    with pytest.raises(ConfigError, match="--hf-overrides must be a JSON object"):
        engine_config_from_args(parser.parse_args(["--hf-overrides", "[1]"]))


# --- --config FILE.yaml ------------------------------------------------------------------


def _yaml(tmp_path, text: str) -> str:
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    return str(path)


def test_config_file_sets_options_in_snake_or_kebab_case(parser, tmp_path):
    path = _yaml(
        tmp_path,
        "model: org/from-file\n"
        "max_num_seqs: 8\n"
        "max-model-len: 4k\n"
        "enforce_eager: true\n"
        "enable-prefix-caching: false\n"
        "served_model_name: [a, b]\n"
        "hf_overrides: {a: 1, n: {x: 1}}\n"
        "gpu_memory_utilization: 0.5\n"
        "tokenizer:\n",
    )
    config = engine_config_from_args(parser.parse_args(["--config", path]))
    assert config.model.model == "org/from-file"
    assert config.scheduler.max_num_seqs == 8
    assert config.model.max_model_len == 4000
    assert config.model.enforce_eager is True
    assert config.cache.enable_prefix_caching is False
    assert config.model.served_model_name == ["a", "b"]
    assert config.model.hf_overrides == {"a": 1, "n": {"x": 1}}
    assert config.cache.gpu_memory_utilization == 0.5
    assert config.model.tokenizer == "org/from-file"


def test_command_line_wins_over_config_file(parser, tmp_path):
    path = _yaml(
        tmp_path,
        "model: org/from-file\nmax_num_seqs: 8\ndtype: half\nhf_overrides: {a: 1, n: {x: 1}}\n"
        "enforce_eager: true\n",
    )
    argv = ["org/cli", f"--config={path}", "--max-num-seqs", "2", "--hf-overrides.n.y", "2",
            "--no-enforce-eager"]  # fmt: skip
    config = engine_config_from_args(parser.parse_args(argv))
    assert config.model.model == "org/cli"
    assert config.scheduler.max_num_seqs == 2
    assert config.model.dtype == "half"
    assert config.model.hf_overrides == {"a": 1, "n": {"x": 1, "y": 2}}
    assert config.model.enforce_eager is False
    replaced = parser.parse_args(
        ["--config", path, "--hf-overrides", '{"z": 0}', "--model", "org/m"]
    )
    assert engine_config_from_args(replaced).model.hf_overrides == {"z": 0}
    assert engine_config_from_args(replaced).model.model == "org/m"


def test_unsupported_argument_in_config_file_is_refused(parser, tmp_path):
    path = _yaml(tmp_path, "data_parallel_rank: 2\nheadless: true\n")
    with pytest.raises(ConfigError) as error:
        engine_config_from_args(parser.parse_args(["--config", path]))
    assert "--headless, --data-parallel-rank (-dpn) are vLLM arguments" in str(error.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max_num_sequences: 3\n", "sets 'max_num_sequences', which is not an option"),
        ("config: other.yaml\n", "sets 'config', which is not an option"),
        ("- a\n- b\n", "must hold a mapping of option names to values"),
        ("enforce_eager: maybe\n", "enforce_eager must be true or false, got 'maybe'"),
        ("a: [\n", "is not valid YAML"),
    ],
)
def test_bad_config_files_are_argparse_errors(parser, tmp_path, capsys, text, message):
    assert message in _fails(parser, ["--config", _yaml(tmp_path, text)], capsys)


def test_missing_config_file(parser, tmp_path, capsys):
    err = _fails(parser, ["--config", str(tmp_path / "absent.yaml")], capsys)
    assert "--config: cannot read" in err and "absent.yaml" in err


# --- help ---------------------------------------------------------------------------------


def test_engine_parser_help_shows_groups(parser):
    text = parser.format_help()
    assert text.startswith("usage: aioserve serve [model_tag] [options]")
    titles = ["positional arguments", "options", "ModelConfig", "LoadConfig", "CacheConfig",
              "SchedulerConfig", UNSUPPORTED_GROUP_TITLE]  # fmt: skip
    positions = [text.index(f"\n{title}:") for title in titles]
    assert positions == sorted(positions)
    assert text.index("--config FILE.yaml") < positions[2]
    assert positions[-1] < text.index("--data-parallel-rank") < text.index("--help=listgroup")


def test_help_for_a_group(parser, capsys):
    code, out = _help(parser, "ModelConfig", capsys)
    assert code == 0 and out.startswith("ModelConfig:")
    assert "--dtype" in out and "--task" in out and "--block-size" not in out
    code, out = _help(parser, "parallelconfig", capsys)
    assert code == 0 and "--tensor-parallel-size" in out and "--dtype" not in out


def test_help_for_an_argument_and_a_keyword(parser, capsys):
    code, out = _help(parser, "max-num-seqs", capsys)
    assert code == 0
    assert re.findall(r"^  (--\S+)", out, re.MULTILINE) == ["--max-num-seqs"]
    code, out = _help(parser, "max-num", capsys)
    assert code == 0
    flags = re.findall(r"^  (--\S+)", out, re.MULTILINE)
    assert {"--max-num-seqs", "--max-num-batched-tokens", "--max-num-partial-prefills"} <= set(
        flags
    )
    assert all("max-num" in flag for flag in flags)


def test_help_listgroup_and_no_match(parser, capsys):
    code, out = _help(parser, "listgroup", capsys)
    assert code == 0
    for title in (
        "ModelConfig",
        "SchedulerConfig",
        "ParallelConfig",
        "Frontend",
        UNSUPPORTED_GROUP_TITLE,
    ):
        assert f"\n  {title}" in out
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--help=zzzz"])
    assert exit_info.value.code == 1
    assert "No group or argument matches 'zzzz'" in capsys.readouterr().err


# --- the top-level command ---------------------------------------------------------------


def _run(*argv: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "aioserve", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


def test_top_level_help_lists_the_subcommands():
    result = _run("--help")
    assert result.returncode == 0
    assert result.stdout.startswith("usage: aioserve [-h] [-v] {collect-env,serve,bench} ...")


def test_version():
    for flag in ("--version", "-v"):
        result = _run(flag)
        assert result.returncode == 0
        assert result.stdout.strip() == metadata.version("aioserve")


def test_cli_import_does_not_load_torch():
    code = "import sys, aioserve.cli; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.stdout.strip() == "[]"


def test_collect_env():
    import torch

    from aioserve.platform import current_platform

    result = _run(
        "collect-env", VLLM_CPU_KVCACHE_SPACE="2", VLLM_API_KEY="sekrit", TRITON_INTERPRET="1"
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"aioserve: {metadata.version('aioserve')}" in out
    assert f"python: {sys.version.split()[0]}" in out
    assert f"torch: {torch.__version__}" in out
    assert f"transformers: {metadata.version('transformers')}" in out
    assert "triton: " in out
    assert f"platform: {current_platform()}" in out
    assert f"cpus: {os.cpu_count()}" in out
    assert "cpu kv cache: 2 GiB" in out
    assert "VLLM_CPU_KVCACHE_SPACE=2" in out and "TRITON_INTERPRET=1" in out
    assert "AIOSERVE_KERNEL_BACKEND=" in out
    # What the process set for itself before torch loaded (host_memory.py), unless inherited.
    assert (
        f"ONEDNN_PRIMITIVE_CACHE_CAPACITY={os.environ.get('ONEDNN_PRIMITIVE_CACHE_CAPACITY', 16)}"
        in out
    )
    assert f"LRU_CACHE_CAPACITY={os.environ.get('LRU_CACHE_CAPACITY', 16)}" in out
    assert "VLLM_API_KEY=<hidden>" in out and "sekrit" not in out


def test_main_reports_config_errors_without_traceback(monkeypatch, capsys):
    def run(args):
        raise ConfigError("--max-num-seqs must be at least 1, got 0")

    def add_failing(subparsers):
        subparsers.add_parser("failing").set_defaults(run=run)

    monkeypatch.setattr(cli, "SUBCOMMANDS", (*cli.SUBCOMMANDS, add_failing))
    assert cli.main(["failing"]) == 2
    assert capsys.readouterr().err == "aioserve: error: --max-num-seqs must be at least 1, got 0\n"


def test_main_needs_a_subcommand(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([])
    assert exit_info.value.code == 2
    assert "required: subcommand" in capsys.readouterr().err


# --- the inventory of vLLM's arguments -----------------------------------------------------


def _inventory_spellings() -> list[list[str]]:
    """The spellings in the first column of every table row of section 1."""
    text = INVENTORY.read_text(encoding="utf-8")
    section = text[text.index("\n## 1.") : text.index("\n## 2.")]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [re.findall(r"`([^`]+)`", row.split("|")[1]) for row in rows]


@pytest.mark.skipif(
    not INVENTORY.exists(), reason="the shared vLLM inventory is not beside this checkout"
)
def test_every_vllm_argument_is_declared(parser):
    rows = _inventory_spellings()
    assert len(rows) >= 190
    known = {option for action in parser._actions for option in action.option_strings}
    known |= {action.dest for action in parser._actions if not action.option_strings}
    missing = [spelling for row in rows for spelling in row if spelling not in known]
    assert missing == []
    # Arguments added to vLLM after the versions the inventory was built from are in
    # vLLM 0.32's own list.
    later = {spelling for spellings in _vllm_032_options() for spelling in spellings}
    inventory = {spelling for row in rows for spelling in row} | later
    invented = [a.flag for a in ARGUMENTS if a.flag not in inventory]
    assert invented == []


def _vllm_032_options() -> list[list[str]]:
    lines = VLLM_032_OPTIONS.read_text(encoding="utf-8").splitlines()
    return [line.split() for line in lines if line and not line.startswith("#")]


def test_every_vllm_032_option_is_known(parser):
    options = _vllm_032_options()
    assert len(options) > 300 and ["--max-num-seqs"] in options
    known = {option for action in parser._actions for option in action.option_strings}
    missing = [spelling for spellings in options for spelling in spellings if spelling not in known]
    assert missing == []


@pytest.mark.parametrize(
    "argv",
    [
        ["--attention-backend", "FLASH_ATTN"],
        ["--no-jit-monitor-verbose"],
        ["-asc", "2"],
        ["--kernel-config.moe_backend", "triton"],
        ["--numa-bind-nodes", "0", "1"],
    ],
)
def test_a_vllm_032_argument_is_refused_by_name(parser, argv):
    flag = {"-asc": "--api-server-count (-asc)"}.get(argv[0], argv[0].split(".")[0])
    flag = flag.replace("--no-", "--")
    with pytest.raises(ConfigError, match=rf"^{re.escape(flag)} is a vLLM argument that aioserve"):
        engine_config_from_args(parser.parse_args(["org/m", *argv]))


def test_vllm_032_aliases_reach_their_arguments(parser):
    args = parser.parse_args(["org/m", "--device-memory-utilization", "0.5"])
    assert engine_config_from_args(args).cache.gpu_memory_utilization == 0.5
    sc = parser.parse_args(["org/m", "-sc.method", "ngram", "-sc.num_speculative_tokens", "3"])
    assert engine_config_from_args(sc).speculative.speculative_config.num_speculative_tokens == 3
