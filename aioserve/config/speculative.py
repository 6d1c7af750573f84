"""--speculative-config: vLLM's JSON of speculative-decoding settings, of which aioserve runs
the method "ngram" (prompt lookup, engine/speculation.py). Other methods and keys are
refused by name; where vLLM's configuration is silent (no prompt_lookup_min/max), both
are 5, as in vLLM."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aioserve.config.values import json_object

# vLLM's other methods: each needs a second model (a draft, EAGLE/Medusa heads, MTP
# layers) or a suffix tree, none of which aioserve has yet.
_OTHER_METHODS = (
    "eagle", "eagle3", "medusa", "mlp_speculator", "draft_model", "deepseek_mtp", "mtp",
    "ernie_mtp", "qwen3_next_mtp", "longcat_flash_mtp", "glm4_moe_mtp", "suffix", "ngram_gpu",
)  # fmt: skip
_NGRAM_NAMES = ("ngram", "[ngram]")
_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True)
class NgramSpeculation:
    """How a sequence speculates: up to `num_speculative_tokens` drafts a step, found by
    the longest suffix n-gram of `prompt_lookup_min`..`prompt_lookup_max` tokens."""

    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min={self.prompt_lookup_min} must be at least 1 and at most "
                f"prompt_lookup_max={self.prompt_lookup_max}"
            )

    def describe(self) -> str:
        return (
            f"n-gram lookup, {self.num_speculative_tokens} drafts a step, n-grams of "
            f"{self.prompt_lookup_min}-{self.prompt_lookup_max} tokens"
        )


def _positive_int(settings: dict[str, Any], key: str) -> int | None:
    value = settings.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"key {key!r} must be a positive integer, got {value!r}")
    return value


def speculative_config(value: Any) -> NgramSpeculation | None:
    """--speculative-config: a JSON object as vLLM's, of which aioserve runs the method
    "ngram" (or "[ngram]", or the same named as `model`); other methods and keys are
    refused by name."""
    if value is None or isinstance(value, NgramSpeculation):
        return value
    settings = json_object(value)
    for key in settings:
        if key not in _KEYS:
            raise ValueError(
                f"key {key!r} is not supported by aioserve (it takes {', '.join(_KEYS)})"
            )
    model = settings.get("model")
    if model is not None and model not in _NGRAM_NAMES:
        raise ValueError(
            f'model {model!r}: aioserve runs the method "ngram" only, which uses no draft model'
        )
    method = settings.get("method") or model
    if method is None:
        raise ValueError('needs a "method"; aioserve runs "ngram"')
    if method not in _NGRAM_NAMES:
        known = "a vLLM method that aioserve does not support yet"
        what = known if method in _OTHER_METHODS else "not a method aioserve knows"
        raise ValueError(f'method {method!r} is {what}; aioserve runs "ngram"')
    num_tokens = _positive_int(settings, "num_speculative_tokens")
    if num_tokens is None:
        raise ValueError("needs num_speculative_tokens (the drafts a step)")
    lookup_max = _positive_int(settings, "prompt_lookup_max")
    lookup_min = _positive_int(settings, "prompt_lookup_min")
    if lookup_max is None and lookup_min is None:
        lookup_max = lookup_min = DEFAULT_PROMPT_LOOKUP
    lookup_max = lookup_max if lookup_max is not None else lookup_min
    lookup_min = lookup_min if lookup_min is not None else lookup_max
    return NgramSpeculation(num_tokens, lookup_min, lookup_max)
