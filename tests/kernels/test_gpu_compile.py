"""GPU readiness without a GPU: every Triton kernel compiles for H100 (sm_90a) and MI300
(gfx942) at its real launch configurations, without a register spill, and no kernel orders
a store before another thread's atomic with a barrier alone (gpu_compile.py says how).

The compiler runs in a child process without TRITON_INTERPRET, which this test session
sets for the interpreter tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aioserve import kernels
from tests.kernels import gpu_compile

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def results() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9's default, without its warning
    # One process per target, side by side: the compiles take a core each.
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.kernels.gpu_compile", platform],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for platform in gpu_compile.TARGETS
    ]
    lines = []
    for child in children:
        out, err = child.communicate(timeout=600)
        assert child.returncode == 0, err[-3000:]
        lines += out.splitlines()
    return [json.loads(line) for line in lines]


def launch_kernels() -> set[str]:
    """The names of the @triton.jit kernels the launchers launch (the others are helpers
    that kernels call)."""
    source = Path(kernels.__file__).parent
    names = set()
    for path in source.rglob("*.py"):
        lines = path.read_text().splitlines()
        for above, line in zip(lines, lines[1:], strict=False):
            if above.strip() == "@triton.jit" and line.startswith("def _") and "_kernel(" in line:
                names.add(line[4 : line.index("(")])
    return names


@pytest.mark.parametrize("platform", list(gpu_compile.TARGETS))
def test_every_kernel_compiles_without_spills(results, platform):
    mine = [r for r in results if r["platform"] == platform]
    assert {r["kernel"] for r in mine} == launch_kernels()
    failed = [r for r in mine if "error" in r]
    assert failed == [], failed[0]
    spilled = [
        (r["kernel"], r["constexprs"], r["options"], r["spills"]) for r in mine if r["spills"]
    ]
    assert spilled == []


def test_no_kernel_orders_a_store_and_an_atomic_with_a_barrier_alone(results):
    racy = {r["kernel"] for r in results if r.get("barrier_and_atomic")}
    assert racy == set()
