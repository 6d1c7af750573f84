"""/v1/completions' `prompt_embeds`: prompts sent as embeddings (--enable-prompt-embeds).

Each is a base64 string of a `torch.save`d tensor [tokens, hidden size] (or [1, tokens,
hidden size]), one string or a list of them, as vLLM takes them. They are read with
`torch.load(weights_only=True)` (no code runs from the bytes) off the event loop; a sparse
tensor is made dense once its shape is known to fit the context. The engine checks the rest
(engine/prompt_embeds.py). Errors are vLLM's 400s naming `prompt_embeds`.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import torch

from aioserve.server.body_fields import check_prompt_count, shown_value
from aioserve.server.errors import bad_parameter, refusal

_MAX_REASON_CHARS = 200  # how much of torch's own reason is repeated back


def read_prompt_embeds(value: Any) -> list[str]:
    """The request's `prompt_embeds` as a list of base64 strings ([] when absent or empty)."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(item, str) and item for item in items):
        raise bad_parameter(
            "prompt_embeds",
            shown_value(value),
            "prompt_embeds must be a base64 string or an array of base64 strings",
        )
    check_prompt_count(len(items), "prompt_embeds")
    return items


def load_prompt_embeds(encoded: str, max_rows: int, hidden_size: int) -> torch.Tensor:
    """The tensor one base64 string holds, dense, on the CPU."""
    try:
        payload = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as error:
        raise refusal(f"`prompt_embeds` is not valid base64: {error}", "prompt_embeds") from None
    try:
        with torch.sparse.check_sparse_tensor_invariants():
            tensor = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
    except MemoryError:
        raise
    except Exception as error:  # noqa: BLE001 - torch has no one error for "not a tensor file"
        reason = str(error).strip() or type(error).__name__
        if len(reason) > _MAX_REASON_CHARS:
            cut = len(reason) - _MAX_REASON_CHARS
            reason = f"{reason[:_MAX_REASON_CHARS]}... ({cut} more characters truncated)"
        raise refusal(
            f"`prompt_embeds` could not be deserialized as a torch tensor: {reason}",
            "prompt_embeds",
        ) from None
    if not isinstance(tensor, torch.Tensor):
        raise refusal(
            f"`prompt_embeds` must hold a tensor, not a {type(tensor).__name__}", "prompt_embeds"
        )
    shape = tuple(tensor.shape)
    rows_and_width = shape[1:] if len(shape) == 3 and shape[0] == 1 else shape
    if len(rows_and_width) != 2:
        raise refusal(
            "`prompt_embeds` must be a 2D tensor of shape (num_tokens, hidden_size); got "
            f"shape {shape}.",
            "prompt_embeds",
        )
    if rows_and_width[1] != hidden_size:
        raise refusal(
            f"`prompt_embeds` hidden_size {rows_and_width[1]} does not match the model's "
            f"hidden_size {hidden_size}.",
            "prompt_embeds",
        )
    if tensor.layout != torch.strided:
        # Its dense form is allocated here: a few bytes could otherwise claim gigabytes.
        if rows_and_width[0] > max_rows:
            raise refusal(
                f"a sparse `prompt_embeds` tensor may have at most max_model_len={max_rows} "
                f"rows; got {rows_and_width[0]}",
                "prompt_embeds",
            )
        tensor = tensor.to_dense()
    return tensor
