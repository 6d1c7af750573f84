"""The device's family and 8-bit floats: which launch-table rows a GPU gets, which e4m3 it
computes with, and what is refused, or dequantized, on a GPU that has none."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from aioserve import platform
from aioserve.engine import build, served_weights
from aioserve.runner.kv_memory import kv_cache_torch_dtype


def as_device(monkeypatch: pytest.MonkeyPatch, platform_name: str, gpu: str) -> None:
    """Make aioserve.platform answer as a device `gpu` of `platform_name` would."""
    monkeypatch.setattr(platform, "_platform", platform_name)
    monkeypatch.setattr(platform, "_gpu", gpu)
    monkeypatch.setattr(platform, "_arch", None)
    monkeypatch.setattr(platform, "_compute_units", None)


@pytest.mark.parametrize(
    ("platform_name", "gpu", "family"),
    [
        ("cuda", "sm_90", "hopper"),  # H100, H200
        ("cuda", "sm_100", "hopper"),  # B200, until Blackwell has rows of its own
        ("cuda", "sm_80", "ampere"),  # A100
        ("cuda", "sm_86", "ampere"),  # A10, RTX 3090
        ("cuda", "sm_89", "ampere"),  # L40S, RTX 4090
        ("rocm", "gfx942", "cdna3"),  # MI300X
        ("rocm", "gfx950", "cdna3"),  # MI355X
        ("rocm", "gfx90a", "cdna2"),  # MI250X
        ("rocm", "gfx1100", "rdna3"),  # RX 7900 XTX
        ("rocm", "gfx1201", "rdna3"),  # RX 9070 XT: wave32 as RDNA3
        ("cpu", "", "cpu"),
    ],
)
def test_each_gpu_gets_its_family(monkeypatch, platform_name, gpu, family):
    assert platform.arch_family(platform_name, gpu) == family
    as_device(monkeypatch, platform_name, gpu)
    assert platform.current_arch() == family


def test_a_launch_table_gives_the_familys_row_else_the_platforms(monkeypatch):
    table = {"cuda": "cuda row", "rocm": "rocm row", "rdna3": "rdna3 row", "cpu": "cpu row"}
    for platform_name, gpu, row in [
        ("rocm", "gfx1100", "rdna3 row"),
        ("rocm", "gfx942", "rocm row"),
        ("cuda", "sm_80", "cuda row"),
        ("cpu", "", "cpu row"),
    ]:
        as_device(monkeypatch, platform_name, gpu)
        assert platform.launch_entry(table) == row


def test_compute_units_are_the_devices_sms_or_cus_and_one_on_the_cpu(monkeypatch):
    as_device(monkeypatch, "cpu", "")
    assert platform.compute_units() == 1
    as_device(monkeypatch, "cuda", "sm_90")
    properties = SimpleNamespace(multi_processor_count=114)  # an H100 PCIe card
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: properties)
    assert platform.compute_units() == 114


@pytest.mark.parametrize(
    ("platform_name", "gpu", "e4m3"),
    [
        ("cuda", "sm_90", torch.float8_e4m3fn),
        ("cuda", "sm_89", torch.float8_e4m3fn),
        ("rocm", "gfx942", torch.float8_e4m3fnuz),
        ("rocm", "gfx950", torch.float8_e4m3fn),
        ("rocm", "gfx90a", torch.float8_e4m3fn),
        ("cpu", "", torch.float8_e4m3fn),
    ],
)
def test_the_e4m3_a_device_computes_with(monkeypatch, platform_name, gpu, e4m3):
    as_device(monkeypatch, platform_name, gpu)
    assert platform.e4m3_missing() is None
    assert platform.e4m3_dtype() == e4m3
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) == e4m3
    assert kv_cache_torch_dtype("fp8_e4m3", torch.bfloat16) == e4m3


@pytest.mark.parametrize("gpu", ["sm_80", "sm_86"])
def test_an_nvidia_gpu_before_sm89_refuses_e4m3_by_name(monkeypatch, gpu):
    as_device(monkeypatch, "cuda", gpu)
    assert gpu in platform.e4m3_missing()
    for requested in ("fp8", "fp8_e4m3"):
        with pytest.raises(ValueError, match=f"--kv-cache-dtype {requested} .*fp8_e5m2"):
            kv_cache_torch_dtype(requested, torch.bfloat16)
    assert kv_cache_torch_dtype("fp8_e5m2", torch.bfloat16) == torch.float8_e5m2
    with pytest.raises(ValueError, match="--quantization fp8 cannot run here"):
        build.check_quantize_to_fp8(SimpleNamespace(quantize_to_fp8=True))


def test_an_fp8_checkpoint_is_dequantized_on_a_gpu_without_e4m3(monkeypatch, caplog):
    checkpoint = SimpleNamespace(fp8_scheme=object())
    as_device(monkeypatch, "cuda", "sm_90")
    assert served_weights.resolve_fp8_weights(checkpoint)
    as_device(monkeypatch, "cuda", "sm_80")
    with caplog.at_level(logging.WARNING, logger="aioserve"):
        assert not served_weights.resolve_fp8_weights(checkpoint)
    assert "dequantized at load" in caplog.text and "sm_80" in caplog.text
    as_device(monkeypatch, "cpu", "")
    assert not served_weights.resolve_fp8_weights(checkpoint)
