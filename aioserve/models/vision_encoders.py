"""The vision towers of image-to-text models, in plain torch: CLIP's and SigLIP's ViT.

An image's pixels (as its processor gives them, [3, H, W]) become patch embeddings with
learned positions (CLIP puts a class embedding first and normalizes before the layers),
then pre-norm transformer layers with full attention among one image's patches. What a
multimodal model takes is the hidden state after some layer (LLaVA's `vision_feature_layer`,
-2: the second-to-last), so `hidden_states(pixels, layers)` runs only as many layers as
the deepest one asked for. The heads after the last layer (CLIP's post-norm and
projection, SigLIP's pooling head) are never used and not built.

Parameter names are those of transformers' CLIPVisionModel / SiglipVisionModel under their
`vision_model.` prefix, which `parameter_for` removes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


class VisionAttention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        size = config.hidden_size
        self.q_proj = nn.Linear(size, size)
        self.k_proj = nn.Linear(size, size)
        self.v_proj = nn.Linear(size, size)
        self.out_proj = nn.Linear(size, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        images, patches, size = x.shape

        def heads(projection: nn.Linear) -> torch.Tensor:
            return projection(x).view(images, patches, self.num_heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads(self.q_proj), heads(self.k_proj), heads(self.v_proj)
        )
        return self.out_proj(out.transpose(1, 2).reshape(images, patches, size))


class VisionMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision tower activation {config.hidden_act!r} is not supported")
        self.act = ACTIVATIONS[config.hidden_act]
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        eps = config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.self_attn = VisionAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEmbeddings(nn.Module):
    """Patches (and CLIP's class embedding) with their learned positions."""

    def __init__(self, config: PretrainedConfig, class_token: bool) -> None:
        super().__init__()
        size, patch = config.hidden_size, config.patch_size
        self.image_size = config.image_size
        self.patch_embedding = nn.Conv2d(
            config.num_channels, size, kernel_size=patch, stride=patch, bias=not class_token
        )
        num_positions = (config.image_size // patch) ** 2 + int(class_token)
        self.class_embedding = nn.Parameter(torch.zeros(size)) if class_token else None
        self.position_embedding = nn.Embedding(num_positions, size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        height, width = pixels.shape[-2:]
        if (height, width) != (self.image_size, self.image_size):
            raise ValueError(
                f"an image of {height}x{width} pixels reached a vision tower of "
                f"{self.image_size}x{self.image_size}"
            )
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)
        if self.class_embedding is not None:
            cls = self.class_embedding.expand(patches.shape[0], 1, -1)
            patches = torch.cat([cls, patches], dim=1)
        return patches + self.position_embedding.weight


class VisionTower(nn.Module):
    """CLIP's (`class_token`: a class embedding, a norm before the layers) or SigLIP's ViT."""

    def __init__(self, config: PretrainedConfig, class_token: bool) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.image_size = config.image_size
        self.embeddings = VisionEmbeddings(config, class_token)
        eps = config.layer_norm_eps
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=eps) if class_token else None
        self.layers = nn.ModuleList(VisionLayer(config) for _ in range(config.num_hidden_layers))

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def hidden_states(self, pixels: torch.Tensor, layers: list[int]) -> list[torch.Tensor]:
        """The hidden states [images, tokens, hidden] at each of `layers`, counted as
        transformers counts `hidden_states` (0: the embeddings, i: after layer i; negative
        from the end)."""
        depth = len(self.layers)
        wanted = [layer % (depth + 1) for layer in layers]
        x = self.embeddings(pixels)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        states = {0: x}
        for index, layer in enumerate(self.layers[: max(wanted)], start=1):
            x = layer(x)
            states[index] = x
        return [states[layer] for layer in wanted]

    def parameter_for(self, hf_name: str) -> str:
        """Our name of a checkpoint's vision tower tensor (its `vision_model.` name)."""
        name = hf_name.removeprefix("vision_model.").replace("encoder.layers.", "layers.")
        return name.replace("pre_layernorm.", "pre_layrnorm.")


def vision_tower_for(config: PretrainedConfig) -> VisionTower:
    """The vision tower a multimodal config's `vision_config` describes."""
    kind = getattr(config, "model_type", None)
    if kind == "clip_vision_model":
        return VisionTower(config, class_token=True)
    if kind == "siglip_vision_model":
        return VisionTower(config, class_token=False)
    raise ValueError(
        f"vision tower {kind!r} is not supported yet (aioserve runs clip_vision_model and "
        "siglip_vision_model)"
    )


def is_unused_tower_tensor(name: str) -> bool:
    """A tensor of the parts of a tower no multimodal model reads (the heads after the
    last layer)."""
    return name.startswith(("post_layernorm.", "head.")) or name.endswith("position_ids")
