"""The step profiler (engine/step_profiler.py): one session at a time, its trace written
gzipped in Chrome's format under vLLM's name for it, holding the ops run between start and
stop on the starting thread; VLLM_TORCH_PROFILER_DIR read with ~ expanded."""

from __future__ import annotations

import gzip
import json
import os
import socket
from pathlib import Path

import pytest
import torch

from aioserve.engine.step_profiler import ProfilerStateError, StepProfiler, profiler_dir


def test_a_session_writes_the_ops_it_saw(tmp_path):
    profiler = StepProfiler(tmp_path / "new" / "folder")
    torch.ones(4).add(1)  # before the session: not traced
    profiler.start()
    assert profiler.running
    torch.ones(8, 8).matmul(torch.ones(8, 8))
    trace = profiler.stop()
    assert not profiler.running
    assert trace.parent == tmp_path / "new" / "folder"
    assert trace.name.startswith(f"{socket.gethostname()}_{os.getpid()}.")
    assert trace.name.endswith(".pt.trace.json.gz")
    names = [e.get("name") for e in json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]]
    assert "aten::matmul" in names
    assert "aten::add" not in names


def test_one_session_at_a_time(tmp_path):
    profiler = StepProfiler(tmp_path)
    with pytest.raises(ProfilerStateError, match="not running"):
        profiler.stop()
    profiler.start()
    with pytest.raises(ProfilerStateError, match="already running"):
        profiler.start()
    profiler.stop()
    profiler.start()  # a second session after the first
    assert profiler.stop() != profiler.directory


def test_the_variable_names_the_folder():
    assert profiler_dir({}) is None
    assert profiler_dir({"VLLM_TORCH_PROFILER_DIR": ""}) is None
    assert profiler_dir({"VLLM_TORCH_PROFILER_DIR": "/srv/traces"}) == Path("/srv/traces")
    assert profiler_dir({"VLLM_TORCH_PROFILER_DIR": "~/t"}) == Path.home() / "t"
