"""bench/decode_roofline.py, run as a user would on the CPU: Llama-3-8B's config (the one
gpu_session.sh uses) shrunk to a few layers, random weights, no tokenizer."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.child_process import die_with_parent

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_decode_speed_and_bytes_read_of_an_untied_llama(tmp_path):
    config = json.loads((BENCH / "gpu_model_llama3_8b" / "config.json").read_text())
    config.update(
        num_hidden_layers=2,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = [sys.executable, str(BENCH / "decode_roofline.py"), "--model", str(tmp_path)]
    argv += ["--tokens", "4", "--repeats", "2", "--context", "8", "--copy-mib", "16"]
    argv += ["--enforce-eager", "--dtype", "float32", "--peak-gbps", "100"]
    run = subprocess.run(
        argv, capture_output=True, text=True, timeout=300, preexec_fn=die_with_parent
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    # Every weight once a token, float32, but not the input embedding table (untied head).
    hidden, inter, vocab = 256, 512, config["vocab_size"]
    per_layer = hidden * (256 + 128 + 128) + 256 * hidden + 3 * hidden * inter + 2 * hidden
    expected = 4 * (2 * per_layer + hidden + vocab * hidden)
    assert f"{expected / 1e9:.3f} GB of weights read a token" in out, out
    step_ms = float(re.search(r"decode at batch 1: ([\d.]+) ms/token", out).group(1))
    achieved = float(re.search(r"achieved: ([\d.]+) GB/s", out).group(1))
    assert abs(achieved - expected / (step_ms / 1e3) / 1e9) <= 0.1 + 0.01 * achieved
    assert re.search(r"^peak: 100 GB/s \(\d+% of it, floor 1\.36\d ms\)$", out, re.MULTILINE), out
