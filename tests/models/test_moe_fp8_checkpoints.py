"""Block-wise FP8 mixture-of-experts checkpoints (Qwen3-30B-A3B-FP8's format: every expert's
gate/up/down and the attention in e4m3 with a scale a block, the router left in 16 bits)
on a tiny Qwen3-MoE that transformers saved, quantized by tests/models/tiny_fp8_block.py:

- on the CPU the experts are dequantized at load: the stacked w13 / w2 are the checkpoint's
  values times their blocks' scales, exactly, and the logits those of transformers reading
  the same folder itself (its FineGrainedFP8 loader, dequantizing);
- kept as stored (what a GPU does), each MoE block holds its experts in e4m3 with their
  block scales (w13's spread to a scale a row where gate's rows do not end on a block
  boundary) and its 16-bit experts are released; the model then computes W8A8, within the
  activations' rounding of the dequantized model;
- the Triton kernels (interpreted) compute a kept block as the reference does;
- the engine builds such a folder on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, FineGrainedFP8Config, Qwen3MoeForCausalLM

from aioserve.kernels.dispatch import set_kernel_backend
from aioserve.kernels.fp8_block_linear_reference import dequantize_blocks
from aioserve.kernels.moe_reference import select_experts
from aioserve.models.fp8_weights import keep_fp8_weights
from aioserve.models.moe_fp8_weights import keep_fp8_experts
from tests.models.test_fp8_checkpoints import _engine, _load, _relative
from tests.models.test_int4_group_checkpoints import PROMPT, _prompt_logits
from tests.models.tiny_fp8_block import write_fp8_block_folder
from tests.models.tiny_models import tiny_moe_configs

# 128 x 128 as the checkpoints have it (gate's 64 rows end inside a block: w13's scales
# spread a row each); 32 x 32, where gate ends on a block boundary (kept as blocks).
BLOCKS = {"128x128": (128, 128), "32x32": (32, 32)}
# A MoE block's W8A8 output against its dequantized one, the same tokens routed alike:
# each activation rounded to e4m3 per row and group before both products. (The whole
# model's logits moved by 0.05 to 0.19 of their norm, as rounding upstream tips some
# tokens' choice of experts: no measure of the experts' arithmetic.) Measured 0.048
# (128 x 128 blocks), 0.040 (32 x 32) and 0.042 (64 x 64) of the output's norm.
_W8A8_TOLERANCE = 0.08
EXPERTS = 8


def _float_state(tmp_path) -> tuple[object, dict[str, torch.Tensor]]:
    """A random tiny Qwen3-MoE as transformers saves it (a tensor an expert), its routers
    scaled up so that no token's experts hang on a near tie that rounding could tip."""
    config = tiny_moe_configs()["qwen3-moe"]
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0, 1.0)
    model.save_pretrained(tmp_path)
    return config, load_file(str(tmp_path / "model.safetensors"))


@pytest.fixture(scope="module", params=list(BLOCKS))
def folder(request, tmp_path_factory):
    """(folder, block, the float32 state dict it stands for)."""
    config, state = _float_state(tmp_path_factory.mktemp("float"))
    path = tmp_path_factory.mktemp(request.param)
    block = BLOCKS[request.param]
    return path, block, write_fp8_block_folder(path, config, state, "fp8", block)


def _expert(expected, layer: int, expert: int, part: str) -> torch.Tensor:
    return expected[f"model.layers.{layer}.mlp.experts.{expert}.{part}_proj.weight"]


def test_the_experts_are_the_dequantized_checkpoints(folder):
    path, _, expected = folder
    assert any(".experts.7.down_proj." in name for name in expected)  # saved an expert a tensor
    _, model = _load(path)
    for layer in (0, 1):
        block = model.layers[layer].mlp
        for expert in range(EXPERTS):
            gate, up, down = (_expert(expected, layer, expert, p) for p in ("gate", "up", "down"))
            assert torch.equal(block.w13[expert], torch.cat([gate, up]))
            assert torch.equal(block.w2[expert], down)


def test_the_logits_are_transformers_reading_the_folder(folder):
    path, _, _ = folder
    _, model = _load(path)
    hf = AutoModelForCausalLM.from_pretrained(
        path,
        quantization_config=FineGrainedFP8Config(dequantize=True),
        dtype=torch.float32,
        attn_implementation="eager",
    )
    with torch.no_grad():
        reference = hf.eval()(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(_prompt_logits(model), reference, rtol=0, atol=1e-4)


_TOKENS = torch.randn(7, 128, generator=torch.Generator().manual_seed(1))


def _kept(path):
    """The model with its FP8 layers and experts kept, and layer 1's MoE output of _TOKENS
    before they were (dequantized)."""
    checkpoint, model = _load(path)
    dequantized = model.layers[1].mlp(_TOKENS)
    kept = keep_fp8_weights(model, checkpoint.fp8_layers(), torch.float8_e4m3fn)
    kept_experts = keep_fp8_experts(model, checkpoint.fp8_layers(), torch.float8_e4m3fn)
    return model, dequantized, kept, kept_experts


def test_kept_as_stored_the_experts_compute_block_w8a8(folder):
    path, block, expected = folder
    model, dequantized, kept, kept_experts = _kept(path)
    assert kept > 0 and model.layers[0].self_attn.qkv_proj.fp8_weight is not None
    held = 0
    for layer in (0, 1):
        moe = model.layers[layer].mlp
        assert moe.w13.stride() == (0, 0, 0) and moe.w2.stride() == (0, 0, 0)  # released
        w13_rows, w2_rows, columns = moe.fp8_block
        assert (w13_rows, w2_rows, columns) == ((block[0] if 64 % block[0] == 0 else 1), *block)
        for expert in range(EXPERTS):
            gate, up, down = (_expert(expected, layer, expert, p) for p in ("gate", "up", "down"))
            w13 = dequantize_blocks(
                moe.fp8_w13[expert], moe.fp8_w13_scale[expert], (w13_rows, columns)
            )
            assert torch.equal(w13, torch.cat([gate, up]))
            w2 = dequantize_blocks(moe.fp8_w2[expert], moe.fp8_w2_scale[expert], block)
            assert torch.equal(w2, down)
        held += sum(
            t.nbytes for t in (moe.fp8_w13, moe.fp8_w2, moe.fp8_w13_scale, moe.fp8_w2_scale)
        )
    assert kept_experts == held
    error = _relative(model.layers[1].mlp(_TOKENS), dequantized)
    assert 0 < error < _W8A8_TOLERANCE, error
    assert _prompt_logits(model).isfinite().all()


def test_the_triton_kernels_compute_a_kept_block(tmp_path, triton_backend):
    config, state = _float_state(tmp_path / "float")
    write_fp8_block_folder(tmp_path / "fp8", config, state, "fp8", (128, 128))
    model, *_ = _kept(tmp_path / "fp8")
    moe = model.layers[1].mlp
    out = moe(_TOKENS)
    set_kernel_backend("reference")
    expected = moe(_TOKENS)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    _, ids = select_experts(moe.gate(_TOKENS), moe.top_k, moe.renormalize)
    assert ids.unique().numel() > 2  # more than one expert's run


def test_build_engine_serves_an_fp8_moe_folder_on_the_cpu(folder):
    path, _, expected = folder
    parts = _engine(path, quantization="fp8")
    moe = parts.runner.model.get_submodule("layers.1.mlp")
    assert moe.fp8_w13 is None  # dequantized at load on the CPU
    assert torch.equal(moe.w2[3], _expert(expected, 1, 3, "down"))
    assert "FP8 W8A8" in parts.settings.load_report.describe()
