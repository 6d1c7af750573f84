"""bench/moe_model.py and bench/moe_layer.py, run as a user would at small sizes: the random
MoE checkpoint they write loads into aioserve's Qwen3-MoE with every expert in place, and
the layer timing prints a row per token count."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

from aioserve.models.checkpoint import open_checkpoint
from aioserve.models.loader import load_model
from tests.child_process import die_with_parent

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _run(argv: list[str]) -> str:
    run = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=300,
        preexec_fn=die_with_parent,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def test_the_moe_checkpoint_loads_with_its_experts(tiny_model, tmp_path):
    out = _run(
        [str(BENCH / "moe_model.py"), str(tmp_path), "--tokenizer-from", tiny_model]
        + ["--experts", "4", "--top-k", "2", "--layers", "2", "--hidden", "256"]
        + ["--moe-intermediate", "32"]
    )
    assert "4 experts, top 2" in out, out
    model = load_model(
        open_checkpoint(str(tmp_path)), dtype=torch.float32, device=torch.device("cpu")
    )
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert model.layers[1].mlp.w13.shape == (4, 64, 256)
    assert (tmp_path / "tokenizer.json").exists()


def test_the_layer_timing_prints_a_row_per_token_count():
    out = _run(
        [str(BENCH / "moe_layer.py"), "--experts", "4", "--top-k", "2", "--hidden", "32"]
        + ["--moe-intermediate", "16", "--tokens", "1", "5"]
    )
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+|no oneDNN bf16) \|$", out, re.M)
    assert [row[0] for row in rows] == ["1", "5"], out
