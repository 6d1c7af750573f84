"""A program from a Debian package for a test: found on PATH, or installed with apt-get.

Tests that check aioserve against real system tools (systemd-analyze, Prometheus) install
the package where it is missing and the test runs as root with apt-get at hand, and skip,
saying why, only where that cannot be done.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def debian_program(program: str, package: str) -> str:
    """The path of `program`, installing Debian's `package` first if need be (or skip)."""
    found = shutil.which(program)
    if found:
        return found
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip(f"{program} is missing, and installing {package} needs apt-get run as root")
    install = ["apt-get", "install", "-y", "--no-install-recommends", package]
    environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run = dict(capture_output=True, text=True, env=environment, timeout=600)
    result = subprocess.run(install, **run)
    if result.returncode != 0:  # a slim image may have no package lists yet
        subprocess.run(["apt-get", "update"], **run)
        result = subprocess.run(install, **run)
    found = shutil.which(program)
    if found is None:
        said = " ".join((result.stdout + result.stderr).split())[-300:]
        pytest.skip(f"{program} is missing and `{' '.join(install)}` failed: {said}")
    return found
