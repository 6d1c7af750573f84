"""Tiny LLaVA checkpoints with random weights, saved by transformers, for the image tests:
a CLIP tower (its class row dropped, LLaVA-1.5's "default" selection) and a SigLIP tower
(no class row, "full" selection, two feature layers concatenated), each before a Llama
decoder of SmolLM2's vocabulary plus an "<image>" token.

The decoder's queries and keys are scaled up and its embeddings spread, as in the
Transformers-backend tests, so that a misplaced image row or position moves the greedy
tokens; the projector's output is scaled up so that the image rows weigh on them.
"""

from __future__ import annotations

from pathlib import Path

import torch

IMAGE_SIZE = 28  # pixels a side; patches of 7: 16 patches an image
TOWERS = {
    "clip": dict(feature_layer=-2, strategy="default"),
    "siglip": dict(feature_layer=[-3, -1], strategy="full"),
}


def write_tiny_llava(folder: Path, tokenizer, tower: str) -> int:
    """A tiny LLaVA in `folder` (weights, config, tokenizer, image processor); returns
    the id of its image token."""
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        SiglipVisionConfig,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.save_pretrained(folder)
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    vision_class = CLIPVisionConfig if tower == "clip" else SiglipVisionConfig
    vision = vision_class(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=7,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=image_id,
        vision_feature_layer=TOWERS[tower]["feature_layer"],
        vision_feature_select_strategy=TOWERS[tower]["strategy"],
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "language_model" in name and ("q_proj" in name or "k_proj" in name):
                if name.endswith("weight"):
                    param.normal_(0, 0.5)
            if "multi_modal_projector.linear_2.weight" in name:
                param.normal_(0, 0.5)
        model.get_input_embeddings().weight.normal_(0, 0.3)
    model.save_pretrained(folder)
    size = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE}, crop_size=size).save_pretrained(
        folder
    )
    return image_id


def random_image(seed: int, width: int = 40, height: int = 30):
    """An RGB PIL image of random pixels."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)
