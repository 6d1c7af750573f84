"""GPU readiness without a GPU: every Triton kernel compiles for a member of each GPU
family its launch tables tell apart (H100 sm_90a, A100 sm_80, MI300 gfx942, MI200 gfx90a,
RDNA3 gfx1100) at its real launch configurations, without a register spill, within the
family's shared memory, and no kernel orders a store before another thread's atomic with a
barrier alone (gpu_compile.py says how).

The compiler runs in child processes without TRITON_INTERPRET, which this test session
sets for the interpreter tests: two, one a core, each taking its share of the families.
A launch whose compile key is in gpu_compile_record.json is taken from there, one of each
kernel compiled again on one family to check the record (gpu_compile.py says why and how).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from aioserve import kernels
from tests.kernels import gpu_compile

ROOT = Path(__file__).resolve().parents[2]
# The families each of the two child processes compiles, about even in time (the record
# checks fall most on RDNA3 and CDNA3: `gpu_compile.checking_family`).
_SHARES = (("rdna3", "cdna3"), ("hopper", "ampere", "cdna2"))


@pytest.fixture(scope="module")
def results() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.kernels.gpu_compile", *archs],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for archs in _SHARES
    ]
    lines = []
    for child in children:
        out, err = child.communicate(timeout=600)
        assert child.returncode == 0, err[-3000:]
        lines += out.splitlines()
    return [json.loads(line) for line in lines]


def launch_kernels(never_launched: tuple[str, ...] = ()) -> set[str]:
    """The names of the @triton.jit kernels the launchers launch (the others are helpers
    that kernels call), but for those of the modules named in `never_launched`."""
    source = Path(kernels.__file__).parent
    names = set()
    for path in source.rglob("*.py"):
        if path.stem in never_launched:
            continue
        lines = path.read_text().splitlines()
        for above, line in zip(lines, lines[1:], strict=False):
            if above.strip() == "@triton.jit" and line.startswith("def _") and "_kernel(" in line:
                names.add(line[4 : line.index("(")])
    return names


@pytest.mark.parametrize("arch", list(gpu_compile.TARGETS))
def test_every_kernel_compiles_without_spills(results, arch):
    target = gpu_compile.TARGETS[arch]
    mine = [r for r in results if r["arch"] == arch]
    assert {r["kernel"] for r in mine} == launch_kernels(target.never_launched)
    failed = [r for r in mine if "error" in r]
    assert failed == [], failed[0]
    spilled = [
        (r["module"], r["kernel"], r["constexprs"], r["options"], r["spills"])
        for r in mine
        if r["spills"] and not known_spill(arch, r)
    ]
    assert spilled == []
    limit = gpu_compile.TARGETS[arch].shared_bytes
    too_large = [(r["module"], r["kernel"], r["shared"]) for r in mine if r["shared"] > limit]
    assert too_large == []


def known_spill(arch: str, result: dict) -> bool:
    """The spills no tile removed (kernels/attention_launch.py): RDNA3's attention at head
    size 256, or over fp8 keys from head size 128. Everything else spills nothing on every
    family."""
    constexprs = result["constexprs"]
    return (
        arch == "rdna3"
        and result["module"] == "aioserve.kernels.attention_triton"
        and result["kernel"] in ("_decode_kernel", "_prefill_kernel")
        and (
            constexprs["BLOCK_D"] == 256 or (constexprs["KV_FP8"] and constexprs["BLOCK_D"] >= 128)
        )
    )


def test_rdna3s_known_spills_are_only_those(results):
    """RDNA3's known spills are still there: if a Triton release or a new tile removes
    them, the exception above should go too."""
    for kernel in ("_decode_kernel", "_prefill_kernel"):
        for head_size in (128, 256):
            cases = [
                r
                for r in results
                if r["arch"] == "rdna3"
                and r["kernel"] == kernel
                and r["constexprs"]["BLOCK_D"] == head_size
                and known_spill("rdna3", r)
            ]
            assert any(r["spills"] for r in cases), (kernel, head_size)


def test_no_kernel_orders_a_store_and_an_atomic_with_a_barrier_alone(results):
    racy = {r["kernel"] for r in results if r.get("barrier_and_atomic")}
    assert racy == set()


def test_the_record_is_the_compilers_word(results):
    """The launches compiled again agree with the record, every kernel taken from it was
    checked so on its checking family, each family checked some, and the compile key is
    Triton's own (the start of the kernel's hash)."""
    compiled = [r for r in results if "hash" in r]
    assert all(r["hash"].startswith(r["key"]) for r in compiled)
    checked = [r for r in compiled if "recorded" in r]
    disagree = [
        (r["arch"], r["kernel"], r["recorded"], {m: r[m] for m in r["recorded"]})
        for r in checked
        if r["recorded"] != {m: r[m] for m in r["recorded"]}
    ]
    assert disagree == []
    from_record = {(r["module"], r["kernel"]) for r in results if r.get("from_record")}
    checked_on = {(r["module"], r["kernel"]): r["arch"] for r in checked}
    assert from_record <= checked_on.keys()
    assert all(gpu_compile.checking_family(*k) == arch for k, arch in checked_on.items())
    assert set(checked_on.values()) == set(gpu_compile.TARGETS)


def test_the_record_holds_every_launch(results):
    """Every launch was in the record, so the test stays near half a minute: after a
    change to a kernel or a launch table, `python -m tests.kernels.gpu_compile
    --write-record` records the new launches (this test then names none). Under another
    Triton build (the test extra asks for any release from 3.2; a wheel for another Python
    or ptxas differs too) every key differs: the launches are all compiled, checked as
    above, and this test is skipped."""
    written_with = gpu_compile.read_record()["compiler"]
    if written_with != gpu_compile.compiler_build():
        pytest.skip(f"the record was written by another Triton build than {triton.__version__}")
    missing = [
        (r["arch"], r["kernel"], r["constexprs"])
        for r in results
        if "hash" in r and "recorded" not in r
    ]
    assert missing == [], f"{len(missing)} launches not in the record, the first: {missing[0]}"
