"""FP8 W8A8 checkpoints (vLLM's `fp8`, compressed-tensors' float-quantized) and
`--quantization fp8`, through the normal loading path, on tiny Llamas written by
tests/models/tiny_fp8.py with torch's own e4m3 cast:

- the loaded weights are the checkpoint's values times its scales, exactly, and the logits
  those of transformers' Llama on the same float weights;
- kept as stored (what a GPU does), every decoder Linear holds the 8-bit weights and its
  float weight is released; the model then computes W8A8 (activations rounded to e4m3 per
  row), whose logits stay within the activations' rounding of the dequantized model's;
- the Triton kernels (interpreted) compute a kept stacked layer as the reference does;
- `--quantization fp8` quantizes a 16-bit model's decoder layers (on a GPU: the CPU refuses
  it), and what is not supported is refused by name.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaForCausalLM

from aioserve.config.engine import engine_config_from_kwargs
from aioserve.engine.build import build_engine
from aioserve.kernels.fp8_linear_reference import dequantize, fp8_linear_reference
from aioserve.models.checkpoint import open_checkpoint
from aioserve.models.fp8_weights import keep_fp8_weights, quantize_to_fp8
from aioserve.models.linear import Linear
from aioserve.models.loader import load_model
from tests.models.test_int4_group_checkpoints import KEPT, PROMPT, _prompt_logits
from tests.models.tiny_fp8 import write_tiny_fp8
from tests.models.tiny_quantized import tiny_config

FORMATS = {
    "fp8-per-tensor": ("fp8", False),
    "compressed-tensors-channel": ("compressed-tensors", True),
    "compressed-tensors-tensor": ("compressed-tensors", False),
}
# W8A8 against the dequantized weights with float activations: each activation is rounded
# to e4m3 (3 mantissa bits: a relative error of up to 2⁻⁴, ~2⁻⁶ on average) before every
# product of both layers; measured 0.035 of the logits' norm on these tiny models. With the
# weights rounded too (`--quantization fp8`), 0.051.
_W8A8_TOLERANCE = 0.06
_QUANTIZED_AT_LOAD_TOLERANCE = 0.08


@pytest.fixture(scope="module", params=list(FORMATS))
def folder(request, tmp_path_factory):
    """(folder, the float32 state dict it stands for)."""
    path = tmp_path_factory.mktemp(request.param)
    fmt, per_channel = FORMATS[request.param]
    return path, write_tiny_fp8(path, fmt, per_channel)


def _load(path, quantization=None):
    checkpoint = open_checkpoint(str(path), quantization=quantization)
    model = load_model(checkpoint, dtype=torch.float32, device=torch.device("cpu"), use_tqdm=False)
    return checkpoint, model


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_the_weights_are_the_dequantized_checkpoints(folder):
    path, expected = folder
    checkpoint, model = _load(path)
    assert checkpoint.fp8_scheme is not None and checkpoint.int4_scheme is None
    assert checkpoint.num_weight_tensors() == len(expected)
    loaded = dict(checkpoint.weights())
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name].float(), tensor), name
    q, k, v = (expected[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(model.layers[1].self_attn.qkv_proj.weight, torch.cat([q, k, v]))


def test_the_logits_are_the_float_models(folder):
    path, expected = folder
    _, model = _load(path)
    config = tiny_config()
    config._attn_implementation = "eager"
    hf = LlamaForCausalLM(config).eval()
    hf.load_state_dict(expected)
    with torch.no_grad():
        reference = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(_prompt_logits(model), reference, rtol=0, atol=1e-4)


def test_kept_as_stored_the_model_computes_w8a8(folder):
    path, expected = folder
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
        assert module.fp8_weight.dtype == torch.float8_e4m3fn
    # Stacked shards keep each one's values and scale: q/k/v as the checkpoint holds them.
    qkv = model.get_submodule("layers.1.self_attn.qkv_proj")
    q, k, v = (expected[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(dequantize(qkv.fp8_weight, qkv.fp8_scale), torch.cat([q, k, v]))
    w8a8 = _prompt_logits(model)
    error = _relative(w8a8, dequantized)
    assert 0 < error < _W8A8_TOLERANCE, error


def test_the_triton_kernels_compute_a_kept_layer(tmp_path, triton_backend):
    write_tiny_fp8(tmp_path, "fp8")
    checkpoint, model = _load(tmp_path)
    keep_fp8_weights(model, checkpoint.fp8_layers(), torch.float8_e4m3fn)
    layer = model.get_submodule("layers.0.self_attn.qkv_proj")
    assert layer.fp8_scale.shape == (layer.out_features,)  # q, k and v's scales, row by row
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(1))
    expected = fp8_linear_reference(x, layer.fp8_weight, layer.fp8_scale)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)


def _float_folder(tmp_path):
    """A 16-bit folder: the tiny FP8 checkpoint's weights in float16, no quantization_config."""
    state = write_tiny_fp8(tmp_path / "fp8", "fp8")
    folder = tmp_path / "float16"
    folder.mkdir()
    save_file(
        {name: t.half().contiguous() for name, t in state.items()},
        str(folder / "model.safetensors"),
    )
    raw = json.loads((tmp_path / "fp8" / "config.json").read_text())
    raw.pop("quantization_config")
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def test_quantize_to_fp8_turns_the_decoder_layers_to_fp8(tmp_path):
    folder = _float_folder(tmp_path)
    _, float_model = _load(folder)
    checkpoint, model = _load(folder, quantization="fp8")
    assert checkpoint.quantize_to_fp8 and checkpoint.fp8_scheme is None
    before = {name: model.get_submodule(name).weight.clone() for name in KEPT}
    reference = _prompt_logits(float_model)
    quantize_to_fp8(model, torch.float8_e4m3fn)
    for name, weight in before.items():
        module = model.get_submodule(name)
        assert module.fp8_scale.shape == (module.out_features,)
        assert _relative(dequantize(module.fp8_weight, module.fp8_scale), weight) < 2**-4
    assert model.lm_head.fp8_weight is None
    assert _relative(_prompt_logits(model), reference) < _QUANTIZED_AT_LOAD_TOLERANCE


