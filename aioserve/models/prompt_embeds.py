"""Rows of a step given as embeddings instead of tokens (a prompt's, vLLM's prompt_embeds).

The model takes `values[i]` in place of the embedding of row `rows[i]`, whose token is a
placeholder: where the model's own embedding of a token would be, after a scale the model
applies inside its embedding (Gemma's) and before one it applies after (Granite's
multiplier), as vLLM's models take them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class PromptEmbeds(NamedTuple):
    rows: torch.Tensor  # [E] int64
    values: torch.Tensor  # [E, hidden], the model's dtype


def with_prompt_embeds(hidden: torch.Tensor, embeds: PromptEmbeds | None) -> torch.Tensor:
    """The step's embeddings `hidden` [T, hidden] with the rows of `embeds` put in."""
    if embeds is not None:
        hidden[embeds.rows] = embeds.values
    return hidden
