"""dtype "auto" on the CPU: bfloat16 where the CPU computes it in hardware, float32 elsewhere
(with bfloat16 copies of the weights for the compiled single-row products)."""

from __future__ import annotations

import logging

import pytest
import torch

from aioserve.engine import build, resolution
from aioserve.platform import parse_cpu_flags

SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu vme sse2 avx avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
bugs\t\t: spectre_v1
"""
EPYC_AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx fma avx2\n"


def test_flags_are_read_from_the_first_flags_line():
    assert {"avx512_bf16", "amx_bf16"} <= parse_cpu_flags(SAPPHIRE_RAPIDS)
    assert "spectre_v1" not in parse_cpu_flags(SAPPHIRE_RAPIDS)
    assert parse_cpu_flags(EPYC_AVX2) == {"fpu", "sse2", "avx", "fma", "avx2"}
    assert parse_cpu_flags("no flags here") == frozenset()


@pytest.mark.parametrize(
    ("cpuinfo", "dtype", "reason"),
    [
        (
            SAPPHIRE_RAPIDS,
            torch.bfloat16,
            "bfloat16, which this CPU computes in hardware (amx_bf16)",
        ),
        (EPYC_AVX2, torch.float32, "float32, as this CPU has no bfloat16 arithmetic"),
    ],
)
def test_auto_picks_by_the_cpu_and_says_why(monkeypatch, caplog, cpuinfo, dtype, reason):
    monkeypatch.setattr(resolution, "current_platform", lambda: "cpu")
    monkeypatch.setattr("aioserve.platform.cpu_flags", lambda: parse_cpu_flags(cpuinfo))
    with caplog.at_level(logging.INFO, logger="aioserve"):
        assert resolution.resolve_dtype("auto", checkpoint=None) == dtype
    assert reason in caplog.text
    assert resolution.resolve_dtype("float32", checkpoint=None) == torch.float32  # asked: kept


def test_auto_on_a_float32_cpu_keeps_bfloat16_row_weights_when_compiled(monkeypatch, caplog):
    monkeypatch.setattr(build, "current_platform", lambda: "cpu")
    with caplog.at_level(logging.INFO, logger="aioserve"):
        assert (
            build.resolve_row_weight_dtype("auto", torch.float32, compiled=True) == torch.bfloat16
        )
    assert "single-row products read bfloat16 copies of the weights" in caplog.text
    # Asked for float32, eager, or computing in bfloat16 already: none.
    assert build.resolve_row_weight_dtype("float32", torch.float32, compiled=True) is None
    assert build.resolve_row_weight_dtype("auto", torch.float32, compiled=False) is None
    assert build.resolve_row_weight_dtype("auto", torch.bfloat16, compiled=True) is None
    monkeypatch.setattr(build, "current_platform", lambda: "cuda")
    assert build.resolve_row_weight_dtype("auto", torch.float32, compiled=True) is None


def test_the_compiled_step_reads_the_platform_without_a_warning():
    """Kernels ask `use_triton()` inside the compiled step; a functools cache there made
    dynamo warn in every server's log."""
    import warnings

    from aioserve.kernels.dispatch import use_triton

    def step(x: torch.Tensor) -> torch.Tensor:
        return x + 1 if use_triton() else x * 2

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(step, backend="eager")(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 2.0))
    assert not [w for w in caught if "lru_cache" in str(w.message)], caught
