"""The `aioserve bench` command line: its subcommands, `--help=`, and its own options."""

from __future__ import annotations

import pytest

from aioserve import cli
from aioserve.config.arguments import ARGUMENTS


def bench_commands() -> dict:
    bench = cli.build_parser()._subparsers._group_actions[0].choices["bench"]
    return bench._subparsers._group_actions[0].choices


def test_bench_has_vllms_three_subcommands():
    assert set(bench_commands()) == {"throughput", "latency", "serve"}


@pytest.mark.parametrize("command", ["throughput", "latency"])
def test_part_of_the_help_reaches_the_engine_arguments(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", command, "--help=max-num-seqs"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--max-num-seqs" in out and "--max-model-len" not in out


def test_bench_options_do_not_shadow_engine_arguments():
    """engine_config_from_args reads every namespace attribute named like a vLLM argument."""
    engine_dests = {a.dest for a in ARGUMENTS}
    commands = bench_commands()
    for name in ("throughput", "latency"):
        own = [
            action.dest
            for group in commands[name]._action_groups
            if group.title in ("benchmark options", "prefix repetition dataset options")
            for action in group._group_actions
        ]
        assert own and not set(own) & engine_dests, name


def test_latency_turns_prefix_caching_off_and_its_help_says_so(capsys):
    """Each timed iteration resends the warm-up's prompts: they must be computed, not found."""
    from aioserve.config.engine import engine_config_from_args

    latency = bench_commands()["latency"]
    assert engine_config_from_args(latency.parse_args([])).cache.enable_prefix_caching is False
    args = latency.parse_args(["--enable-prefix-caching"])
    assert engine_config_from_args(args).cache.enable_prefix_caching is True
    with pytest.raises(SystemExit):
        cli.main(["bench", "latency", "--help=enable-prefix-caching"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "Reuse the KV cache of shared prompt prefixes. (default: False)" in help_text
    throughput = bench_commands()["throughput"]
    assert engine_config_from_args(throughput.parse_args([])).cache.enable_prefix_caching is True
