"""Images as an image-to-text model takes them: the checkpoint's own image processor turns
each into pixels, and each image's placeholder token in a prompt is widened to the rows
its features fill (vLLM's prompt replacement, done on token ids so that a prompt of text
and one of token ids are treated alike).

The processor is transformers' image processor of the checkpoint's folder
(preprocessor_config.json), the PIL implementation when torchvision is absent, as vLLM
calls the HF processor; vLLM's --mm-processor-kwargs are not taken yet.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class ImageProcessor:
    """The pixels of images, and where their features go in a prompt."""

    def __init__(self, hf_processor: Any, image_token_id: int, tokens_per_image: int) -> None:
        self._hf = hf_processor
        self.image_token_id = image_token_id
        self.tokens_per_image = tokens_per_image

    @classmethod
    def load(cls, folder: Path, image_token_id: int, tokens_per_image: int) -> ImageProcessor:
        from transformers import AutoImageProcessor

        if not (folder / "preprocessor_config.json").is_file():
            raise ValueError(
                f"{folder} has no preprocessor_config.json: an image model needs its image "
                "processor's settings"
            )
        return cls(AutoImageProcessor.from_pretrained(folder), image_token_id, tokens_per_image)

    def pixels(self, image: Any) -> torch.Tensor:
        """One image's pixels [3, H, W] (float32), as the checkpoint's processor makes them."""
        out = self._hf(images=[image], return_tensors="pt")
        return out["pixel_values"][0].float()

    def widen_placeholders(self, token_ids: list[int]) -> tuple[list[int], list[int]]:
        """`token_ids` with each image placeholder made `tokens_per_image` long, and the
        position in the result of each image's first row. A run of placeholders already
        as long as whole images (a prompt its processor widened) counts as those images,
        as vLLM finds them; a run of another length is a ValueError."""
        widened: list[int] = []
        offsets: list[int] = []
        run = 0
        for token in [*token_ids, None]:
            if token == self.image_token_id:
                run += 1
                continue
            if run:
                widened, offsets = self._close_run(widened, offsets, run)
                run = 0
            if token is not None:
                widened.append(token)
        return widened, offsets

    def _close_run(
        self, widened: list[int], offsets: list[int], run: int
    ) -> tuple[list[int], list[int]]:
        size = self.tokens_per_image
        images = 1 if run == 1 else run // size
        if run != 1 and run % size:
            raise ValueError(
                f"a run of {run} image placeholder tokens is neither one placeholder nor whole "
                f"images of {size} tokens"
            )
        for _ in range(images):
            offsets.append(len(widened))
            widened.extend([self.image_token_id] * size)
        return widened, offsets
