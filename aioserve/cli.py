"""The `aioserve` command line: the top-level parser and its subcommands.

Each subcommand is a function in SUBCOMMANDS that registers its parser on the top-level
subparsers and sets `run` (namespace -> exit status) as that parser's default. `main`
parses, runs, and turns a ConfigError into `aioserve: error: <message>` and exit status 2.
The arguments and the engine parser are aioserve.config's; this module only wires them.

Nothing here imports torch or transformers at import time, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from aioserve.benchmarks.cli import add_bench_parser
from aioserve.config.declaration import ConfigError
from aioserve.config.parser import EngineArgumentParser, build_engine_parser
from aioserve.environment import environment_report, package_version
from aioserve.host_memory import keep_host_memory


def _run_collect_env(args: argparse.Namespace) -> int:
    print(environment_report())
    return 0


def _add_collect_env(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "collect-env",
        help="Print versions, device and environment, for bug reports.",
        description="Print the versions, the device and the environment variables that matter "
        "to aioserve (secrets hidden), for bug reports.",
    )
    parser.set_defaults(run=_run_collect_env)


def _run_serve(args: argparse.Namespace) -> int:
    from aioserve.server.serve import run_serve

    return run_serve(args)


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    engine_parser = build_engine_parser("aioserve serve")
    parser = subparsers.add_parser(
        "serve",
        parents=[engine_parser],
        add_help=False,  # the engine parser's --help comes with its arguments
        usage=engine_parser.usage,
        epilog=engine_parser.epilog,
        help="Serve a model over vLLM's OpenAI-compatible HTTP API.",
        description="Serve a model over vLLM's OpenAI-compatible HTTP API (the default model "
        "when none is given).",
    )
    parser.set_defaults(run=_run_serve)


SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_collect_env,
    _add_serve,
    add_bench_parser,
)


def build_parser() -> argparse.ArgumentParser:
    """The top-level `aioserve` parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="aioserve",
        description="aioserve: an LLM inference server with vLLM's command line and HTTP API.",
    )
    parser.add_argument("-v", "--version", action="version", version=package_version("aioserve"))
    subparsers = parser.add_subparsers(
        title="subcommands", dest="subcommand", required=True, parser_class=EngineArgumentParser
    )
    for register in SUBCOMMANDS:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `aioserve` with `argv` (default: sys.argv[1:]); return the exit status."""
    args = build_parser().parse_args(argv)
    keep_host_memory()
    try:
        return args.run(args)
    except ConfigError as error:
        print(f"aioserve: error: {error}", file=sys.stderr)
        return 2
