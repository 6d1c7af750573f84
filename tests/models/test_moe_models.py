"""Loading mixture-of-experts checkpoints: one tensor per expert into the stacked w13 / w2,
the checks on what a checkpoint holds, and what is refused by name (quantized experts,
LoRA on experts). Their numerics against transformers are in test_model_parity.py (the
MoE configs of tiny_models.py) and tests/engine/test_moe_engine.py."""

from __future__ import annotations

import gc
import json
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from aioserve.engine import build
from aioserve.engine.build import check_moe_weights
from aioserve.kernels.moe_reference import select_experts
from aioserve.models import moe as moe_module
from aioserve.models.checkpoint import open_checkpoint
from aioserve.models.fp8_weights import Fp8Scheme
from aioserve.models.linear import onednn_packs
from aioserve.models.loader import load_model
from aioserve.models.lora_adapter import LoRAAdapterError, lora_targets, read_lora_adapter
from aioserve.models.moe import SparseMoeBlock, is_sparse_layer, pack_expert_weights
from tests.models.tiny_models import tiny_moe_configs


@pytest.fixture(scope="module")
def hf_moe(tiny_moe_model):
    return AutoModelForCausalLM.from_pretrained(tiny_moe_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def moe(tiny_moe_model):
    return load_model(
        open_checkpoint(tiny_moe_model), dtype=torch.float32, device=torch.device("cpu")
    )


def test_per_expert_tensors_are_stacked_gate_then_up(moe, hf_moe):
    """transformers 5 holds the experts stacked as we do; the checkpoint keeps one tensor an
    expert (w1/w3/w2 or gate/up/down_proj), which the loader must put back in place."""
    for i, layer in enumerate(moe.layers):
        hf_experts = hf_moe.model.layers[i].mlp.experts
        assert torch.equal(layer.mlp.w13, hf_experts.gate_up_proj)
        assert torch.equal(layer.mlp.w2, hf_experts.down_proj)
        assert torch.equal(layer.mlp.gate.weight, hf_moe.model.layers[i].mlp.gate.weight)


def _saved_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(next(folder.glob("*.safetensors"))))


def _copy_of(tensors: dict[str, torch.Tensor], name: str, as_name: str) -> None:
    tensors[as_name] = tensors[name].clone()


_DOWN = "model.layers.0.mlp.experts.0.down_proj.weight"
# What is done to the saved tensors, and the error that must name it.
_BROKEN_CHECKPOINTS = {
    "an expert missing": (
        lambda t: t.pop("model.layers.1.mlp.experts.5.up_proj.weight"),
        r"lacks layers\.1\.mlp\.experts\.5\.up_proj",
    ),
    "an expert past the count": (
        lambda t: _copy_of(t, _DOWN, "model.layers.0.mlp.experts.8.down_proj.weight"),
        r"experts\.8\.down_proj\.weight.*has 8 experts",
    ),
    "a layer past the count": (
        lambda t: _copy_of(t, _DOWN, "model.layers.2.mlp.experts.0.down_proj.weight"),
        r"layers\.2\.mlp\.experts\.0\.down_proj\.weight.*has 2 layers",
    ),
}


@pytest.mark.parametrize("case", list(_BROKEN_CHECKPOINTS))
def test_a_checkpoint_with_wrong_experts_is_refused_by_name(case, tiny_moe_model, tmp_path):
    folder = Path(tiny_moe_model)
    tensors = _saved_tensors(folder)
    damage, message = _BROKEN_CHECKPOINTS[case]
    damage(tensors)
    _copy_folder_with(folder, tmp_path, tensors)
    with pytest.raises(ValueError, match=message):
        load_model(open_checkpoint(str(tmp_path)), dtype=torch.float32, device=torch.device("cpu"))


_SAVED_EXPERT_NAME = {
    "mixtral": "model.layers.0.block_sparse_moe.experts.3.w3.weight",
    "qwen2-moe": "model.layers.0.mlp.experts.3.up_proj.weight",
    "granite-moe": "model.layers.0.block_sparse_moe.input_linear.weight",
    "olmoe": "model.layers.0.mlp.experts.7.gate_proj.weight",
}


