"""bench/startup_timeline.py, run as a user would: every phase of a start stamped in order,
and the server stopped once healthy (eager, so that no compile is waited for)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.child_process import die_with_parent

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "startup_timeline.py"
PHASES = (
    "opening the checkpoint",
    "loading the model",
    "building the runner",
    "zeroing the KV pool on its thread",
    "joining the KV pool's zeroing",
    "compiling the model step",
)


def test_every_phase_is_stamped_in_order_and_the_server_stops(smollm2_gguf):
    argv = [sys.executable, str(SCRIPT), str(smollm2_gguf), "--enforce-eager"]
    argv += ["--max-model-len", "512"]
    run = subprocess.run(
        argv, capture_output=True, text=True, timeout=300, preexec_fn=die_with_parent
    )
    assert run.returncode == 0, run.stderr[-3000:]
    stamps = re.findall(r"^\[ *([\d.]+) s\] (.+)$", run.stderr, flags=re.MULTILINE)
    # The zeroing thread's lines may come out of order with the main thread's.
    at = {event: float(seconds) for seconds, event in stamps}
    assert [event for _, event in stamps][:2] == ["torch imported", "aioserve's engine imported"]
    assert at["healthy"] == max(at.values())
    for phase in PHASES:
        assert at["aioserve's engine imported"] <= at[f"{phase} starts"] <= at[f"{phase} ends"]
