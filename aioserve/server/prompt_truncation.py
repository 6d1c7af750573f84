"""vLLM's prompt truncation: `truncate_prompt_tokens` and `truncation_side` on both routes.

As vLLM 0.32 (renderers/params.py, TokenizeParams), the prompt is cut after it is tokenized
(a text prompt, a token id prompt, a rendered chat) and before its length is checked:

- `truncate_prompt_tokens` N >= 0 keeps N tokens (0 leaves an empty prompt, refused as
  any empty prompt is); N past --max-model-len is a 400; -1 keeps as many as the context
  holds while leaving room for one output token (max_model_len - 1);
- `truncation_side` "left" keeps the last N tokens, "right" the first N; unset, the side
  vLLM gives generating models' tokenizers: "left".

One departure: vLLM keeps max_model_len tokens for -1 when the request sets no max_tokens
(chat's default), which leaves no room to generate; here -1 always leaves one token's room.
"""

from __future__ import annotations

from dataclasses import dataclass

from aioserve.server.body_fields import BodyFields, shown_value
from aioserve.server.errors import bad_parameter

SIDES = ("left", "right")


@dataclass(frozen=True)
class PromptTruncation:
    keep: int
    """How many of the prompt's tokens to keep at most."""
    side: str
    """"left": the last `keep` are kept; "right": the first."""

    def apply(self, token_ids: list[int]) -> list[int]:
        """The kept tokens (the list itself when it is short enough)."""
        if len(token_ids) <= self.keep:
            return token_ids
        if self.side == "left":
            return token_ids[len(token_ids) - self.keep :]
        return token_ids[: self.keep]


def read_truncation(
    fields: BodyFields, max_model_len: int, *, pooling: bool = False
) -> PromptTruncation | None:
    """The request's truncation, or None; a 400 naming the field for a value vLLM refuses.

    For a pooling route (`pooling`), as vLLM's: -1 keeps the whole context (no token
    follows a pooled prompt), the first tokens are kept unless the request says otherwise
    (vLLM's pooling tokenizers truncate from the right: tokenizers/registry.py), and a
    value past the context is refused in those routes' own words."""
    side = fields.get("truncation_side")
    if side is not None and side not in SIDES:
        raise bad_parameter(
            "truncation_side",
            shown_value(side),
            "`truncation_side` must be either 'left' or 'right'.",
        )
    tokens = fields.get("truncate_prompt_tokens")
    if tokens is None:
        return None
    if tokens < -1:
        raise bad_parameter(
            "truncate_prompt_tokens", tokens, "truncate_prompt_tokens must be at least -1"
        )
    if tokens > max_model_len:
        raise bad_parameter(
            "truncate_prompt_tokens",
            tokens,
            "truncate_prompt_tokens value is greater than max_model_len. Please request a "
            "smaller truncation size."
            if pooling
            else f"truncate_prompt_tokens={tokens} cannot be greater than max_model_len = "
            f"{max_model_len}. Please request a smaller truncation size.",
        )
    if pooling:
        return PromptTruncation(max_model_len if tokens == -1 else tokens, side or "right")
    return PromptTruncation(max_model_len - 1 if tokens == -1 else tokens, side or "left")