@pytest.mark.parametrize("name", sorted(_SAVED_EXPERT_NAME))
def test_saved_checkpoints_of_the_other_families_load_in_place(name, tmp_path):
    """transformers saves Mixtral's experts as block_sparse_moe.experts.N.w1 / w3 / w2 (gate,
    up, down), Qwen2-MoE's with a shared expert and its gate, OLMoE's as Qwen's, and
    GraniteMoe's stacked as block_sparse_moe.input_linear / output_linear beside
    router.layer; loaded, every stacked weight equals the one transformers holds."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_moe_configs()[name]).eval()
    hf.save_pretrained(tmp_path)
    assert _SAVED_EXPERT_NAME[name] in set(_saved_tensors(tmp_path))
    ours = load_model(
        open_checkpoint(str(tmp_path)), dtype=torch.float32, device=torch.device("cpu")
    )
    layer = ours.layers[0].mlp
    hf_layer = getattr(hf.model.layers[0], "block_sparse_moe", None) or hf.model.layers[0].mlp
    assert torch.equal(layer.w13, hf_layer.experts.gate_up_proj)
    assert torch.equal(layer.w2, hf_layer.experts.down_proj)
    router = hf_layer.router if name == "granite-moe" else hf_layer.gate
    assert torch.equal(layer.gate.weight, router.weight)
    if name == "qwen2-moe":
        assert torch.equal(layer.shared_expert_gate.weight, hf_layer.shared_expert_gate.weight)
        shared = hf_layer.shared_expert
        stacked = torch.cat([shared.gate_proj.weight, shared.up_proj.weight])
        assert torch.equal(layer.shared_expert.gate_up_proj.weight, stacked)


def test_a_mixture_of_experts_gguf_is_refused_by_name(tmp_path):
    path = tmp_path / "moe.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_uint32("qwen3moe.expert_count", 8)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="mixture-of-experts model .qwen3moe, 8 experts.*GGUF"):
        open_checkpoint(str(path))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 2])
def test_the_custom_op_passes_torch_opcheck(dtype, top_k):
    """The op's schema and fake agree with what it computes (shapes, strides, no aliasing),
    as torch.compile needs."""
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(4, 32, 16, generator=gen).to(dtype)
    w2 = torch.randn(4, 16, 16, generator=gen).to(dtype)
    x = torch.randn(5, 16, generator=gen).to(dtype)
    weights, ids = select_experts(torch.randn(5, 4, generator=gen), top_k, True)
    args = (x, w13, w2, weights, ids, -1)
    torch.library.opcheck(torch.ops.aioserve.fused_moe.default, args)
    assert torch.ops.aioserve.fused_moe(*args).is_contiguous()


def test_the_custom_op_passes_torch_opcheck_with_fp8_experts():
    """The op of block-wise FP8 experts, their scales and blocks its last arguments."""
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(4, 32, 16, generator=gen).to(torch.float8_e4m3fn)
    w2 = torch.randn(4, 16, 16, generator=gen).to(torch.float8_e4m3fn)
    w13_scale, w2_scale = torch.rand(4, 32, 1, generator=gen), torch.rand(4, 1, 1, generator=gen)
    x = torch.randn(5, 16, generator=gen).bfloat16()
    weights, ids = select_experts(torch.randn(5, 4, generator=gen), 2, True)
    args = (x, w13, w2, weights, ids, w13_scale, w2_scale, [1, 16, 16])
    # Not "test_schema": its check for mutated inputs compares them with torch ops that
    # have no float8 kernel on the CPU.
    checks = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.aioserve.fused_moe_fp8.default, args, test_utils=checks)
    out = torch.ops.aioserve.fused_moe_fp8(*args)
    assert out.dtype == torch.bfloat16 and out.is_contiguous()


def _tiny_block(experts: int = 4) -> SparseMoeBlock:
    config = Qwen3MoeConfig(
        hidden_size=16, moe_intermediate_size=16, num_experts=experts, num_experts_per_tok=2
    )
    block = SparseMoeBlock(config).to(torch.bfloat16).requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    for param in block.parameters():
        param.copy_(torch.randn(param.shape, generator=gen))
    return block


@pytest.mark.skipif(not onednn_packs(torch.bfloat16), reason="no bfloat16 oneDNN on this CPU")
def test_the_custom_op_reads_a_blocks_packed_experts_by_its_key():
    """Packed, a block's experts are no arguments of the op (a compiled graph would take each
    as an input) but found by the block's key, and give the plain experts' values; the
    table's entry leaves with the block."""
    block = _tiny_block()
    plain_w13, plain_w2 = block.w13.detach().clone(), block.w2.detach().clone()
    pack_expert_weights(block)
    key = block.packed_key
    assert key >= 0 and block.w13.untyped_storage().nbytes() <= 2  # the plain copy released
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 16, generator=gen).bfloat16()
    weights, ids = select_experts(torch.randn(5, 4, generator=gen), 2, True)
    args = (x, block.w13, block.w2, weights, ids, key)
    torch.library.opcheck(torch.ops.aioserve.fused_moe.default, args)
    out = torch.ops.aioserve.fused_moe(*args)
    assert out.is_contiguous() and out.shape == x.shape
    plain = torch.ops.aioserve.fused_moe(x, plain_w13, plain_w2, weights, ids, -1)
    torch.testing.assert_close(out, plain, atol=2e-2, rtol=2e-2)
    assert not torch.equal(out, torch.zeros_like(out))
    del block, args
    gc.collect()
    assert key not in moe_module._PACKED_EXPERTS


