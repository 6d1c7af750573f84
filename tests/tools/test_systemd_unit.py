"""tools/aioserve.service: `systemd-analyze verify` accepts it, and it fits the server it runs.

`systemd-analyze verify` checks that ExecStart's program exists, so it runs on a copy whose
ExecStart is this test's Python. It exits 0 on an unknown key or an unparsable value (it
only warns), so any line it prints about the unit fails the test as well. Where
`systemd-analyze` is missing, the test installs Debian's `systemd` package (apt-get, as
root) and skips, saying why, only where that cannot be done.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from aioserve.config.frontend import FrontendConfig, frontend_config_from_args
from aioserve.config.parser import build_engine_parser
from aioserve.server.http_runner import CLOSE_GRACE_S
from tests.debian_packages import debian_program

TOOLS = Path(__file__).resolve().parents[2] / "tools"
UNIT = TOOLS / "aioserve.service"
ENV_FILE = TOOLS / "aioserve.env"


@pytest.fixture(scope="module")
def systemd_analyze() -> str:
    return debian_program("systemd-analyze", "systemd")


def _verify(systemd_analyze: str, unit_text: str, folder: Path) -> list[str]:
    """What `systemd-analyze verify` says against the unit: its exit status and every line about it."""
    copy = folder / UNIT.name
    copy.write_text(unit_text)
    result = subprocess.run(
        [systemd_analyze, "verify", str(copy)], capture_output=True, text=True, timeout=120
    )
    about_the_unit = [
        line for line in (result.stdout + result.stderr).splitlines() if UNIT.name in line
    ]
    return ([f"exit status {result.returncode}"] if result.returncode else []) + about_the_unit


def _with_this_python(unit_text: str) -> str:
    text, count = re.subn(
        r"^ExecStart=\S+", f"ExecStart={sys.executable}", unit_text, flags=re.MULTILINE
    )
    assert count == 1
    return text


def test_systemd_analyze_verify_accepts_the_unit(systemd_analyze, tmp_path):
    assert _verify(systemd_analyze, _with_this_python(UNIT.read_text()), tmp_path) == []


@pytest.mark.parametrize(
    ("broken", "by"),
    [
        ("WatchdogSec=60s", "WatchdogSec=sixty"),
        ("Type=notify", "Typ=notify"),
        ("Restart=on-failure", "Restart=sometimes"),
    ],
)
def test_verify_here_catches_a_broken_unit(systemd_analyze, tmp_path, broken, by):
    text = _with_this_python(UNIT.read_text())
    assert broken in text
    assert _verify(systemd_analyze, text.replace(broken, by), tmp_path) != []


def _settings(path: Path) -> dict[str, list[str]]:
    """KEY -> every value it is given, from a unit or environment file (comments skipped)."""
    settings: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def _seconds(span: str) -> float:
    number, unit = re.fullmatch(r"(\d+)(s|min)", span).groups()
    return int(number) * (60 if unit == "min" else 1)


def _serve_options(argv: list[str]) -> FrontendConfig:
    return frontend_config_from_args(build_engine_parser("aioserve serve").parse_args(argv))


def test_the_unit_runs_the_serve_command_as_systemd_expects_it():
    unit = _settings(UNIT)
    assert unit["Type"] == ["notify"]
    assert unit["Restart"] == ["on-failure"]
    assert _seconds(unit["WatchdogSec"][0]) > 0
    (exec_start,) = unit["ExecStart"]
    assert exec_start.split()[1:] == [
        "-m", "aioserve", "serve", "$AIOSERVE_MODEL", "$AIOSERVE_ARGS",
    ]  # fmt: skip
    assert unit["DynamicUser"] == ["yes"]
    for setting in ("NoNewPrivileges", "ProtectHome", "PrivateTmp"):
        assert unit[setting] == ["yes"], setting
    assert unit["ProtectSystem"] == ["strict"]
    # Under ProtectSystem=strict the caches must lie in the service's own writable folders.
    environment = dict(value.split("=", 1) for value in unit["Environment"])
    for variable in ("HF_HOME", "TORCHINDUCTOR_CACHE_DIR", "AIOSERVE_CACHE_DIR", "XDG_CACHE_HOME"):
        assert environment[variable].startswith("%C/aioserve"), variable
    assert unit["CacheDirectory"] == unit["StateDirectory"] == ["aioserve"]


def test_the_example_environment_file_fits_the_unit_and_the_command():
    unit = _settings(UNIT)
    assert unit["EnvironmentFile"] == [f"/etc/aioserve/{ENV_FILE.name}"]
    env = _settings(ENV_FILE)
    (model,) = env["AIOSERVE_MODEL"]
    (flags,) = env["AIOSERVE_ARGS"]
    example = _serve_options([model, *shlex.split(flags)])  # real flags, valid values
    # systemd waits for the drain and the aborted requests' last bytes before SIGKILL,
    # with the example's --shutdown-timeout and with the server's default.
    for drain in (example.shutdown_timeout, _serve_options([]).shutdown_timeout):
        assert _seconds(unit["TimeoutStopSec"][0]) >= drain + CLOSE_GRACE_S
