"""LLaVA (LlavaForConditionalGeneration): a vision tower, a projector, and a Llama-family
decoder that reads the projected image features in place of the image's placeholder tokens.

The decoder is the Llama family's (models/llama.py) built from the config's `text_config`,
so that the runner, the KV cache and the compiled step see a language model like any
other; an image enters a step as rows given as embeddings (models/prompt_embeds.py), which
`image_features` computes: the tower's hidden state at `vision_feature_layer` (several
layers are concatenated), its class row dropped under the "default" selection strategy,
through the projector (linear, activation, linear). One image gives `num_image_tokens`
rows, which its processor's placeholder expansion (models/image_inputs.py) leaves room for.

Checkpoints name tensors in either of transformers' layouts, the original
(`language_model.model.*`, `language_model.lm_head`, `vision_tower.vision_model.*`,
`multi_modal_projector.*`) or transformers 5's (`model.language_model.*`, `lm_head`,
`model.vision_tower.vision_model.*`, `model.multi_modal_projector.*`).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from aioserve.models.llama import LlamaForCausalLM
from aioserve.models.vision_encoders import ACTIVATIONS, is_unused_tower_tensor, vision_tower_for

# The text decoders a LLaVA may wrap: those models/llama.py implements.
_TEXT_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "granite")


class LlavaProjector(nn.Module):
    def __init__(self, config: PretrainedConfig, in_features: int) -> None:
        super().__init__()
        bias = bool(getattr(config, "multimodal_projector_bias", True))
        size = config.text_config.hidden_size
        activation = getattr(config, "projector_hidden_act", "gelu")
        if activation not in ACTIVATIONS:
            raise ValueError(f"projector activation {activation!r} is not supported")
        self.act = ACTIVATIONS[activation]
        self.linear_1 = nn.Linear(in_features, size, bias=bias)
        self.linear_2 = nn.Linear(size, size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """A Llama-family decoder (this class's own parameters and forward) with a vision
    tower and projector beside it, read only by `image_features`."""

    def __init__(self, config: PretrainedConfig) -> None:
        text_config = config.text_config
        if text_config.model_type not in _TEXT_MODEL_TYPES:
            raise ValueError(
                f"a LLaVA whose language model is {text_config.model_type!r} is not supported "
                f"yet (aioserve runs {', '.join(_TEXT_MODEL_TYPES)})"
            )
        super().__init__(text_config)
        self.vision_tower = vision_tower_for(config.vision_config)
        layer = config.vision_feature_layer
        self.feature_layers = [layer] if isinstance(layer, int) else list(layer)
        self.drops_class_row = config.vision_feature_select_strategy == "default"
        self.image_token_id = int(config.image_token_id)
        in_features = config.vision_config.hidden_size * len(self.feature_layers)
        self.multi_modal_projector = LlavaProjector(config, in_features)

    @property
    def num_image_tokens(self) -> int:
        """The rows one image gives (its placeholder tokens in a prompt)."""
        class_rows = int(self.vision_tower.embeddings.class_embedding is not None)
        return self.vision_tower.num_patches + class_rows - int(self.drops_class_row)

    def image_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """The rows [num_image_tokens, hidden] that the image `pixels` [3, H, W] gives."""
        states = self.vision_tower.hidden_states(pixels.unsqueeze(0), self.feature_layers)
        if self.drops_class_row:
            states = [state[:, 1:] for state in states]
        features = self.multi_modal_projector(torch.cat(states, dim=-1))
        return features.squeeze(0)

    def parameter_for(self, hf_name: str) -> tuple[str, int | None] | None:
        name = hf_name.removeprefix("model.")
        for part in ("vision_tower.", "multi_modal_projector."):
            if name.startswith(part):
                rest = name.removeprefix(part)
                if part == "vision_tower.":
                    rest = self.vision_tower.parameter_for(rest)
                    if is_unused_tower_tensor(rest):
                        return None
                return part + rest, None
        if name.startswith("language_model."):
            # language_model.model.X (original) or language_model.X (transformers 5);
            # language_model.lm_head (original)
            name = name.removeprefix("language_model.").removeprefix("model.")
        return super().parameter_for(name)