@pytest.mark.skipif(not onednn_packs(torch.bfloat16), reason="no bfloat16 oneDNN on this CPU")
def test_a_compiled_graph_takes_as_many_inputs_whatever_the_expert_count():
    """Packed experts reach the op by key, not as graph inputs: with one input per packed
    expert, a model of Qwen3-30B-A3B's 48 layers of 128 experts had not compiled its
    one-row graph in 15 minutes."""

    def graph_inputs(experts: int) -> int:
        block = _tiny_block(experts)
        pack_expert_weights(block)
        counted = []

        def count_inputs(graph_module, example_inputs):
            counted.append(len(example_inputs))
            return graph_module.forward

        torch._dynamo.reset()
        torch.compile(block, backend=count_inputs)(torch.randn(3, 16).bfloat16())
        return counted[0]

    assert graph_inputs(4) == graph_inputs(64)


def _copy_folder_with(source, target, tensors: dict[str, torch.Tensor]) -> None:
    for path in source.iterdir():
        if path.suffix != ".safetensors" and path.is_file():
            (target / path.name).write_bytes(path.read_bytes())
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})


def test_sparse_layers_follow_the_config():
    configs = tiny_moe_configs()
    assert [is_sparse_layer(configs["qwen2-moe"], i) for i in range(2)] == [True, False]
    assert [is_sparse_layer(configs["mixtral"], i) for i in range(2)] == [True, True]
    every_other = configs["qwen3-moe"]
    every_other.decoder_sparse_step = 2
    assert [is_sparse_layer(every_other, i) for i in range(4)] == [False, True, False, True]


_UNQUANTIZED = dict(
    load_format="safetensors", int4_scheme=None, fp8_scheme=None, int8_scheme=None,
    quantize_to_fp8=False,
)  # fmt: skip


@pytest.mark.parametrize(
    "quantized, named",
    [
        (dict(load_format="gguf"), "a GGUF file"),
        (dict(int8_scheme=object()), "INT8 weights"),
        (dict(int4_scheme=SimpleNamespace(method="awq")), "AWQ weights"),
    ],
)
def test_quantized_experts_are_refused_by_name(quantized, named):
    moe_checkpoint = SimpleNamespace(hf_config=tiny_moe_configs()["mixtral"], **_UNQUANTIZED)
    check_moe_weights(moe_checkpoint)  # 16-bit: served
    moe_checkpoint.__dict__.update(quantized)
    with pytest.raises(
        ValueError, match=rf"mixture-of-experts models \(MixtralForCausalLM\) with {named}"
    ):
        check_moe_weights(moe_checkpoint)
    dense = SimpleNamespace(
        hf_config=SimpleNamespace(hidden_size=8), **{**_UNQUANTIZED, **quantized}
    )
    check_moe_weights(dense)  # a dense model's quantization is not this check's business


