"""torch's profiler over the model thread's steps: the server's /start_profile and
/stop_profile, present when VLLM_TORCH_PROFILER_DIR names a folder, as in vLLM.

The profiler records the ops of the thread that starts it, so it is started and stopped on
the model thread (model_thread.py), between two steps: a session covers whole steps. Its
trace is written, gzipped, in Chrome's trace format (chrome://tracing, Perfetto, or
TensorBoard's profiler plugin) as `<host>_<pid>.<time ms>.pt.trace.json.gz` in that folder,
vLLM's naming. CPU ops always; a GPU's kernels too where the device is one. As vLLM's
defaults have it, the Python stack of each op is recorded; shapes, memory and FLOPs not.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

PROFILER_DIR_ENV = "VLLM_TORCH_PROFILER_DIR"


class ProfilerStateError(RuntimeError):
    """Started while a session runs, or stopped while none does."""


def profiler_dir(environ: Mapping[str, str] | None = None) -> Path | None:
    """The folder VLLM_TORCH_PROFILER_DIR names (~ expanded), or None when it is unset."""
    environ = os.environ if environ is None else environ
    value = environ.get(PROFILER_DIR_ENV, "")
    return Path(value).expanduser() if value else None


class StepProfiler:
    """One profiling session at a time, its traces written in `directory`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._session: profile | None = None

    @property
    def running(self) -> bool:
        return self._session is not None

    def start(self) -> None:
        """Start a session (on the model thread)."""
        if self._session is not None:
            raise ProfilerStateError("the profiler is already running: stop it first")
        self.directory.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        session = profile(activities=activities, with_stack=True)
        session.start()
        self._session = session

    def stop(self) -> Path:
        """End the session (on the model thread) and write its trace: the file's path."""
        session = self._session
        if session is None:
            raise ProfilerStateError("the profiler is not running: start it first")
        self._session = None
        session.stop()
        name = f"{socket.gethostname()}_{os.getpid()}.{int(time.time() * 1000)}.pt.trace.json.gz"
        path = self.directory / name
        session.export_chrome_trace(str(path))
        return path
