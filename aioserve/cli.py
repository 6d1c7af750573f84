"""The `aioserve` command line: the top-level parser and its subcommands.

Each subcommand is a function in SUBCOMMANDS that registers its parser on the top-level
subparsers and sets `run` (namespace -> exit status) as that parser's default. `main`
parses, runs, and turns a ConfigError into `aioserve: error: <message>` and exit status 2.
The arguments and the engine parser are aioserve.config's; this module only wires them.

Nothing here imports torch or transformers at import time, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Callable, Sequence
from importlib import metadata

from aioserve.benchmarks.cli import add_bench_parser
from aioserve.config.arguments import CPU_KVCACHE_SPACE_ENV
from aioserve.config.declaration import ConfigError
from aioserve.config.engine import cpu_kvcache_space_bytes
from aioserve.config.parser import EngineArgumentParser, build_engine_parser
from aioserve.host_memory import keep_host_memory


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


_SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD")
_ENV_ALWAYS_SHOWN = (
    CPU_KVCACHE_SPACE_ENV,
    "TRITON_INTERPRET",
    "AIOSERVE_KERNEL_BACKEND",
    "LRU_CACHE_CAPACITY",  # ideep's cache of oneDNN primitives (host_memory.py)
    "THP_MEM_ALLOC_ENABLE",
)
_ENV_PREFIXES = (
    "VLLM_",
    "AIOSERVE_",
    "TRITON_",
    "HF_",
    "CUDA_",
    "HIP_",
    "ROCR_",
    "PYTORCH_",
    "ONEDNN_",
    "MALLOC_",
)


def environment_report() -> str:
    """What `aioserve collect-env` prints: versions, device, CPUs, relevant variables."""
    import torch

    from aioserve.platform import current_arch, current_platform, gpu_name

    lines = [f"aioserve: {_version('aioserve')}", f"python: {sys.version.split()[0]}"]
    for name in ("torch", "transformers", "tokenizers", "safetensors", "gguf"):
        lines.append(f"{name}: {_version(name) or 'not installed'}")
    triton = _version("triton") or _version("pytorch-triton-rocm")
    lines.append(f"triton: {triton or 'not installed'}")
    lines.append(f"torch build: cuda {torch.version.cuda}, hip {torch.version.hip}")
    lines.append(f"os: {platform.platform()}")
    device = current_platform()
    lines.append(f"platform: {device}")
    if device != "cpu":
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        lines.append(f"gpus: {len(names)} x {', '.join(dict.fromkeys(names))}")
        lines.append(f"gpu architecture: {gpu_name()} (launch tables: {current_arch()})")
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    lines.append(f"cpus: {os.cpu_count()} (usable by this process: {usable or 'unknown'})")
    try:
        lines.append(f"cpu kv cache: {cpu_kvcache_space_bytes() / 2**30:g} GiB")
    except ConfigError as error:
        lines.append(f"cpu kv cache: invalid ({error})")
    lines.append("environment:")
    names = sorted(set(_ENV_ALWAYS_SHOWN) | {n for n in os.environ if n.startswith(_ENV_PREFIXES)})
    for name in names:
        value = os.environ.get(name)
        if value is not None and any(marker in name for marker in _SECRET_MARKERS):
            value = "<hidden>"
        lines.append(f"  {name}={'<unset>' if value is None else value}")
    return "\n".join(lines)


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
    parser.add_argument("-v", "--version", action="version", version=_version("aioserve"))
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
