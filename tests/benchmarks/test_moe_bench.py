"""bench/moe_model.py, bench/moe_layer.py and bench/fp8_block_checkpoint.py, run as a user
would at small sizes: the random MoE checkpoint they write loads into aioserve's Qwen3-MoE
with every expert in place, the layer timing prints a row per token count, and its
block-wise FP8 copy reads alike in transformers and aioserve."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

from aioserve.models.checkpoint import open_checkpoint
from aioserve.models.loader import load_model
from tests.child_process import die_with_parent
from tests.models.tiny_models import PagedRunner

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


def test_the_fp8_block_copy_is_read_alike_by_transformers_and_aioserve(tiny_model, tmp_path):
    """bench/fp8_block_checkpoint.py's copy of a random MoE: transformers' own FineGrainedFP8
    loader and aioserve read it into the same model (logits within float32's rounding), and
    its experts are the 16-bit ones within e4m3's rounding."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    source, fp8 = tmp_path / "bf16", tmp_path / "fp8"
    _run(
        [str(BENCH / "moe_model.py"), str(source), "--tokenizer-from", tiny_model]
        + ["--experts", "4", "--top-k", "2", "--layers", "2", "--hidden", "256"]
        + ["--moe-intermediate", "128"]
    )
    assert "wrote" in _run([str(BENCH / "fp8_block_checkpoint.py"), str(source), str(fp8)])
    checkpoint = open_checkpoint(str(fp8))
    assert checkpoint.fp8_scheme.block == (128, 128)
    model = load_model(checkpoint, dtype=torch.float32, device=torch.device("cpu"))
    plain = load_model(
        open_checkpoint(str(source)), dtype=torch.float32, device=torch.device("cpu")
    )
    w2, plain_w2 = model.layers[1].mlp.w2, plain.layers[1].mlp.w2
    assert 0 < ((w2 - plain_w2).norm() / plain_w2.norm()).item() < 2**-4
    hf = AutoModelForCausalLM.from_pretrained(
        fp8, quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32
    )
    ids = [5, 17, 3, 9, 30, 12]
    with torch.no_grad():
        expected = hf.eval()(torch.tensor([ids])).logits[0]
    runner = PagedRunner(model)
    torch.testing.assert_close(runner.step([(0, ids)]), expected, rtol=0, atol=1e-4)
