"""bench/one_stream.py, run as a user would on the default model at small sizes: the time
per output token at one stream beside the model step and the step's preparation."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.child_process import die_with_parent

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "one_stream.py"


def test_a_tokens_time_is_split_into_the_model_step_and_the_rest(smollm2_gguf):
    argv = [sys.executable, str(SCRIPT), "--model", str(smollm2_gguf)]
    # Three runs each: the medians then hold through one stalled run of either length (a
    # 1 s stall, beside another test worker, once made the difference -118 ms a token).
    argv += ["--input-len", "16", "--output-len", "8", "--repeats", "3"]
    run = subprocess.run(
        argv, capture_output=True, text=True, timeout=300, preexec_fn=die_with_parent
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "one stream, 16 in / 8 out, 3 runs each" in out, out
    figures = dict(
        re.findall(r"^(time per output token|model step \(median\)) +([\d.]+) ms", out, re.M)
    )
    assert len(figures) == 2, out
    assert float(figures["model step (median)"]) > 0, out
    assert float(figures["time per output token"]) > 0, out
    assert re.search(r"^preparing a step +\d+ us wall, \d+ us CPU$", out, re.M), out
