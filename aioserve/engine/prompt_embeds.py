"""Prompts given as embeddings (vLLM's --enable-prompt-embeds), checked as the engine takes them.

A prompt dict {"prompt_embeds": tensor} holds one row a prompt position: what the model's
token embedding would give there (after a scale the model applies inside it, as Gemma's;
before one applied after it, as Granite's embedding multiplier), which the model takes in
place of the embedding of a token. The request keeps the rows, in the model's dtype; its
prompt tokens are placeholders (id 0, as in vLLM), which the prefix cache keys by a digest
of the rows (block_hashing.py) and penalties do not count. vLLM's rules otherwise: a
[1, tokens, hidden] tensor is taken as [tokens, hidden]; floating-point rows only, cast to
the model's dtype; no prompt logprobs (a prompt of embeddings has no tokens to score).
"""

from __future__ import annotations

from typing import Any

import torch

from aioserve.engine.admission import InvalidRequest
from aioserve.engine.sampling_params import SamplingParams
from aioserve.engine.settings import EngineSettings

PLACEHOLDER_TOKEN_ID = 0


def prompt_embeds_of(prompt: Any, settings: EngineSettings) -> torch.Tensor | None:
    """The rows of a {"prompt_embeds": tensor} prompt, checked and in the model's dtype on
    the CPU; None for any other prompt. InvalidRequest naming `prompt_embeds` otherwise."""
    if not isinstance(prompt, dict) or "prompt_embeds" not in prompt:
        return None
    check_prompt_embeds_taken(settings)
    embeds = prompt["prompt_embeds"]
    if not isinstance(embeds, torch.Tensor):
        raise InvalidRequest(
            f"prompt_embeds must be a torch.Tensor, got {type(embeds).__name__}",
            "prompt_embeds",
            "<not a tensor>",
        )
    if embeds.dim() == 3 and embeds.shape[0] == 1:
        embeds = embeds.squeeze(0)
    shape = tuple(embeds.shape)
    if embeds.dim() != 2:
        raise InvalidRequest(
            f"`prompt_embeds` must be a 2D tensor of shape (num_tokens, hidden_size); got "
            f"shape {shape}.",
            "prompt_embeds",
            f"<tensor of shape {shape}>",
        )
    if shape[1] != settings.hidden_size:
        raise InvalidRequest(
            f"`prompt_embeds` hidden_size {shape[1]} does not match the model's hidden_size "
            f"{settings.hidden_size}.",
            "prompt_embeds",
            f"<tensor of shape {shape}>",
        )
    if shape[0] == 0:
        raise InvalidRequest("the prompt must contain at least one token", "prompt", "<tensor>")
    if not embeds.is_floating_point():
        raise InvalidRequest(
            f"`prompt_embeds` dtype {embeds.dtype} is not a floating-point type, cannot "
            f"safely cast to the model's dtype {settings.dtype}.",
            "prompt_embeds",
            f"<tensor of {embeds.dtype}>",
        )
    if not torch.isfinite(embeds).all():
        raise InvalidRequest(
            "`prompt_embeds` holds values that are not finite (inf or NaN)",
            "prompt_embeds",
            "<tensor>",
        )
    # A copy of the caller's rows: they stay the request's whatever the caller does next.
    return embeds.detach().to("cpu", settings.dtype, copy=True).contiguous()


def check_prompt_embeds_taken(settings: EngineSettings) -> None:
    """InvalidRequest unless this engine takes prompts as embeddings."""
    if not settings.enable_prompt_embeds:
        raise InvalidRequest(
            "You must set `--enable-prompt-embeds` to input `prompt_embeds`.",
            "prompt_embeds",
            "<tensor>",
        )
    if settings.pooler is not None:
        raise InvalidRequest(
            "prompt_embeds are taken by generative models only", "prompt_embeds", "<tensor>"
        )


def check_embeds_request(params: SamplingParams) -> None:
    """What a prompt of embeddings cannot ask for."""
    if params.prompt_logprobs is not None:
        raise InvalidRequest(
            "prompt_logprobs is not compatible with prompt embeds.",
            "prompt_logprobs",
            params.prompt_logprobs,
        )


def placeholder_prompt(embeds: torch.Tensor) -> list[int]:
    """The prompt tokens of a prompt of embeddings: one placeholder a row."""
    return [PLACEHOLDER_TOKEN_ID] * embeds.shape[0]
