"""AWQ and GPTQ folders (tests/models/tiny_quantized.py writes them with the formats'
published packing) loaded through the normal path, against the float model they stand for.

- Loaded as on the CPU (dequantized at load), every weight is exactly the writer's
  (q - z) * s: the dequantization is exact in float32 (a 5-bit integer times a float16
  scale), so any unpacking mistake shows as a wrong weight, not as a tolerance.
- The logits over a prompt equal transformers' on those float weights (eager attention)
  within 1e-4 absolute: both compute in float32, in different orders (logits ~1).
- Kept quantized (the GPU's layers, run here through the kernels' torch reference, and
  one layer through the Triton kernels interpreted), the logits equal the dequantized
  model's within 1e-4: the same float32 weights, another product.
- The CPU's int4 copy for small steps (torch's int4 op, groups of 32, scales and zeros in
  bfloat16): every layer without act-order gets one, whose product equals the dequantized
  weights' within bfloat16's rounding of the scales, zeros and output (relative 1e-2; a
  wrong zero point or group gives ~100%); act-order layers of several groups get none.
- build_engine takes a folder by `--model` (with --quantization awq_marlin: vLLM's name
  for the same weights), and its load report names the quantization; kept quantized, the
  report counts the kept tensors in place of the released weights.
- A --quantization that does not match the folder, and quantization configs that are not
  supported (bits 8 or 3, AWQ's GEMV packing, GPTQ's marlin format), are refused clearly.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaForCausalLM

from aioserve.config.engine import engine_config_from_kwargs
from aioserve.engine.build import build_engine
from aioserve.engine.load_report import build_load_report, format_bytes
from aioserve.kernels.gguf_linear_reference import int4_linear
from aioserve.kernels.int4_group_linear_reference import int4_group_linear_reference
from aioserve.models.checkpoint import open_checkpoint
from aioserve.models.int4_group_weights import keep_int4_cpu_weights, keep_int4_group_weights
from aioserve.models.linear import Linear
from aioserve.models.loader import load_model
from aioserve.runner.model_runner import ModelRunner
from tests.models.tiny_models import PagedRunner
from tests.models.tiny_quantized import TinyScheme, tiny_config, write_tiny_quantized

SCHEMES = {
    "awq-g32": TinyScheme("awq", 32),
    "awq-g128": TinyScheme("awq", 128),
    "gptq-g32-asym": TinyScheme("gptq", 32),
    "gptq-g64-sym-act-order": TinyScheme("gptq", 64, sym=True, desc_act=True),
    "gptq-g128-asym-act-order": TinyScheme("gptq", 128, desc_act=True),
    "gptq-one-group-v2": TinyScheme("gptq", -1, v2=True),
}
PROMPT = [5, 17, 3, 9, 30, 12, 8, 200, 41]
KEPT = {
    f"layers.{layer}.{part}"
    for layer in (0, 1)
    for part in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
}


@pytest.fixture(scope="module", params=list(SCHEMES))
def folder(request, tmp_path_factory):
    """(folder, the float32 state dict it stands for)."""
    path = tmp_path_factory.mktemp(request.param)
    return path, write_tiny_quantized(path, SCHEMES[request.param])


def _load(path):
    checkpoint = open_checkpoint(str(path))
    model = load_model(checkpoint, dtype=torch.float32, device=torch.device("cpu"), use_tqdm=False)
    return checkpoint, model


def _prompt_logits(model) -> torch.Tensor:
    runner = PagedRunner(model)
    logits = runner.step([(0, PROMPT[:-2])])
    return torch.cat([logits, runner.step([(0, PROMPT[-2:-1])]), runner.step([(0, PROMPT[-1:])])])


def test_the_weights_are_the_dequantized_checkpoints(folder):
    path, expected = folder
    checkpoint, model = _load(path)
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


def test_kept_quantized_the_model_gives_the_same_logits(folder):
    path, _ = folder
    checkpoint, model = _load(path)
    dequantized = _prompt_logits(model)
    kept = keep_int4_group_weights(model, checkpoint.int4_group_layers(), checkpoint.int4_scheme)
    holding = {
        n for n, m in model.named_modules() if isinstance(m, Linear) and m.quant_qweight is not None
    }
    assert holding == KEPT
    assert kept == sum(
        sum(t.nbytes for t in (m.quant_qweight, m.quant_scales, m.quant_zeros))
        + (m.quant_perm.nbytes if m.quant_perm is not None else 0)
        for m in map(model.get_submodule, KEPT)
    )
    for name in KEPT:  # the float weight released: a shape only
        assert model.get_submodule(name).weight.stride() == (0, 0)
    torch.testing.assert_close(_prompt_logits(model), dequantized, rtol=0, atol=1e-4)


def test_the_cpu_int4_copy_computes_the_dequantized_weights(folder):
    path, _ = folder
    checkpoint, model = _load(path)
    scheme = checkpoint.int4_scheme
    added = keep_int4_cpu_weights(model, checkpoint.int4_group_layers(), scheme, torch.bfloat16)
    with_int4 = {
        n for n, m in model.named_modules() if isinstance(m, Linear) and m.int4_weight is not None
    }
    # act-order leaves the inputs in order only where one group covers them all
    in_order = {n for n in KEPT if model.get_submodule(n).in_features <= scheme.group_size}
    assert with_int4 == (in_order if scheme.desc_act else KEPT)
    assert added == sum(
        m.int4_weight.nbytes + m.int4_scales_and_zeros.nbytes
        for m in map(model.get_submodule, with_int4)
    )
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
    for name in sorted(with_int4):
        module = model.get_submodule(name)
        inputs = x[:, : module.in_features]
        got = int4_linear(inputs, module.int4_weight, module.int4_scales_and_zeros).float()
        reference = inputs.float() @ module.weight.t()  # the loader's dequantized float32
        assert ((got - reference).norm() / reference.norm()).item() < 1e-2, name


def test_the_triton_kernels_compute_a_kept_layer(tmp_path, triton_backend):
    path = tmp_path / "gptq"
    write_tiny_quantized(path, SCHEMES["gptq-g64-sym-act-order"])
    checkpoint, model = _load(path)
    keep_int4_group_weights(model, checkpoint.int4_group_layers(), checkpoint.int4_scheme)
    layer = model.get_submodule("layers.0.mlp.gate_up_proj")
    assert layer.quant_perm is not None
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(1))
    expected = int4_group_linear_reference(
        x, layer.quant_qweight, layer.quant_scales, layer.quant_zeros, layer.quant_perm, 64
    )
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_build_engine_loads_a_quantized_folder(tmp_path):
    expected = write_tiny_quantized(tmp_path, SCHEMES["awq-g32"])
    parts = build_engine(
        engine_config_from_kwargs(
            model=str(tmp_path),
            quantization="awq_marlin",
            dtype="float32",
            max_model_len=64,
            enforce_eager=True,
            skip_tokenizer_init=True,
            num_gpu_blocks_override=16,
        )
    )
    model = parts.runner.model
    down = expected["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(model.get_submodule("layers.0.mlp.down_proj").weight, down)
    line = parts.settings.load_report.describe()
    assert "AWQ 4-bit, groups of 32 weights (" in line and "dequantized to float32" in line


def test_the_load_report_counts_the_kept_tensors_instead_of_the_weights(tmp_path):
    write_tiny_quantized(tmp_path, SCHEMES["gptq-g64-sym-act-order"])
    checkpoint, model = _load(tmp_path)
    params = sum(p.nbytes for p in model.parameters())
    released = sum(model.get_submodule(name).weight.nbytes for name in KEPT)
    kept = keep_int4_group_weights(model, checkpoint.int4_group_layers(), checkpoint.int4_scheme)
    runner = ModelRunner(
        model,
        num_blocks=8,
        block_size=4,
        max_num_seqs=2,
        max_model_len=32,
        dtype=torch.float32,
        device=torch.device("cpu"),
        compile_model=False,
    )
    report = build_load_report("tiny", checkpoint, runner, "--num-gpu-blocks-override 8")
    assert report.kept_blocks_bytes == kept
    assert report.weight_bytes == params - released
    assert report.describe().startswith(
        "tiny, GPTQ 4-bit, groups of 64, act-order weights (int32 + float16, "
    ), report.describe()
    assert (
        f"the quantized layers kept as stored ({format_bytes(kept)}), the rest held in "
        f"float32: {format_bytes(params - released)}; KV cache" in report.describe()
    ), report.describe()


def _with_quantization(tmp_path, quantization_config: dict | None):
    write_tiny_quantized(tmp_path, SCHEMES["gptq-g32-asym"])
    raw = json.loads((tmp_path / "config.json").read_text())
    if quantization_config is None:
        raw.pop("quantization_config")
    else:
        raw["quantization_config"].update(quantization_config)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return str(tmp_path)


def test_a_mismatched_quantization_is_refused(tmp_path):
    folder = _with_quantization(tmp_path, {})
    with pytest.raises(ValueError, match=r"--quantization awq does not match .*says gptq"):
        open_checkpoint(folder, quantization="awq")
    assert open_checkpoint(folder, quantization="gptq_marlin").int4_scheme.method == "gptq"
    plain = _with_quantization(tmp_path, None)
    with pytest.raises(ValueError, match="gptq does not match .*has no quantization_config"):
        open_checkpoint(plain, quantization="gptq")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"bits": 8}, "gptq with 8 bits is not supported: only 4 bits are"),
        ({"bits": 3}, "gptq with 3 bits is not supported"),
        ({"quant_method": "awq", "version": "gemv"}, "AWQ version 'gemv' is not supported"),
        ({"checkpoint_format": "marlin"}, "GPTQ checkpoint format 'marlin' is not supported"),
        ({"quant_method": "bitsandbytes"}, "quantization method 'bitsandbytes' is not supported"),
    ],
)
def test_unsupported_quantization_configs_are_refused(tmp_path, config, message):
    with pytest.raises(ValueError, match=message):
        open_checkpoint(_with_quantization(tmp_path, config))
