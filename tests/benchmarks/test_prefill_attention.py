"""bench/prefill_attention.py, run as a user would: each method's output must agree with the
engine's products (the script asserts it) and every method gets its row."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.child_process import die_with_parent

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_products_and_sdpa_agree_and_are_timed():
    argv = [sys.executable, str(BENCH / "prefill_attention.py"), "--prompts", "2"]
    argv += ["--length", "200", "--chunk-rows", "64", "--key-align", "64", "--repeats", "1"]
    run = subprocess.run(
        argv, capture_output=True, text=True, timeout=300, preexec_fn=die_with_parent
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "chunks of 64 rows, keys aligned to 64" in run.stdout, run.stdout
    for method in ("products", "sdpa"):
        row = re.search(rf"^\| {method} \| ([0-9.]+) \| ([0-9.e+-]+) \|$", run.stdout, re.M)
        assert row is not None, run.stdout
        assert float(row.group(1)) > 0
