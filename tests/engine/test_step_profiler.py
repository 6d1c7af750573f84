"""The step profiler (engine/step_profiler.py): one session at a time, its trace written
gzipped in Chrome's format under vLLM's name for it, holding the ops run between start and
stop on the starting thread; --profiler-config's torch options reach torch's profiler (read
back from the trace); VLLM_TORCH_PROFILER_DIR read with ~ expanded where the flag names no
profiler; the flag's bad values refused naming it."""

from __future__ import annotations

import gzip
import json
import os
import re
import socket
from pathlib import Path

import pytest
import torch

from aioserve.config.declaration import ConfigError
from aioserve.config.profiler import ProfilerSettings, profiler_config, profiler_settings
from aioserve.engine.step_profiler import ProfilerStateError, StepProfiler


def _profiler(directory: Path, **options) -> StepProfiler:
    return StepProfiler(ProfilerSettings(str(directory), **options))


def test_a_session_writes_the_ops_it_saw(tmp_path):
    profiler = _profiler(tmp_path / "new" / "folder")
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
    profiler = _profiler(tmp_path)
    with pytest.raises(ProfilerStateError, match="not running"):
        profiler.stop()
    profiler.start()
    with pytest.raises(ProfilerStateError, match="already running"):
        profiler.start()
    profiler.stop()
    profiler.start()  # a second session after the first
    assert profiler.stop() != profiler.directory


def _dir(environ, given=None):
    settings = profiler_settings(given or {}, environ)
    return None if settings is None else Path(settings.torch_profiler_dir)


def test_the_variable_names_the_folder():
    assert _dir({}) is None
    assert _dir({"VLLM_TORCH_PROFILER_DIR": ""}) is None
    assert _dir({"VLLM_TORCH_PROFILER_DIR": "/srv/traces"}) == Path("/srv/traces")
    assert _dir({"VLLM_TORCH_PROFILER_DIR": "~/t"}) == Path.home() / "t"


def test_the_flag_wins_over_the_variable():
    environ = {"VLLM_TORCH_PROFILER_DIR": "/srv/traces"}
    # Its options apply to the variable's profiler; naming a profiler overrides it.
    options = {"torch_profiler_with_stack": False}
    assert profiler_settings(options, environ) == ProfilerSettings("/srv/traces", **options)
    assert _dir(environ, {"profiler": "torch", "torch_profiler_dir": "/x"}) == Path("/x")
    assert _dir(environ, {"profiler": None}) is None
    assert _dir({}, {"profiler": "torch", "torch_profiler_dir": "rel"}) == Path.cwd() / "rel"


def _events(trace: Path) -> list[dict]:
    data = trace.read_bytes()
    if trace.name.endswith(".gz"):
        data = gzip.decompress(data)
    return json.loads(data)["traceEvents"]


def test_the_options_reach_the_trace(tmp_path):
    def session(**options) -> Path:
        profiler = _profiler(tmp_path, **options)
        profiler.start()
        torch.ones(8, 8).matmul(torch.ones(8, 8))
        return profiler.stop()

    plain = session(torch_profiler_with_stack=False, torch_profiler_use_gzip=False)
    assert plain.name.endswith(".pt.trace.json")  # not gzipped: JSON as it is
    [matmul] = [e for e in _events(plain) if e.get("name") == "aten::matmul"]
    assert "Input Dims" not in matmul["args"]
    assert not [e for e in _events(plain) if e.get("cat") == "python_function"]
    assert not [e for e in _events(plain) if e.get("name") == "[memory]"]

    rich = session(torch_profiler_record_shapes=True, torch_profiler_with_memory=True)
    assert rich.name.endswith(".pt.trace.json.gz")
    events = _events(rich)
    [matmul] = [e for e in events if e.get("name") == "aten::matmul"]
    assert matmul["args"]["Input Dims"] == [[8, 8], [8, 8]]
    assert [e for e in events if e.get("name") == "[memory]"]  # allocations recorded
    assert [e for e in events if e.get("cat") == "python_function"]  # the default stack
    # The CPU-only session's table of op times, next to the trace, as vLLM's workers write.
    [table] = tmp_path.glob("*.profiler_out.txt")
    assert "aten::matmul" in table.read_text() and "Self CPU" in table.read_text()


def test_cuda_needs_a_gpu(tmp_path):
    settings = ProfilerSettings(str(tmp_path), ("CPU", "CUDA"))
    if torch.cuda.is_available():
        assert StepProfiler(settings).running is False
    else:
        with pytest.raises(ConfigError, match="torch_profiler_activities: CUDA needs a GPU"):
            StepProfiler(settings)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"profiler": "cuda"}, "key 'profiler' 'cuda' is not supported by aioserve yet"),
        ({"profiler": "proton"}, "key 'profiler' 'proton' is not supported by aioserve yet"),
        ({"profiler": "nsys"}, "key 'profiler' must be torch, cuda or proton, got 'nsys'"),
        ({"proton_profiler_dir": "/x"}, "key 'proton_profiler_dir' is not supported by aioserve"),
        ({"capture_torch_profiler": True}, "key 'capture_torch_profiler' is not supported"),
        ({"delay_iterations": 2}, "key 'delay_iterations' is not supported by aioserve yet"),
        ({"torch_profiler_activities": ["XPU"]}, "'XPU' is not supported by aioserve yet"),
        ({"torch_profiler_activities": []}, "must be a non-empty list of CPU and CUDA"),
        ({"torch_profiler_activities": ["CPU", "CPU"]}, "must not contain duplicates"),
        ({"torch_profiler_with_stack": "yes"}, "must be true or false, got 'yes'"),
        ({"ignore_frontend": False}, "false is not supported by aioserve yet"),
        ({"torch_profile_dir": "/x"}, "has no key 'torch_profile_dir'"),
    ],
)  # fmt: skip
def test_bad_keys_are_refused(given, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        profiler_config(given)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"profiler": "torch"}, "torch_profiler_dir must be set when profiler is 'torch'"),
        ({"torch_profiler_dir": "/x"}, "torch_profiler_dir is only applicable when profiler"),
        (
            {"profiler": "torch", "torch_profiler_dir": "gs://b/t"},
            "torch_profiler_dir 'gs://b/t': remote folders",
        ),
    ],
)
def test_vllms_rules_between_keys(given, message):
    with pytest.raises(ConfigError, match=re.escape("--profiler-config: " + message)):
        profiler_settings(profiler_config(given), {})
