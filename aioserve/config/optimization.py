"""vLLM 0.32's --optimization-level (-O) and --performance-mode, as aioserve reads them.

--optimization-level trades start-up time for speed; vLLM's levels set defaults of its
compilation settings, which any setting given explicitly overrides. vLLM's levels and what
they mean here:

- 0: vLLM compiles nothing, captures no CUDA graph and turns its fusion passes and
  FlashInfer autotuning off, to start at once. aioserve runs the CPU's model step eagerly
  (no torch.compile, no ahead-of-time graphs) and captures no CUDA/HIP graphs, so decode
  steps are not padded to captured sizes either: --compilation-config's level 0 and
  cudagraph_mode NONE. A level or mode given in --compilation-config, or a graph setting
  (its cudagraph_mode, use_cudagraph, cudagraph_capture_sizes or max_capture_size,
  --cudagraph-capture-sizes, --max-cudagraph-capture-size, --cuda-graph-sizes), wins.
  vLLM 0.32 keeps its graphs off under -O0 when only sizes are given; aioserve takes
  given sizes as asking for graphs, rather than leave them unused.
- 1: vLLM compiles with Dynamo and Inductor and captures piecewise graphs; 2 (the
  default) adds full graphs and more fusion passes; 3 is 2 for now. aioserve has one
  compiled step and one kind of graph, whole decode steps (cudagraph_mode
  FULL_DECODE_ONLY), so 1, 2 and 3 are its default behaviour: the CPU's step compiled,
  decodes replayed from graphs on a GPU. vLLM's fusion passes have no counterpart here
  (aioserve's kernels fuse what they fuse at every level); on a GPU aioserve's Triton
  kernels run without torch.compile at every level.

`-O` is the level's alias, as in vLLM 0.32: `-O3`, `-O=3` and `-O 3` mean
`--optimization-level 3`. The older vLLM whose documentation aioserve follows made `-O`
an alias of --compilation-config; vLLM 0.32 refuses its other forms, and aioserve keeps
the two that cannot be mistaken for a level: `-O '{"level": 0}'` (a JSON object) and
`-O.key=value` (one key) still set --compilation-config (`-cc` is its alias).

--performance-mode: balanced (the default) changes nothing; throughput doubles the default
--max-num-batched-tokens and --max-num-seqs, each when it is not given (vLLM 0.32's rule,
engine/resolution.py); interactivity makes the default decode graph sizes every size from
1 to 32 before the multiples of 8 (runner/decode_graphs.capture_sizes).
"""

from __future__ import annotations

import dataclasses

from aioserve.config import values
from aioserve.config.compilation import VLLM_COMPILE, CompilationSettings
from aioserve.config.declaration import VLLM, Argument

DEFAULT_OPTIMIZATION_LEVEL = 2

# Spliced into `arguments.ARGUMENTS` beside --compilation-config.
# fmt: off
OPTIMIZATION_ARGUMENTS: tuple[Argument, ...] = (
    Argument("optimization-level", VLLM, DEFAULT_OPTIMIZATION_LEVEL,
             "Start-up time against speed (vLLM 0.32's); -O3, -O=3 and -O 3 are short for "
             "--optimization-level 3. 0: the CPU's model step runs eagerly and no CUDA/HIP "
             "graphs are captured (decode steps not padded), unless --compilation-config, "
             "--cudagraph-capture-sizes or --cuda-graph-sizes ask for them; 1 to 3: the step "
             "compiled, graphs captured. -O with a JSON object or -O.key=value still sets "
             "--compilation-config.",
             convert=values.integer, choices=(0, 1, 2, 3), aliases=("-O",)),
    Argument("performance-mode", VLLM, "balanced",
             "What vLLM 0.32's defaults favour: throughput doubles the default "
             "--max-num-batched-tokens and --max-num-seqs (each when not given); "
             "interactivity makes the default decode graph sizes every size from 1 to 32, "
             "then multiples of 8; balanced changes neither.",
             convert=values.string, choices=("balanced", "interactivity", "throughput")),
)
# fmt: on


def compilation_config_dash_o(tokens: list[str]) -> list[str]:
    """`tokens` with the older vLLM's `-O` forms that vLLM 0.32 refuses written as
    --compilation-config: `-O` with a JSON object (`-O '{...}'`, `-O={...}`, `-O{...}`)
    and a dotted key (`-O.level=0`, `-O.level 0`). Every other `-O` is left to argparse,
    as --optimization-level's alias. Tokens after `--` are left alone."""
    out: list[str] = []
    for i, token in enumerate(tokens):
        if token == "--":
            return out + tokens[i:]
        value = token.removeprefix("-O").removeprefix("=")
        if token.startswith("-O."):
            out.append("--compilation-config" + token.removeprefix("-O"))
        elif token.startswith("-O") and _json_object(value):
            out += ["--compilation-config", value]
        elif token == "-O" and i + 1 < len(tokens) and _json_object(tokens[i + 1]):
            out.append("--compilation-config")
        else:
            out.append(token)
    return out


def _json_object(text: str) -> bool:
    return text.lstrip().startswith("{")


def with_optimization_level(
    settings: CompilationSettings, level: int, graph_sizes_given: bool
) -> CompilationSettings:
    """`settings` (--compilation-config, its shorthands folded in) with the defaults of
    optimization level `level` where they leave them open: the compilation level (vLLM's
    mode) unless given, and at level 0 no graphs unless a graph setting was given
    (`graph_sizes_given`: decode sizes from any flag)."""
    if settings.level is None:
        settings = dataclasses.replace(settings, level=VLLM_COMPILE if level > 0 else 0)
    graphs_given = settings.cudagraph_mode is not None or graph_sizes_given
    if level == 0 and not graphs_given:
        settings = dataclasses.replace(settings, cudagraph_mode="NONE")
    return settings
