"""Block-wise FP8 checkpoints (DeepSeek-V3's and Qwen3's `-FP8` folders: vLLM's `fp8` with
`weight_block_size`; compressed-tensors' `block` strategy) through the normal loading path,
on tiny Llamas written by tests/models/tiny_fp8_block.py a block at a time:

- the loaded weights are the checkpoint's values times their blocks' scales, exactly, and
  the logits those of transformers reading the same folder itself (its FineGrainedFP8
  loader, dequantizing) for the `fp8` format, or of its Llama on the float weights;
- kept as stored (what a GPU does), every decoder Linear holds the 8-bit weights and block
  scales, the q/k/v and gate/up shards stacked (their scale rows spread to one a weight row
  where a shard does not start on a block boundary), and computes W8A8 with activations
  quantized per row and block column group, within that rounding of the dequantized model;
- the Triton kernels (interpreted) compute a kept stacked layer as the reference does;
- what is not supported is refused by name.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, FineGrainedFP8Config, LlamaForCausalLM

from aioserve.kernels.fp8_block_linear_reference import (
    dequantize_blocks,
    fp8_block_linear_reference,
)
from aioserve.models.checkpoint import open_checkpoint
from aioserve.models.fp8_weights import keep_fp8_weights
from aioserve.models.linear import Linear
from tests.models.test_fp8_checkpoints import _engine, _load, _relative
from tests.models.test_int4_group_checkpoints import KEPT, PROMPT, _prompt_logits
from tests.models.tiny_fp8_block import write_tiny_fp8_block
from tests.models.tiny_quantized import tiny_config

# (format, block): 128 x 128 as the checkpoints have it (k and v, 64 rows each, do not
# start q/k/v's blocks on a boundary: their scales are spread a row each when stacked);
# 32 x 32, where every shard starts on a block's first row (the block scales stacked as
# they are); 48 x 64, whose last row blocks are short (which transformers' loader refuses).
FOLDERS = {
    "fp8-128x128": ("fp8", (128, 128)),
    "compressed-tensors-32x32": ("compressed-tensors", (32, 32)),
    "fp8-48x64": ("fp8", (48, 64)),
}
TRANSFORMERS_READS = {"fp8-128x128"}

# W8A8 against the dequantized weights with float activations: each activation rounded to
# e4m3 per row and group before every product. Measured 0.039 of the logits' norm with
# 128 x 128 blocks, 0.057 with 48 x 64 and 0.086 with 32 x 32: a layer's own error falls
# with the group (0.028, 0.025 at 128 and 32 columns), but these tiny models' logits
# amplify it more when the blocks' factors (tiny_fp8_block.py) vary more finely.
_W8A8_TOLERANCE = 0.12


@pytest.fixture(scope="module", params=list(FOLDERS))
def folder(request, tmp_path_factory):
    """(folder, its name, block, the float32 state dict it stands for)."""
    path = tmp_path_factory.mktemp(request.param)
    fmt, block = FOLDERS[request.param]
    return path, request.param, block, write_tiny_fp8_block(path, fmt, block)


def test_the_weights_are_the_dequantized_checkpoints(folder):
    path, _, block, expected = folder
    checkpoint, model = _load(path)
    assert checkpoint.fp8_scheme.block == block
    assert checkpoint.num_weight_tensors() == len(expected)
    loaded = dict(checkpoint.weights())
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name].float(), tensor), name
    gate, up = (expected[f"model.layers.1.mlp.{p}_proj.weight"] for p in ("gate", "up"))
    assert torch.equal(model.layers[1].mlp.gate_up_proj.weight, torch.cat([gate, up]))


def _transformers_logits(path, name, expected):
    """transformers' logits of PROMPT: reading the folder itself where it can (the `fp8`
    format in whole blocks, dequantized by its FineGrainedFP8 loader), else its Llama on
    `expected`."""
    if name in TRANSFORMERS_READS:
        hf = AutoModelForCausalLM.from_pretrained(
            path,
            quantization_config=FineGrainedFP8Config(dequantize=True),
            dtype=torch.float32,
            attn_implementation="eager",
        )
    else:
        config = tiny_config()
        config._attn_implementation = "eager"
        hf = LlamaForCausalLM(config)
        hf.load_state_dict(expected)
    with torch.no_grad():
        return hf.eval()(torch.tensor([PROMPT])).logits[0]


def test_the_logits_are_transformers(folder):
    path, name, _, expected = folder
    _, model = _load(path)
    reference = _transformers_logits(path, name, expected)
    torch.testing.assert_close(_prompt_logits(model), reference, rtol=0, atol=1e-4)


def test_kept_as_stored_the_model_computes_block_w8a8(folder):
    path, _, block, expected = folder
    checkpoint, model = _load(path)
    dequantized = _prompt_logits(model)
    kept = keep_fp8_weights(model, checkpoint.fp8_layers(), torch.float8_e4m3fn)
    holding = {
        n for n, m in model.named_modules() if isinstance(m, Linear) and m.fp8_weight is not None
    }
    assert holding == KEPT
    assert kept == sum(
        m.fp8_weight.nbytes + m.fp8_scale.nbytes for m in map(model.get_submodule, KEPT)
    )
    for name in KEPT:
        module = model.get_submodule(name)
        assert module.weight.stride() == (0, 0)  # the float weight released: a shape only
        assert module.fp8_block[1] == block[1]
    qkv = model.get_submodule("layers.1.self_attn.qkv_proj")
    aligned = all(rows % block[0] == 0 for rows in (128, 64))  # q's rows, then k's
    assert qkv.fp8_block == (block if aligned else (1, block[1]))
    q, k, v = (expected[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    stacked = dequantize_blocks(qkv.fp8_weight, qkv.fp8_scale, qkv.fp8_block)
    assert torch.equal(stacked, torch.cat([q, k, v]))
    w8a8 = _prompt_logits(model)
    error = _relative(w8a8, dequantized)
    assert 0 < error < _W8A8_TOLERANCE, error


@pytest.mark.parametrize("layer_name", ["self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj"])
def test_the_triton_kernels_compute_a_kept_layer(tmp_path, triton_backend, layer_name):
    write_tiny_fp8_block(tmp_path, "fp8", (48, 64))
    checkpoint, model = _load(tmp_path)
    keep_fp8_weights(model, checkpoint.fp8_layers(), torch.float8_e4m3fn)
    layer = model.get_submodule(f"layers.0.{layer_name}")
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(1))
    expected = fp8_block_linear_reference(x, layer.fp8_weight, layer.fp8_scale, layer.fp8_block)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)


def test_build_engine_loads_a_block_folder_dequantized_on_the_cpu(tmp_path):
    expected = write_tiny_fp8_block(tmp_path, "fp8", (128, 128))
    parts = _engine(tmp_path, quantization="fp8")
    down = expected["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(parts.runner.model.get_submodule("layers.0.mlp.down_proj").weight, down)
    line = parts.settings.load_report.describe()
    assert "a scale a 128x128 block of weights" in line and "dequantized to float32" in line


def _with_config(tmp_path, update: dict, fmt: str = "fp8", block=(128, 128)):
    write_tiny_fp8_block(tmp_path, fmt, block)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"].update(update)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return str(tmp_path)


def _group(weights: dict, inputs: dict) -> dict:
    return {"config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "float", **weights},
        "input_activations": {"dynamic": True, "type": "float", **inputs},
    }}}  # fmt: skip


_BLOCK = {"strategy": "block", "block_structure": [128, 128]}


@pytest.mark.parametrize(
    ("update", "fmt", "message"),
    [
        ({"weight_block_size": [128, 96]}, "fp8", r"weight_block_size \[128, 96\]: .*power of two"),
        ({"weight_block_size": [128]}, "fp8", "weight_block_size must be two positive integers"),
        ({"fmt": "e5m2"}, "fp8", "fmt 'e5m2' is not supported"),
        (_group({"strategy": "block", "block_structure": [128, 8]}, {"strategy": "group",
                                                                      "group_size": 8}),
         "compressed-tensors", r"block_structure \[128, 8\]: .*at least 16"),
        (_group(_BLOCK, {"strategy": "group", "group_size": 64}), "compressed-tensors",
         "strategy 'group' with group_size 128 .* got 'group' with group_size 64"),
        (_group(_BLOCK, {"strategy": "token"}), "compressed-tensors",
         "group_size 128 .* got 'token'"),
    ],
)  # fmt: skip
def test_unsupported_block_configs_are_refused(tmp_path, update, fmt, message):
    with pytest.raises(ValueError, match=message):
        open_checkpoint(_with_config(tmp_path, update, fmt))


def test_block_and_channel_groups_together_are_refused(tmp_path):
    block = _group(_BLOCK, {"strategy": "group", "group_size": 128})["config_groups"]["g"]
    channel = _group({"strategy": "channel"}, {"strategy": "token"})["config_groups"]["g"]
    update = {"config_groups": {"a": block, "b": channel}}
    with pytest.raises(ValueError, match="block-wise and other weight scales together"):
        open_checkpoint(_with_config(tmp_path, update, "compressed-tensors"))


def test_scales_of_another_block_shape_are_refused_at_load(tmp_path):
    """A config that says 64 x 64 over a folder quantized in 128 x 128 blocks."""
    folder = _with_config(tmp_path, {"weight_block_size": [64, 64]})
    checkpoint = open_checkpoint(folder)
    with pytest.raises(ValueError, match=r"proj's block scales are \[1, 2\] .* expected \[2, 4\]"):
        dict(checkpoint.weights())
