"""bench/kernel_bandwidth.py, the GPU session's kernel benchmark, in the mode the CPU can run.

Timing needs a GPU; `--check-only` runs every case's check (Triton, interpreted, against
the torch reference) at tiny shapes, so the script cannot rot between GPU sessions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "kernel_bandwidth.py"
KERNELS = (
    "rms_norm",
    "rotary",
    "silu_and_mul",
    "write_kv_cache",
    "paged_attention",
    "gguf_linear",
)


def run_script(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "AIOSERVE_KERNEL_BACKEND"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only modes")
def test_check_only_passes_every_case_under_the_interpreter(tmp_path):
    result = run_script("--check-only", "--json", str(tmp_path / "rows.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    kernels = {row["kernel"] for row in rows}
    assert all(any(name in kernel for kernel in kernels) for name in KERNELS), kernels
    assert rows and all(row["status"] == "ok" for row in rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only modes")
def test_timing_without_a_gpu_is_refused():
    result = run_script()
    assert result.returncode == 2
    assert "--check-only" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only modes")
def test_only_runs_the_cases_its_expression_matches(tmp_path):
    result = run_script(
        "--check-only", "--only", r"^fp8_linear \|.*decode", "--json", str(tmp_path / "r.json")
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert rows and {row["kernel"] for row in rows} == {"fp8_linear"}
    assert all("decode" in row["shape"] for row in rows)


def test_cuda_graphs_with_check_only_is_refused():
    result = run_script("--check-only", "--cuda-graphs")
    assert result.returncode == 2
    assert "--cuda-graphs" in result.stderr
