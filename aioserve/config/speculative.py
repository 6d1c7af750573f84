"""--speculative-config: vLLM's JSON of speculative-decoding settings, of which aioserve runs
the method "ngram" (prompt lookup, engine/speculation.py), and vLLM 0.32's shorthands for
three of its keys (--spec-method, --spec-model, --spec-tokens). Other methods and keys are
refused by name; where vLLM's configuration is silent (no prompt_lookup_min/max), both
are 5, as in vLLM."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aioserve.config.declaration import ConfigError
from aioserve.config.values import json_object

# vLLM's other methods (and 0.32's --spec-method choices): each needs a second model (a draft, EAGLE/Medusa heads, MTP
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


def speculative_settings(value: Any) -> dict[str, Any] | NgramSpeculation | None:
    """--speculative-config: a JSON object as vLLM's, each key checked (an NgramSpeculation
    passes as it is). Other methods and keys are refused by name; what must be there is
    checked by `ngram_speculation`, once vLLM 0.32's --spec-* shorthands are folded in."""
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
    method = settings.get("method")
    if method is not None and method not in _NGRAM_NAMES:
        known = "a vLLM method that aioserve does not support yet"
        what = known if method in _OTHER_METHODS else "not a method aioserve knows"
        raise ValueError(f'method {method!r} is {what}; aioserve runs "ngram"')
    for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
        _positive_int(settings, key)
    return settings


def ngram_speculation(settings: dict[str, Any]) -> NgramSpeculation:
    """The speculation that checked settings (of `speculative_settings`) describe: a method
    (or a model naming it) and num_speculative_tokens are needed; the lookup sizes default
    to 5, or to each other."""
    if (settings.get("method") or settings.get("model")) is None:
        raise ValueError('needs a "method"; aioserve runs "ngram"')
    num_tokens = settings.get("num_speculative_tokens")
    if num_tokens is None:
        raise ValueError("needs num_speculative_tokens (the drafts a step)")
    lookup_max = settings.get("prompt_lookup_max")
    lookup_min = settings.get("prompt_lookup_min")
    if lookup_max is None and lookup_min is None:
        lookup_max = lookup_min = DEFAULT_PROMPT_LOOKUP
    lookup_max = lookup_max if lookup_max is not None else lookup_min
    lookup_min = lookup_min if lookup_min is not None else lookup_max
    return NgramSpeculation(num_tokens, lookup_min, lookup_max)


# vLLM 0.32's shorthands, each setting one key of --speculative-config.
SHORTHANDS = (
    ("spec_method", "--spec-method", "method"),
    ("spec_model", "--spec-model", "model"),
    ("spec_tokens", "--spec-tokens", "num_speculative_tokens"),
)


def with_shorthands(
    settings: dict[str, Any] | NgramSpeculation | None,
    given: dict[str, Any],
    keywords: bool = False,
) -> NgramSpeculation | None:
    """--speculative-config with the --spec-* values in `given` (by dest) folded in, as vLLM
    0.32 folds them (a key set both ways is refused), as one NgramSpeculation. A ConfigError
    names the flags (the keywords with `keywords=True`) that gave the settings."""
    shorthands = [
        (dest if keywords else flag, key, given[dest])
        for dest, flag, key in SHORTHANDS
        if given.get(dest) is not None
    ]
    whole = "speculative_config" if keywords else "--speculative-config"
    if isinstance(settings, NgramSpeculation):
        if shorthands:
            raise ConfigError(f"{shorthands[0][0]} cannot amend a speculative_config object")
        return settings
    if settings is None and not shorthands:
        return None
    merged = dict(settings or {})
    for flag, key, value in shorthands:
        if key in merged:
            raise ConfigError(f"{flag} and {whole}['{key}'] are mutually exclusive")
        merged[key] = value
    label = " and ".join(
        ([whole] if settings is not None else []) + [flag for flag, _, _ in shorthands]
    )
    try:
        return ngram_speculation(speculative_settings(merged))
    except ValueError as error:
        raise ConfigError(f"{label} {error}") from None


def spec_model(value: Any) -> str:
    """--spec-model: vLLM's draft model; aioserve's n-gram lookup names none but itself."""
    if value not in _NGRAM_NAMES:
        raise ValueError(
            f'{value!r}: aioserve runs the method "ngram" only, which uses no draft model'
        )
    return value
