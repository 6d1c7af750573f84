"""--device, deprecated in vLLM (which finds the device itself): auto, or the device this
machine computes on, is taken; another is refused at start, naming the flag, before any
model is read; vLLM's other devices are refused by name."""

from __future__ import annotations

import pytest

from aioserve.config.declaration import ConfigError
from aioserve.config.engine import engine_config_from_kwargs
from aioserve.engine import build


@pytest.mark.parametrize(
    ("platform", "requested"),
    [("cpu", "auto"), ("cpu", "cpu"), ("cuda", "cuda"), ("rocm", "cuda"), ("cuda", "auto")],
)
def test_auto_or_this_machines_device_is_taken(monkeypatch, platform, requested):
    monkeypatch.setattr(build, "current_platform", lambda: platform)
    build.check_device(requested)


@pytest.mark.parametrize(
    ("platform", "requested", "found"),
    [("cpu", "cuda", "cpu"), ("cuda", "cpu", "cuda"), ("rocm", "cpu", "cuda")],
)
def test_another_device_is_refused_naming_the_flag(monkeypatch, platform, requested, found):
    monkeypatch.setattr(build, "current_platform", lambda: platform)
    with pytest.raises(ValueError) as error:
        build.check_device(requested)
    assert str(error.value) == (
        f"--device {requested}: this machine computes on {found}, which aioserve finds "
        f"itself; leave --device out (or give auto or {found})"
    )


def test_the_engine_checks_it_before_reading_the_model(monkeypatch):
    monkeypatch.setattr(build, "current_platform", lambda: "cpu")
    config = engine_config_from_kwargs(model="/no/such/model", device="cuda")
    with pytest.raises(ValueError, match="^--device cuda: this machine computes on cpu"):
        build.build_engine(config)


def test_vllms_other_devices_are_refused_by_name():
    with pytest.raises(ConfigError) as error:
        engine_config_from_kwargs(device="tpu")
    assert str(error.value) == (
        "device 'tpu' is not supported by aioserve yet (device accepts auto, cuda, cpu)"
    )