def _engine(path, **kwargs):
    return build_engine(
        engine_config_from_kwargs(
            model=str(path),
            dtype="float32",
            max_model_len=64,
            enforce_eager=True,
            skip_tokenizer_init=True,
            num_gpu_blocks_override=16,
            **kwargs,
        )
    )


def test_build_engine_loads_an_fp8_folder_dequantized_on_the_cpu(tmp_path):
    expected = write_tiny_fp8(tmp_path, "compressed-tensors", per_channel=True)
    parts = _engine(tmp_path, quantization="compressed-tensors")
    down = expected["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(parts.runner.model.get_submodule("layers.0.mlp.down_proj").weight, down)
    line = parts.settings.load_report.describe()
    assert "FP8 W8A8 (e4m3, compressed-tensors" in line and "dequantized to float32" in line


def test_quantize_to_fp8_is_refused_on_the_cpu(tmp_path):
    with pytest.raises(ValueError, match="--quantization fp8 .* the CPU has none"):
        _engine(_float_folder(tmp_path), quantization="fp8")


def _with_config(tmp_path, update: dict, fmt: str = "fp8"):
    write_tiny_fp8(tmp_path, fmt)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"].update(update)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return str(tmp_path)


@pytest.mark.parametrize(
    ("update", "fmt", "message"),
    [
        ({"activation_scheme": "static"}, "fp8", "activation_scheme 'static' is not supported"),
        ({"format": "pack-quantized"}, "compressed-tensors", "format 'pack-quantized'"),
        ({"config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "group"},
                                  "input_activations": {"dynamic": True, "type": "float"}}}},
         "compressed-tensors", "weight strategy 'group'"),
        ({"config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                                  "input_activations": None}}},
         "compressed-tensors", "only dynamic 8-bit float input activations"),
    ],
)  # fmt: skip
def test_unsupported_fp8_configs_are_refused(tmp_path, update, fmt, message):
    with pytest.raises(ValueError, match=message):
        open_checkpoint(_with_config(tmp_path, update, fmt))


def test_a_mismatched_quantization_is_refused(tmp_path):
    folder = _with_config(tmp_path, {})
    with pytest.raises(ValueError, match=r"--quantization gptq does not match .*says fp8"):
        open_checkpoint(folder, quantization="gptq")
    with pytest.raises(ValueError, match=r"compressed-tensors does not match .*says fp8"):
        open_checkpoint(folder, quantization="compressed-tensors")
    assert open_checkpoint(folder, quantization="fp8").fp8_scheme.method == "fp8"