def test_fp8_experts_are_served_but_per_channel_ones_on_a_gpu(monkeypatch):
    """FP8 experts are dequantized at load on the CPU (and on a GPU without e4m3), kept
    as stored on a GPU with block-wise scales, and refused there without."""
    per_channel, block = Fp8Scheme("compressed-tensors"), Fp8Scheme("fp8", (128, 128))
    config = tiny_moe_configs()["qwen3-moe"]
    for scheme in (per_channel, block):
        check_moe_weights(
            SimpleNamespace(hf_config=config, **{**_UNQUANTIZED, "fp8_scheme": scheme})
        )
    monkeypatch.setattr(build, "is_gpu", lambda: True)
    monkeypatch.setattr(build, "e4m3_missing", lambda: None)
    check_moe_weights(SimpleNamespace(hf_config=config, **{**_UNQUANTIZED, "fp8_scheme": block}))
    checkpoint = SimpleNamespace(hf_config=config, **{**_UNQUANTIZED, "fp8_scheme": per_channel})
    with pytest.raises(ValueError, match="per-tensor or per-channel FP8 weights on a GPU"):
        check_moe_weights(checkpoint)
    monkeypatch.setattr(build, "e4m3_missing", lambda: "sm_80 has no e4m3")
    check_moe_weights(checkpoint)  # dequantized at load there


def test_quantize_to_fp8_is_refused_for_moe_models():
    checkpoint = SimpleNamespace(
        hf_config=tiny_moe_configs()["qwen3-moe"],
        load_format="safetensors",
        int4_scheme=None,
        fp8_scheme=None,
        int8_scheme=None,
        quantize_to_fp8=True,
    )
    with pytest.raises(
        ValueError, match=r"--quantization fp8 .*\(Qwen3MoeForCausalLM\).*leave it out"
    ):
        check_moe_weights(checkpoint)


def test_lora_reaches_attention_but_refuses_experts(moe, tmp_path):
    targets = lora_targets(moe)
    assert "layers.0.self_attn.qkv_proj" in targets
    assert not any("experts" in name or name.endswith("mlp.gate") for name in targets)
    assert all(isinstance(layer.mlp, SparseMoeBlock) for layer in moe.layers)
    config = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "gate_proj"]}
    rank_2 = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 64),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 2),
    }
    attention_only = tmp_path / "attention"
    attention_only.mkdir()
    (attention_only / "adapter_config.json").write_text(json.dumps(config))
    save_file(rank_2, str(attention_only / "adapter_model.safetensors"))
    read = read_lora_adapter(str(attention_only), moe, max_rank=8, dtype=torch.float32)
    assert list(read.layers) == ["layers.0.self_attn.qkv_proj"]

    experts = tmp_path / "experts"
    experts.mkdir()
    (experts / "adapter_config.json").write_text(json.dumps(config))
    expert = "base_model.model.model.layers.1.mlp.experts.3.gate_proj"
    tensors = {
        **rank_2,
        f"{expert}.lora_A.weight": torch.zeros(2, 64),
        f"{expert}.lora_B.weight": torch.zeros(32, 2),
    }
    save_file(tensors, str(experts / "adapter_model.safetensors"))
    with pytest.raises(LoRAAdapterError, match="LoRA on experts is not supported"):
        read_lora_adapter(str(experts), moe, max_rank=8, dtype=torch.float32)


@pytest.mark.parametrize(
    "field",
    [
        dict(layer_rope_theta=[10000.0, 0.0]),
        dict(attention_sinks=True),
    ],
)
def test_granite_attention_variants_are_refused_by_name(field):
    config = tiny_moe_configs()["granite-moe"]
    for key, value in field.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=f"asks for {next(iter(field))}.*not implement"):
        load_model(
            SimpleNamespace(hf_config=config),
            dtype=torch.float32,
            device=torch.device("cpu"),
            dummy=True,
        )
