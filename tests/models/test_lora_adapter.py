"""Reading PEFT adapters for a model: where each tensor goes, its scaling, and vLLM's
refusals (its words, from vllm/lora/peft_helper.py and tests/server/vllm_samples/192-198)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from aioserve.models.checkpoint import open_checkpoint
from aioserve.models.loader import load_model
from aioserve.models.lora_adapter import (
    LoRAAdapterError,
    NoAdapterError,
    lora_targets,
    read_lora_adapter,
)
from tests.lora_adapters import make_lora_adapter, peft_reference


@pytest.fixture(scope="module")
def model(tiny_model):
    return load_model(open_checkpoint(tiny_model), dtype=torch.float32, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def adapter(tiny_model, tmp_path_factory):
    return make_lora_adapter(
        tiny_model, tmp_path_factory.mktemp("a") / "a", rank=4, alpha=8, use_rslora=True
    )


def test_targets_are_the_stacked_layers_with_their_slices(model):
    targets = lora_targets(model)
    assert set(targets) == {
        f"layers.{i}.{layer}"
        for i in range(2)
        for layer in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    }
    # 4 query heads and 2 key/value heads of 16; the MLP's 128 gate and 128 up columns.
    assert targets["layers.0.self_attn.qkv_proj"].slice_bounds == (0, 64, 96, 128)
    assert targets["layers.1.mlp.gate_up_proj"].slice_bounds == (0, 128, 256)
    assert targets["layers.1.mlp.down_proj"].slice_bounds == (0, 64)


def test_each_slice_gets_peft_delta(model, tiny_model, adapter):
    """B·scaling·A of each slice is the change PEFT makes to that HF layer's weight."""
    read = read_lora_adapter(adapter, model, max_rank=16, dtype=torch.float32)
    merged = peft_reference(tiny_model, adapter).merge_and_unload().state_dict()
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).state_dict()
    hf = {0: "q_proj", 1: "k_proj", 2: "v_proj"}
    for i in range(2):
        for shard, (a, b) in enumerate(read.layers[f"layers.{i}.self_attn.qkv_proj"]):
            name = f"model.layers.{i}.self_attn.{hf[shard]}.weight"
            torch.testing.assert_close(b @ a, merged[name] - base[name], atol=1e-6, rtol=1e-4)
        ((a, b),) = read.layers[f"layers.{i}.mlp.down_proj"]
        name = f"model.layers.{i}.mlp.down_proj.weight"
        torch.testing.assert_close(b @ a, merged[name] - base[name], atol=1e-6, rtol=1e-4)
    assert read.rank == 4


def _broken(adapter: str, tmp_path, **changes) -> str:
    folder = tmp_path / "broken"
    folder.mkdir()
    source = Path(adapter)
    config = json.loads((source / "adapter_config.json").read_text())
    config.update(changes)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    weights = (source / "adapter_model.safetensors").read_bytes()
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return str(folder)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"use_dora": True}, "vLLM does not yet support DoRA."),
        ({"bias": "all"}, "Adapter bias is not supported."),
        ({"lora_bias": True}, "vLLM does not support LoRA bias (lora_bias)."),
        ({"modules_to_save": ["lm_head"]}, "Unsupported modules_to_save: ['lm_head']"),
        ({"init_lora_weights": "pissa"}, "init_lora_weights='pissa'"),
        ({"r": 32}, "LoRA rank 32 is greater than max_lora_rank 16."),
        ({"rank_pattern": {"q_proj": 64}}, "LoRA rank 64 is greater than max_lora_rank 16."),
    ],
)
def test_vllms_refusals(model, adapter, tmp_path, changes, message):
    with pytest.raises(LoRAAdapterError) as error:
        read_lora_adapter(_broken(adapter, tmp_path, **changes), model, 16, torch.float32)
    assert message in str(error.value)


def test_a_missing_config_is_no_adapter(model, tmp_path):
    with pytest.raises(NoAdapterError, match="No adapter found for"):
        read_lora_adapter(str(tmp_path), model, 16, torch.float32)
    with pytest.raises(NoAdapterError, match="No adapter found for"):
        read_lora_adapter(str(tmp_path / "absent"), model, 16, torch.float32)


def test_missing_required_fields(model, tmp_path):
    (tmp_path / "adapter_config.json").write_text(
        json.dumps({"lora_alpha": 8, "target_modules": ["q_proj"]})
    )
    with pytest.raises(LoRAAdapterError, match=r"Missing required configuration fields: \{'r'\}"):
        read_lora_adapter(str(tmp_path), model, 16, torch.float32)


def test_embeddings_and_head_are_refused_by_name(model, tiny_model, tmp_path):
    embed = make_lora_adapter(tiny_model, tmp_path / "e", rank=4, targets=("embed_tokens",))
    with pytest.raises(LoRAAdapterError, match="embeddings or the output head is not supported"):
        read_lora_adapter(embed, model, 16, torch.float32)


def test_a_shape_that_does_not_fit_the_model_is_refused(model, tmp_path, adapter):
    from safetensors.torch import load_file, save_file

    tensors = load_file(f"{adapter}/adapter_model.safetensors")
    name = next(n for n in tensors if "q_proj.lora_B" in n)
    tensors[name] = torch.zeros(3, 4)
    folder = _broken(adapter, tmp_path)
    save_file(tensors, f"{folder}/adapter_model.safetensors")
    with pytest.raises(LoRAAdapterError, match="q_proj has lora_A"):
        read_lora_adapter(folder, model, 16, torch.float32)


def test_a_phi3_adapter_adapts_its_stacked_layers_whole(tiny_phi3_model, tmp_path):
    """Phi-3's checkpoints and adapters hold q/k/v and gate/up stacked already: each such
    layer takes one A and B over all its rows, PEFT's change to that layer."""
    targets = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    adapter = make_lora_adapter(tiny_phi3_model, tmp_path / "a", rank=4, alpha=8, targets=targets)
    phi3 = load_model(
        open_checkpoint(tiny_phi3_model), dtype=torch.float32, device=torch.device("cpu")
    )
    assert lora_targets(phi3)["layers.0.self_attn.qkv_proj"].slice_bounds == (0, 128)
    read = read_lora_adapter(adapter, phi3, max_rank=16, dtype=torch.float32)
    merged = peft_reference(tiny_phi3_model, adapter).merge_and_unload().state_dict()
    base = AutoModelForCausalLM.from_pretrained(tiny_phi3_model, dtype=torch.float32)
    base = base.state_dict()
    for layer in ("self_attn.qkv_proj", "mlp.gate_up_proj"):
        ((a, b),) = read.layers[f"layers.1.{layer}"]
        name = f"model.layers.1.{layer}.weight"
        torch.testing.assert_close(b @ a, merged[name] - base[name], atol=1e-6, rtol=1e-4)
