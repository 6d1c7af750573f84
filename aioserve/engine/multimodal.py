"""Prompts with images: vLLM's {"prompt": ... or "prompt_token_ids": ..., "multi_modal_data":
{"image": image or [images]}}, made ready before the request is added.

Each image's placeholder token in the prompt is widened to the rows its features fill
(models/image_inputs.py), the image made pixels by the checkpoint's processor and encoded
by the model's vision tower, on the model thread between steps (as vLLM's runner runs its
encoder), so that the event loop never waits on it. What comes back is an ImagePrompt:
the widened token ids and each image's rows, which the request carries and its prefill
chunks put in place of the placeholders' embeddings (engine/plan_builder.py). The prefix
cache keys a block holding image rows by the image's digest as well as its tokens
(block_hashing.py), so that two prompts alike but for their images share no block.

Checked as vLLM checks them: images only ("video" and "audio" are refused by name, and a
model without a vision tower takes none), at most --limit-mm-per-prompt of them, PIL
images, as many as the prompt has placeholders.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from aioserve.config.multimodal import DEFAULT_MM_LIMIT
from aioserve.engine.admission import InvalidRequest
from aioserve.models.checkpoint import Checkpoint
from aioserve.models.image_inputs import ImageProcessor

MULTI_MODAL_DATA = "multi_modal_data"


@dataclass(frozen=True)
class ImageRows:
    """One image's features in a prompt: they take rows offset..offset+len(values)."""

    offset: int
    values: torch.Tensor  # [tokens, hidden], the model's dtype, on the host
    digest: bytes  # SHA-256 of its pixels: what the prefix cache keys it by


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt with its images encoded, as `AsyncEngine.prepare_prompt` makes it."""

    prompt: str | None
    prompt_token_ids: list[int]
    images: tuple[ImageRows, ...]
    cache_salt: str | None = None


@dataclass(frozen=True)
class ImageJob:
    """What the model thread does for a prompt's images: pixels, then features."""

    images: list[Any]
    processor: ImageProcessor


def has_multimodal_data(prompt: Any) -> bool:
    return isinstance(prompt, dict) and prompt.get(MULTI_MODAL_DATA) is not None


def images_of(prompt: dict, limits: dict[str, int]) -> list[Any]:
    """The prompt's images, checked; InvalidRequest naming what is wrong."""
    from PIL import Image

    data = prompt[MULTI_MODAL_DATA]
    if not isinstance(data, dict):
        raise InvalidRequest(
            "multi_modal_data must be a dict of modality -> items", MULTI_MODAL_DATA, data
        )
    for modality in data:
        if modality != "image":
            raise InvalidRequest(
                f"modality {modality!r} is not supported by aioserve yet (it takes images)",
                MULTI_MODAL_DATA,
                modality,
            )
    items = data.get("image")
    images = list(items) if isinstance(items, (list, tuple)) else [items]
    limit = limits.get("image", DEFAULT_MM_LIMIT)
    if len(images) > limit:
        raise InvalidRequest(
            f"At most {limit} image(s) may be provided in one prompt.",
            MULTI_MODAL_DATA,
            len(images),
        )
    for image in images:
        if not isinstance(image, Image.Image):
            raise InvalidRequest(
                f"an image must be a PIL.Image.Image, got {type(image).__name__}",
                MULTI_MODAL_DATA,
                type(image).__name__,
            )
    return images


def widened_prompt(
    processor: ImageProcessor, prompt_ids: list[int], num_images: int
) -> tuple[list[int], list[int]]:
    """The prompt's token ids with its placeholders widened, and each image's offset."""
    try:
        widened, offsets = processor.widen_placeholders(prompt_ids)
    except ValueError as error:
        raise InvalidRequest(str(error), "prompt", "<image placeholders>") from None
    if len(offsets) != num_images:
        raise InvalidRequest(
            f"the prompt has {len(offsets)} image placeholder(s) for {num_images} image(s)",
            "prompt",
            "<image placeholders>",
        )
    return widened, offsets


def run_image_job(job: ImageJob, encode: Any) -> list[tuple[torch.Tensor, bytes]]:
    """On the model thread: each image's features (by `encode`, the runner's) and digest."""
    encoded = []
    for image in job.images:
        pixels = job.processor.pixels(image)
        digest = hashlib.sha256(pixels.contiguous().numpy().tobytes()).digest()
        encoded.append((encode(pixels), digest))
    return encoded


def image_processor_for(checkpoint: Checkpoint, model: torch.nn.Module) -> ImageProcessor | None:
    """The processor of an image model (one with a vision tower: `image_features`) from
    its checkpoint's folder; None for a model that takes no images."""
    if not hasattr(model, "image_features"):
        return None
    return ImageProcessor.load(checkpoint.source.path, model.image_token_id, model.num_image_tokens)
