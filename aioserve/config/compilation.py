"""--compilation-config (-cc): vLLM's torch.compile and CUDA-graph settings, as aioserve
reads them.

vLLM takes a level (`-cc 3`) or a JSON object (`-cc '{"level": 0}'`, or one key:
`-cc.level=0`); `-O` with a JSON object or a dotted key sets it too, as in the older vLLM
whose documentation aioserve follows (`-O3` is vLLM 0.32's --optimization-level:
config/optimization.py). aioserve honours:

- `level` (vLLM's newer name: `mode`), 0 to 3: 0 runs the model step eagerly, as
  --enforce-eager does on the CPU (no torch.compile) but keeping CUDA/HIP graphs; 1 to 3
  compile the CPU's model step ahead of time (runner/compiled_step.py). vLLM keeps levels
  1 and 2 for its own tests; aioserve has one compiled step for all three. Not given, the
  optimization level decides: 0 at --optimization-level 0, else 3.
  On a GPU aioserve runs its Triton kernels without torch.compile at every level.
- `cudagraph_mode`: "FULL_DECODE_ONLY" (what aioserve captures: whole decode steps, other
  steps eager) or "NONE" (no graphs, and no padding of decode steps). vLLM's piecewise and
  full-for-every-step modes are refused by name. Not given, the optimization level decides
  (NONE at level 0).
- `use_cudagraph`: false is `cudagraph_mode` "NONE", true "FULL_DECODE_ONLY".
- `cudagraph_capture_sizes`: the decode batch sizes captured, exactly these (where
  --cuda-graph-sizes expands one value N into 1, 2, 4 and the multiples of 8 up to N).
- `max_capture_size` (vLLM's newer name: `max_cudagraph_capture_size`): the largest size
  of the default list (as --cuda-graph-sizes N); given with explicit sizes, it must be
  their largest, as vLLM requires.

Every other key of vLLM's CompilationConfig is refused by name.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from aioserve.config.values import json_object

# vLLM's CompilationMode.VLLM_COMPILE: the level optimization levels 1 to 3 give.
VLLM_COMPILE = 3
CUDAGRAPH_MODES = ("NONE", "FULL_DECODE_ONLY")
# vLLM's modes that capture other steps than decodes, or pieces of steps.
_OTHER_CUDAGRAPH_MODES = ("PIECEWISE", "FULL", "FULL_AND_PIECEWISE")
# The keys of vLLM's CompilationConfig that aioserve does not honour yet.
_UNSUPPORTED_KEYS = (
    "debug_dump_path", "cache_dir", "backend", "custom_ops", "splitting_ops",
    "use_inductor", "compile_sizes", "inductor_compile_config", "inductor_passes",
    "cudagraph_num_of_warmups", "cudagraph_copy_inputs", "full_cuda_graph", "pass_config",
    "local_cache_dir", "use_inductor_graph_partition", "cudagraph_specialize_lora",
    "compile_mm_encoder", "dynamic_shapes_config",
)  # fmt: skip
_KEYS = (
    "level", "mode", "cudagraph_mode", "use_cudagraph", "cudagraph_capture_sizes",
    "max_capture_size", "max_cudagraph_capture_size",
)  # fmt: skip


@dataclass(frozen=True)
class CompilationSettings:
    """What --compilation-config asked for; None: not given (the level and graph mode: the
    optimization level's, config/optimization.py; the sizes: the platform's)."""

    level: int | None = None
    cudagraph_mode: str | None = None
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    max_capture_size: int | None = None

    @property
    def compiles(self) -> bool:
        """Whether the CPU's model step may be compiled (level 1 to 3, or the default)."""
        return self.level != 0

    @property
    def captures_graphs(self) -> bool:
        """Whether decode steps may be padded to captured sizes (and captured on a GPU)."""
        return self.cudagraph_mode != "NONE"

    def __str__(self) -> str:
        given: dict[str, Any] = {}
        if self.level is not None:
            given["level"] = self.level
        if self.cudagraph_mode is not None:
            given["cudagraph_mode"] = self.cudagraph_mode
        if self.cudagraph_capture_sizes is not None:
            given["cudagraph_capture_sizes"] = list(self.cudagraph_capture_sizes)
        if self.max_capture_size is not None:
            given["max_capture_size"] = self.max_capture_size
        return json.dumps(given)


