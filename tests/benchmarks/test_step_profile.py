"""bench/step_profile.py, run as a user would on the default model at small sizes: steps
counted by kind, and the operator table of one prefill and one decode step."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.child_process import die_with_parent

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "step_profile.py"


def test_steps_are_counted_by_kind_and_one_of_each_is_profiled(smollm2_gguf):
    argv = [sys.executable, str(SCRIPT), "--model", str(smollm2_gguf), "--ops"]
    argv += ["--num-prompts", "4", "--input-len", "32", "--output-len", "12"]
    argv += ["--max-num-batched-tokens", "128", "--max-model-len", "256", "--warmup-steps", "2"]
    run = subprocess.run(
        argv, capture_output=True, text=True, timeout=300, preexec_fn=die_with_parent
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "host memory tuning: tensors of 2 MiB and more on transparent huge pages" in out
    assert re.search(r"^176 tokens in [\d.]+ s", out, flags=re.MULTILINE), out
    steps = dict(re.findall(r"^(prefill|decode|other) +(\d+) steps", out, flags=re.MULTILINE))
    # One 128-token prefill and 11 decode steps of 4 rows; one of each is profiled, not timed.
    assert steps == {"decode": "10"}, out
    for kind in ("prefill", "decode"):
        table = out.split(f"one {kind} step, by operator:")[1]
        # The dense products: torch's GEMM, or oneDNN on packed bfloat16 weights.
        assert "aten::mm" in table or "mkldnn::_linear_pointwise" in table, table
        assert "aioserve::paged_attention" in table, table
