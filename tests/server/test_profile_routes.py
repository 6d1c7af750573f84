"""/start_profile and /stop_profile (--profiler-config, or VLLM_TORCH_PROFILER_DIR): a
session's trace holds the ops of the steps it covered, written where the flag (or else the
variable) says, with the flag's options; the routes exist only when one asks for the torch
profiler; starting twice or stopping a stopped profiler is a 400; --api-key protects them.
The profiler itself: engine/step_profiler.py, tests/engine/test_step_profiler.py.
"""

from __future__ import annotations

import gzip
import json

import pytest

from tests.server.conftest import serve_built
from tests.server.openai_helpers import post
from tests.server.serve_process import fetch

pytestmark = pytest.mark.usefixtures("no_api_key_env")


def test_a_session_traces_the_steps_it_covers(server_loop, engine, tmp_path, monkeypatch):
    traces = tmp_path / "traces"
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(traces))
    with serve_built(server_loop, engine) as url:
        assert post(url, "/start_profile").status == 200
        reply = post(url, "/v1/completions", {"prompt": "Hello", "max_tokens": 3})
        assert reply.status == 200
        stop = post(url, "/stop_profile")
        assert stop.status == 200 and stop.body == b""
    [trace] = traces.glob("*.pt.trace.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    ops = [event["name"] for event in events if event.get("cat") == "cpu_op"]
    # The model's products of the steps the session covered (run on the model thread).
    assert ops.count("aten::mm") >= engine.hf_config.num_hidden_layers


def test_the_flag_says_where_and_what(server_loop, engine, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "from-the-variable"))
    config = {
        "profiler": "torch",
        "torch_profiler_dir": str(tmp_path / "from-the-flag"),
        "torch_profiler_use_gzip": False,
        "torch_profiler_record_shapes": True,
        "torch_profiler_with_stack": False,
    }
    with serve_built(server_loop, engine, "--profiler-config", json.dumps(config)) as url:
        assert post(url, "/start_profile").status == 200
        assert post(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status == 200
        assert post(url, "/stop_profile").status == 200
    assert not (tmp_path / "from-the-variable").exists()
    [trace] = (tmp_path / "from-the-flag").glob("*.pt.trace.json")  # not gzipped
    events = json.loads(trace.read_bytes())["traceEvents"]
    shapes = [e["args"].get("Input Dims") for e in events if e.get("name") == "aten::mm"]
    assert shapes and all(len(dims) == 2 for dims in shapes)  # record_shapes
    assert not [e for e in events if e.get("cat") == "python_function"]  # with_stack false


def test_the_flag_without_a_profiler_turns_the_variable_off(
    server_loop, engine, tmp_path, monkeypatch
):
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path))
    with serve_built(server_loop, engine, "--profiler-config.profiler", "null") as url:
        assert post(url, "/start_profile").status == 404


def test_starting_twice_or_stopping_a_stopped_profiler_is_a_400(
    server_loop, engine, tmp_path, monkeypatch
):
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path))
    with serve_built(server_loop, engine) as url:
        reply = post(url, "/stop_profile")
        assert reply.status == 400
        assert reply.json()["error"]["message"] == "the profiler is not running: start it first"
        assert post(url, "/start_profile").status == 200
        reply = post(url, "/start_profile")
        assert reply.status == 400
        assert reply.json()["error"]["message"] == "the profiler is already running: stop it first"
        assert post(url, "/stop_profile").status == 200
        assert post(url, "/stop_profile").status == 400


def test_the_routes_exist_only_with_the_variable(server_loop, engine, monkeypatch):
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    with serve_built(server_loop, engine) as url:
        assert post(url, "/start_profile").status == 404
        assert post(url, "/stop_profile").status == 404


def test_the_api_key_protects_them(server_loop, engine, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path))
    with serve_built(server_loop, engine, "--api-key", "k") as url:
        assert post(url, "/start_profile").status == 401
        authorized = {"Authorization": "Bearer k"}
        assert fetch("POST", url + "/start_profile", headers=authorized).status == 200
        assert fetch("POST", url + "/stop_profile", headers=authorized).status == 200
