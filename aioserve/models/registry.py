"""From a HF config's `architectures` to the class that implements it."""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from aioserve.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def model_class_for(config: PretrainedConfig) -> type[nn.Module]:
    architectures = getattr(config, "architectures", None) or []
    for architecture in architectures:
        if architecture in MODEL_CLASSES:
            return MODEL_CLASSES[architecture]
    raise ValueError(
        f"model architectures {architectures} are not supported yet; "
        f"supported: {', '.join(sorted(MODEL_CLASSES))}"
    )
