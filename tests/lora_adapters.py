"""PEFT LoRA adapters with random weights, saved as folders, for tests.

`peft` builds the adapter on the transformers model, so the folder is exactly what PEFT
saves (adapter_config.json, adapter_model.safetensors); lora_B, which PEFT starts at zero,
gets seeded random values like lora_A so that the adapter changes what the model says.
"""

from __future__ import annotations

from pathlib import Path

import torch

ALL_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_lora_adapter(
    base_folder: str,
    out: Path,
    *,
    rank: int = 8,
    alpha: float = 16,
    targets: tuple[str, ...] = ALL_LAYERS,
    seed: int = 0,
    scale: float = 0.1,
    **config: object,
) -> str:
    """Save a random LoRA adapter of the HF model in `base_folder` to `out`; its path."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_folder, torch_dtype=torch.float32)
    lora = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), **config)
    peft_model = get_peft_model(model, lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    peft_model.save_pretrained(out)
    return str(out)


def peft_reference(base_folder: str, adapter: str):
    """The transformers model with the adapter applied by PEFT (the tests' oracle)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_folder, torch_dtype=torch.float32)
    return PeftModel.from_pretrained(model, adapter).eval()
