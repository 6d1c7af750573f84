"""aioserve/environment.py: `environment_report()` keeps the lines `aioserve collect-env`
printed before it was built on `environment_info()`, and both say the same facts.
"""

from __future__ import annotations

import os
import re
import sys
from importlib import metadata

import pytest

from aioserve.environment import environment_info, environment_report
from aioserve.platform import current_platform

_VERSION = r"(\S+|not installed)"
_HEAD = [
    r"aioserve: \S+",
    r"python: \d+\.\d+\.\d+\S*",
    *(rf"{name}: {_VERSION}" for name in ("torch", "transformers", "tokenizers", "safetensors")),
    rf"gguf: {_VERSION}",
    rf"triton: {_VERSION}",
    r"torch build: cuda \S+, hip \S+",
    r"os: \S.*",
    r"platform: (cpu|cuda|rocm)",
]
_GPU = [r"gpus: \d+ x \S.*", r"gpu architecture: \S+ \(launch tables: \S+\)"]
_TAIL = [r"cpus: \d+ \(usable by this process: (\d+|unknown)\)", r"cpu kv cache: 2 GiB"]
"""The lines collect-env printed before environment.py, as patterns (the host's values vary):
the GPU lines only off the CPU; then "environment:" and one "  NAME=value" line a variable."""


@pytest.fixture
def environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    monkeypatch.setenv("VLLM_API_KEY", "sekrit")
    monkeypatch.setenv("HF_TOKEN", "hf-sekrit")
    monkeypatch.setenv("VLLM_FOO_TEST", "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.usefixtures("environment")
def test_the_report_keeps_the_collect_env_lines():
    lines = environment_report().split("\n")
    patterns = _HEAD + (_GPU if current_platform() != "cpu" else []) + _TAIL + ["environment:"]
    assert len(lines) > len(patterns)
    for line, pattern in zip(lines, patterns, strict=False):
        assert re.fullmatch(pattern, line), (pattern, line)
    variables = lines[len(patterns) :]
    assert all(re.fullmatch(r"  [A-Z_0-9]+=.*", line) for line in variables), variables
    names = [line.split("=")[0].strip() for line in variables]
    assert names == sorted(names)
    for shown in (
        "VLLM_API_KEY=<hidden>",
        "HF_TOKEN=<hidden>",
        "VLLM_FOO_TEST=1",
        "VLLM_CPU_KVCACHE_SPACE=2",
        "TRITON_INTERPRET=<unset>",
        "AIOSERVE_KERNEL_BACKEND=" + os.environ.get("AIOSERVE_KERNEL_BACKEND", "<unset>"),
    ):
        assert f"  {shown}" in variables
    assert f"aioserve: {metadata.version('aioserve')}" == lines[0]
    assert f"python: {sys.version.split()[0]}" == lines[1]
    assert "sekrit" not in environment_report()


def test_a_bad_kv_cache_size_is_reported_not_raised(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "lots")
    info = environment_info()
    assert info["cpu_kvcache_space_bytes"] is None
    assert "VLLM_CPU_KVCACHE_SPACE" in info["cpu_kvcache_error"]
    assert f"cpu kv cache: invalid ({info['cpu_kvcache_error']})" in environment_report()


@pytest.mark.usefixtures("environment")
def test_the_info_holds_what_the_report_prints():
    info = environment_info()
    report = environment_report()
    assert info["cpu_kvcache_space_bytes"] == 2 * 2**30 and info["cpu_kvcache_error"] is None
    assert info["environment"]["VLLM_API_KEY"] == "<hidden>"
    assert info["environment"]["TRITON_INTERPRET"] is None
    assert info["versions"]["torch"] == metadata.version("torch")
    assert f"torch: {info['versions']['torch']}" in report
    assert f"os: {info['os']}" in report and f"cpus: {info['cpus']} " in report
    if info["platform"] == "cpu":
        assert info["gpus"] == [] and info["gpu_architecture"] is None
    else:
        assert f"gpus: {len(info['gpus'])} x " in report
