"""--profiler-config: vLLM 0.32's ProfilerConfig, of which aioserve runs the "torch" profiler.

With {"profiler": "torch", "torch_profiler_dir": DIR} the server registers /start_profile
and /stop_profile, and `LLM.start_profile()` / `stop_profile()` work; each session writes
one trace of the engine's steps in DIR (engine/step_profiler.py). The torch profiler's
options are vLLM's keys: torch_profiler_activities (CPU, CUDA), torch_profiler_with_stack
(default true), torch_profiler_with_flops, torch_profiler_record_shapes,
torch_profiler_with_memory, torch_profiler_use_gzip (default true) and
torch_profiler_dump_cuda_time_total (default true: the table of device time per op, written
next to the trace when the session records a GPU).

vLLM 0.32 no longer reads VLLM_TORCH_PROFILER_DIR; aioserve still does, as the older vLLMs
did: when --profiler-config does not name a profiler, the variable means {"profiler":
"torch", "torch_profiler_dir": its value} (the flag's other keys still apply). The CUDA and
Proton profilers, their keys and the iteration schedules are refused by name.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aioserve.config import values
from aioserve.config.declaration import ConfigError

PROFILER_DIR_ENV = "VLLM_TORCH_PROFILER_DIR"
FLAG = "--profiler-config"
ACTIVITIES = ("CPU", "CUDA")
_VLLM_ACTIVITIES = ("PrivateUse1", "XPU")
_VLLM_PROFILERS = ("cuda", "proton")

# vLLM 0.32's keys that aioserve does not run: the Proton profiler's, CUDA-graph capture
# profiling, roofline annotations, and the iteration schedules (delay, limit, torch's
# wait/warmup/active), which need the profiler stepped with the engine.
_UNSUPPORTED_KEYS = (
    "proton_profiler_dir", "proton_context", "proton_data", "proton_backend", "proton_mode",
    "proton_hook", "proton_output_format", "proton_graph_attribution",
    "capture_torch_profiler", "detailed_trace_annotation",
    "delay_iterations", "max_iterations", "warmup_iterations", "active_iterations",
    "wait_iterations",
)  # fmt: skip


@dataclass(frozen=True)
class ProfilerSettings:
    """The torch profiler's settings, as vLLM's ProfilerConfig names them."""

    torch_profiler_dir: str  # absolute
    torch_profiler_activities: tuple[str, ...] | None = None  # None: CPU, and CUDA on a GPU
    torch_profiler_with_stack: bool = True
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True
    torch_profiler_dump_cuda_time_total: bool = True
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False


def _profiler_kind(value: Any) -> str | None:
    if value is None or value == "torch":
        return value
    if value in _VLLM_PROFILERS:
        raise ValueError(f'{value!r} is not supported by aioserve yet (it runs "torch")')
    raise ValueError(f"must be torch, cuda or proton, got {value!r}")


def _activities(value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"must be a non-empty list of CPU and CUDA, got {value!r}")
    for activity in value:
        if activity in _VLLM_ACTIVITIES:
            raise ValueError(f"{activity!r} is not supported by aioserve yet (CPU, CUDA)")
        if activity not in ACTIVITIES:
            raise ValueError(f"must list CPU and CUDA, got {activity!r}")
    if len(set(value)) != len(value):
        raise ValueError("must not contain duplicates")
    return tuple(value)


def _ignore_frontend(value: Any) -> bool:
    # vLLM's frontend trace is a second file from its API-server process; aioserve's one
    # process writes the engine's trace only, which is what true asks for.
    if values.boolean(value) is not True:
        raise ValueError(
            "false is not supported by aioserve yet: it writes no separate frontend trace"
        )
    return True


profiler_config = values.json_settings(
    {
        "profiler": _profiler_kind,
        "torch_profiler_dir": values.string,
        "torch_profiler_activities": _activities,
        "torch_profiler_with_stack": values.boolean,
        "torch_profiler_with_flops": values.boolean,
        "torch_profiler_use_gzip": values.boolean,
        "torch_profiler_dump_cuda_time_total": values.boolean,
        "torch_profiler_record_shapes": values.boolean,
        "torch_profiler_with_memory": values.boolean,
        "ignore_frontend": _ignore_frontend,
    },
    unsupported=_UNSUPPORTED_KEYS,
)
"""--profiler-config: the keys given, checked one by one (`profiler_settings` combines them)."""


def profiler_settings(
    given: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> ProfilerSettings | None:
    """The profiler --profiler-config's keys (`given`, checked) and VLLM_TORCH_PROFILER_DIR
    ask for; None for no profiler. vLLM's rules between the keys, in its words."""
    environ = os.environ if environ is None else environ
    given = dict(given)
    if "profiler" in given:
        kind = given.pop("profiler")
    elif environ.get(PROFILER_DIR_ENV):
        kind = "torch"
        given.setdefault("torch_profiler_dir", environ[PROFILER_DIR_ENV])
    else:
        kind = None
    given.pop("ignore_frontend", None)
    if kind is None:
        for key in ("torch_profiler_dir", "torch_profiler_activities"):
            if key in given:
                raise ConfigError(
                    f"{FLAG}: {key} is only applicable when profiler is set to 'torch'"
                )
        return None  # vLLM takes the torch profiler's options without a profiler, unused
    directory = given.get("torch_profiler_dir")
    if not directory:
        raise ConfigError(f"{FLAG}: torch_profiler_dir must be set when profiler is 'torch'")
    if "://" in directory and len(directory.split("://")[0]) > 1:
        raise ConfigError(
            f"{FLAG}: torch_profiler_dir {directory!r}: remote folders are not supported by "
            "aioserve yet (a local folder)"
        )
    given["torch_profiler_dir"] = os.path.abspath(os.path.expanduser(directory))
    return ProfilerSettings(**given)