def compilation_config(value: Any) -> CompilationSettings:
    """--compilation-config: a level 0-3 (as a number or its text) or a JSON object."""
    if isinstance(value, CompilationSettings):
        return value
    if _is_level(value):
        return CompilationSettings(level=_level(value, "level"))
    if not isinstance(value, (str, dict)):
        raise ValueError(f"must be a level 0-3 or a JSON object, got {value!r}")
    settings = json_object(value)
    for key in settings:
        if key in _UNSUPPORTED_KEYS:
            raise ValueError(f"key {key!r} is not supported by aioserve yet")
        if key not in _KEYS:
            raise ValueError(f"has no key {key!r} (aioserve takes {', '.join(_KEYS)})")
    level = _one_of_two(settings, "level", "mode")
    mode = _cudagraph_mode(settings)
    sizes = settings.get("cudagraph_capture_sizes")
    if sizes is not None:
        sizes = _sizes(sizes)
    largest = _one_of_two(settings, "max_capture_size", "max_cudagraph_capture_size")
    if largest is not None:
        largest = _positive(largest, "max_capture_size")
        if sizes is not None and largest != max(sizes):
            raise ValueError(
                f"max_capture_size ({largest}) must be the largest of cudagraph_capture_sizes "
                f"({max(sizes)}) when both are given"
            )
    return CompilationSettings(
        level=None if level is None else _level(level, f"key {_named(settings)!r}"),
        cudagraph_mode=mode,
        cudagraph_capture_sizes=sizes,
        max_capture_size=largest,
    )


def with_capture_flags(
    settings: CompilationSettings, sizes: list[int] | None, largest: int | None
) -> CompilationSettings:
    """`settings` with vLLM 0.32's --cudagraph-capture-sizes and --max-cudagraph-capture-size
    folded in; each excludes the same key of --compilation-config (vLLM's rule)."""
    if sizes is not None:
        if settings.cudagraph_capture_sizes is not None:
            raise ValueError(
                "--cudagraph-capture-sizes and --compilation-config's cudagraph_capture_sizes "
                "are mutually exclusive"
            )
        settings = dataclasses.replace(settings, cudagraph_capture_sizes=tuple(sorted(set(sizes))))
    if largest is not None:
        if settings.max_capture_size is not None:
            raise ValueError(
                "--max-cudagraph-capture-size and --compilation-config's "
                "max_cudagraph_capture_size are mutually exclusive"
            )
        settings = dataclasses.replace(settings, max_capture_size=largest)
    chosen = settings.cudagraph_capture_sizes
    if chosen is not None and settings.max_capture_size not in (None, max(chosen)):
        raise ValueError(
            f"the largest decode graph size ({settings.max_capture_size}) must be the largest "
            f"of the capture sizes ({max(chosen)}) when both are given"
        )
    return settings


def _is_level(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit())


def _level(value: Any, what: str) -> int:
    if not _is_level(value) or int(value) not in (0, 1, 2, 3):
        raise ValueError(f"{what} must be 0, 1, 2 or 3, got {value!r}")
    return int(value)


def _named(settings: dict[str, Any]) -> str:
    return "level" if "level" in settings else "mode"


def _one_of_two(settings: dict[str, Any], old: str, new: str) -> Any:
    """The value of a key that vLLM renamed from `old` to `new`; both given must agree."""
    if old in settings and new in settings and settings[old] != settings[new]:
        raise ValueError(f"keys {old!r} and {new!r} name one setting and disagree")
    return settings.get(old, settings.get(new))


def _cudagraph_mode(settings: dict[str, Any]) -> str | None:
    use = settings.get("use_cudagraph")
    if use is not None and not isinstance(use, bool):
        raise ValueError(f"key 'use_cudagraph' must be true or false, got {use!r}")
    mode = settings.get("cudagraph_mode")
    if mode is not None:
        if mode in _OTHER_CUDAGRAPH_MODES:
            raise ValueError(
                f"cudagraph_mode {mode!r} is not supported by aioserve yet: it captures whole "
                f"decode steps only (it takes {', '.join(CUDAGRAPH_MODES)})"
            )
        if mode not in CUDAGRAPH_MODES:
            raise ValueError(
                f"key 'cudagraph_mode' must be one of {', '.join(CUDAGRAPH_MODES)}, got {mode!r}"
            )
        if use is False and mode != "NONE":
            raise ValueError(f"use_cudagraph false and cudagraph_mode {mode!r} disagree")
    if use is None or mode is not None:
        return mode
    return "FULL_DECODE_ONLY" if use else "NONE"


def _sizes(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"key 'cudagraph_capture_sizes' must be a list of sizes, got {value!r}")
    return tuple(sorted({_positive(size, "cudagraph_capture_sizes") for size in value}))


def _positive(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"key {key!r} takes positive integers, got {value!r}")
    return value
