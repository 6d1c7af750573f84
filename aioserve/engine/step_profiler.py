"""torch's profiler over the model thread's steps: the server's /start_profile and
/stop_profile and `LLM.start_profile()`, present when --profiler-config (or
VLLM_TORCH_PROFILER_DIR) asks for the torch profiler (config/profiler.py).

The profiler records the ops of the thread that starts it, so it is started and stopped on
the model thread (model_thread.py), between two steps: a session covers whole steps. Its
trace is written in Chrome's trace format (chrome://tracing, Perfetto, or TensorBoard's
profiler plugin) as `<host>_<pid>.<time ms>.pt.trace.json.gz` in torch_profiler_dir (no
.gz with torch_profiler_use_gzip false), vLLM's naming. The activities are CPU, and CUDA
where the device is a GPU, unless torch_profiler_activities lists them. As vLLM's defaults
have it, the Python stack of each op is recorded, shapes, memory and FLOPs not; each is a
key of --profiler-config. As vLLM's workers do, each session also writes a table of the ops'
times, `<host>_<pid>.profiler_out.txt`: by device time when it records a GPU (unless
torch_profiler_dump_cuda_time_total is false), the 50 costliest by CPU time when CPU alone.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from aioserve.config.declaration import ConfigError
from aioserve.config.profiler import ProfilerSettings


class ProfilerStateError(RuntimeError):
    """Started while a session runs, or stopped while none does."""


def torch_activities(settings: ProfilerSettings) -> list[ProfilerActivity]:
    """What the profiler records; a ConfigError for CUDA where there is no GPU."""
    names = settings.torch_profiler_activities
    if names is None:
        names = ("CPU", "CUDA") if torch.cuda.is_available() else ("CPU",)
    elif "CUDA" in names and not torch.cuda.is_available():
        raise ConfigError(
            "--profiler-config: torch_profiler_activities: CUDA needs a GPU, and this "
            "machine computes on the CPU (CPU is supported)"
        )
    return [getattr(ProfilerActivity, name) for name in names]


class StepProfiler:
    """One profiling session at a time, as `settings` say."""

    def __init__(self, settings: ProfilerSettings) -> None:
        self.settings = settings
        self.directory = Path(settings.torch_profiler_dir)
        self._activities = torch_activities(settings)
        self._session: profile | None = None

    @property
    def running(self) -> bool:
        return self._session is not None

    def start(self) -> None:
        """Start a session (on the model thread)."""
        if self._session is not None:
            raise ProfilerStateError("the profiler is already running: stop it first")
        self.directory.mkdir(parents=True, exist_ok=True)
        settings = self.settings
        session = profile(
            activities=self._activities,
            record_shapes=settings.torch_profiler_record_shapes,
            profile_memory=settings.torch_profiler_with_memory,
            with_stack=settings.torch_profiler_with_stack,
            with_flops=settings.torch_profiler_with_flops,
        )
        session.start()
        self._session = session

    def stop(self) -> Path:
        """End the session (on the model thread) and write its trace: the file's path."""
        session = self._session
        if session is None:
            raise ProfilerStateError("the profiler is not running: start it first")
        self._session = None
        session.stop()
        worker = f"{socket.gethostname()}_{os.getpid()}"
        name = f"{worker}.{int(time.time() * 1000)}.pt.trace.json"
        path = self.directory / name
        if self.settings.torch_profiler_use_gzip:
            path = path.with_name(name + ".gz")  # torch gzips a name ending in .gz
        session.export_chrome_trace(str(path))
        table = self._table(session)
        if table is not None:
            (self.directory / f"{worker}.profiler_out.txt").write_text(table + "\n")
        return path

    def _table(self, session: profile) -> str | None:
        if any(activity != ProfilerActivity.CPU for activity in self._activities):
            if not self.settings.torch_profiler_dump_cuda_time_total:
                return None
            return session.key_averages().table(sort_by="self_device_time_total")
        return session.key_averages().table(sort_by="self_cpu_time_total", row_limit=50)
