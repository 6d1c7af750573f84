"""A model's RoPE settings, read from its HF config, overridden from the command line, and
the longest context they allow.

transformers 5 keeps the base (`rope_theta`) and the scaling in one `rope_parameters`
dict; transformers 4 has `rope_theta` and `rope_scaling` attributes. Both are read here,
and overrides (`--rope-scaling`, `--rope-theta`, the same keys in `--hf-overrides`) are
written back in the config's own form, so that the base survives a new scaling (in
transformers 5, assigning `rope_scaling` replaces the whole dict, base included).

A Gemma 3 config's `rope_parameters` is instead a dict of such dicts keyed by layer type
("sliding_attention", "full_attention"), each with its own base and scaling: those are read
with `layer_type_rope`; the model-wide readers give None for the scaling there (vLLM too
derives no context length from them), and overrides are refused.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import PretrainedConfig

from aioserve.kernels.rope_scaling import LONG_FACTORS_KEY
from aioserve.models.sliding_windows import LAYER_TYPES

logger = logging.getLogger("aioserve")

# Set on a config by `fit_rope_to_context`: the context served (--max-model-len).
_SERVED_CONTEXT_KEY = "aioserve_served_context"

# The scaling types aioserve implements (kernels/rope_scaling.py) and the keys each needs.
_REQUIRED_KEYS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ),
    "yarn": ("factor",),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}


def rope_scaling(config: PretrainedConfig) -> dict | None:
    """The config's scaling dict (with "rope_type"), or None for plain RoPE and for settings
    per layer type (`layer_type_rope`)."""
    scaling = getattr(config, "rope_scaling", None)
    if is_per_layer_type(scaling) or is_per_layer_type(getattr(config, "rope_parameters", None)):
        return None
    if not scaling:
        # transformers 5 keeps rope settings in `rope_parameters` (theta included).
        params = getattr(config, "rope_parameters", None)
        if params and params.get("rope_type", "default") != "default":
            scaling = params
    return scaling


def rope_theta(config: PretrainedConfig) -> float:
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    return float(10000.0 if theta is None else theta)


def is_per_layer_type(params: Any) -> bool:
    """Whether `params` (a config's rope_parameters) holds settings per layer type."""
    return (
        isinstance(params, dict)
        and bool(params)
        and all(key in LAYER_TYPES and isinstance(v, dict | None) for key, v in params.items())
    )


def layer_type_rope(config: PretrainedConfig, layer_type: str) -> tuple[float, dict | None]:
    """(base, scaling dict or None) of the config's layers of `layer_type`: their own where
    `rope_parameters` is keyed by layer type (Gemma 3), the model's otherwise."""
    params = getattr(config, "rope_parameters", None)
    if not is_per_layer_type(params):
        return rope_theta(config), rope_scaling(config)
    own = params.get(layer_type)
    if own is None or own.get("rope_theta") is None:
        raise ValueError(f"rope_parameters has no rope_theta for the {layer_type} layers")
    return float(own["rope_theta"]), own if scaling_type(own) != "default" else None


def scaling_type(scaling: dict | None) -> str:
    scaling = scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def override_rope(
    config: PretrainedConfig,
    scaling: dict[str, Any] | None = None,
    theta: float | None = None,
    flag: str = "--rope-scaling",
) -> None:
    """Replace the config's RoPE scaling with `scaling` and/or its base with `theta`.

    Both are checked here, naming `flag` in the error: a scaling type aioserve implements
    and the keys that type needs, a positive base. YaRN's `original_max_position_embeddings` defaults to
    the config's `max_position_embeddings`, as transformers defaults it.
    """
    if is_per_layer_type(getattr(config, "rope_parameters", None)):
        raise ValueError(
            f"{flag}: this model's RoPE settings are per layer type "
            f"({', '.join(config.rope_parameters)}); overriding them is not supported"
        )
    if scaling is not None:
        scaling = _checked_scaling(scaling, config, flag)
    if theta is not None and not (
        isinstance(theta, int | float) and not isinstance(theta, bool) and theta > 0
    ):
        raise ValueError(f"{flag}: rope_theta must be a number greater than 0, got {theta!r}")
    new_theta = rope_theta(config) if theta is None else float(theta)
    if isinstance(getattr(config, "rope_parameters", None), dict):
        if scaling is None:
            scaling = {k: v for k, v in config.rope_parameters.items() if k != "rope_theta"}
        config.rope_parameters = {**scaling, "rope_theta": new_theta}
        return
    if scaling is not None:
        config.rope_scaling = scaling
    config.rope_theta = new_theta


def _checked_scaling(scaling: dict[str, Any], config: PretrainedConfig, flag: str) -> dict:
    if not isinstance(scaling, dict):
        raise ValueError(f"{flag}: must be a JSON object, got {scaling!r}")
    scaling = dict(scaling)
    legacy_type = scaling.pop("type", None)  # the key transformers 4.44 and older wrote
    kind = scaling.setdefault("rope_type", legacy_type or "default")
    if kind not in _REQUIRED_KEYS:
        raise ValueError(
            f"{flag}: rope_type {kind!r} is not supported; aioserve implements "
            f"{', '.join(_REQUIRED_KEYS)}"
        )
    if kind == "yarn":
        scaling.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    if kind == "longrope" and getattr(config, "original_max_position_embeddings", None):
        scaling.setdefault(
            "original_max_position_embeddings", config.original_max_position_embeddings
        )
    missing = [key for key in _REQUIRED_KEYS[kind] if scaling.get(key) is None]
    if missing:
        raise ValueError(f"{flag}: rope_type {kind!r} needs {', '.join(missing)}")
    factor = scaling.get("factor")
    if factor is not None and not (isinstance(factor, int | float) and factor >= 1):
        raise ValueError(f"{flag}: factor must be a number of at least 1, got {factor!r}")
    return scaling


def scaled_context_length(config: PretrainedConfig) -> int:
    """The longest context the model's RoPE allows, as vLLM derives it: linear and dynamic
    scaling stretch `max_position_embeddings` by their factor; llama3 configs already hold
    the stretched length; YaRN gives `original_max_position_embeddings` times its factor
    (vLLM before 0.11) unless `max_position_embeddings` is already longer (vLLM 0.32
    takes it as already stretched)."""
    length = int(config.max_position_embeddings)
    scaling = rope_scaling(config)
    kind = scaling_type(scaling)
    if kind in ("linear", "dynamic"):
        return int(length * scaling["factor"])
    if kind == "yarn":
        original = scaling.get("original_max_position_embeddings", length)
        return max(length, int(original * scaling["factor"]))
    return length


def fit_rope_to_context(config: PretrainedConfig, max_model_len: int) -> None:
    """Ready the config's RoPE for a served context of `max_model_len`: LongRoPE's factor
    set (`choose_longrope_factors`) and the length of the cos/sin tables
    (`rotary_table_length`)."""
    choose_longrope_factors(config, max_model_len)
    setattr(config, _SERVED_CONTEXT_KEY, max_model_len)


def rotary_table_length(config: PretrainedConfig) -> int:
    """The positions the model's cos/sin tables hold: its maximum context
    (`scaled_context_length`), or the served one where VLLM_ALLOW_LONG_MAX_MODEL_LEN let a
    longer --max-model-len through (`fit_rope_to_context`).

    Only the tables' length follows the served context: the scaling stays computed for the
    model's maximum (models pass it as `scaling_length`), so that dynamic NTK's base stays
    fixed at that longest context and LongRoPE's attention factor is the model's own."""
    return max(scaled_context_length(config), getattr(config, _SERVED_CONTEXT_KEY, 0))


def choose_longrope_factors(config: PretrainedConfig, max_model_len: int) -> None:
    """Have a LongRoPE model rotate every position by its long factors when the context
    served is longer than its original one, by its short factors otherwise, as vLLM does
    (kernels/rope_scaling.py says why one set serves every position)."""
    scaling = rope_scaling(config)
    if scaling_type(scaling) != "longrope":
        return
    original = scaling.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None
    )
    if original is None:
        raise ValueError("a longrope rope_scaling needs original_max_position_embeddings")
    scaling["original_max_position_embeddings"] = original
    scaling[LONG_FACTORS_KEY] = max_model_len > original
    if scaling[LONG_FACTORS_KEY]:
        logger.warning(
            "LongRoPE: --max-model-len %d is longer than the model's original context of %d "
            "tokens, so every position takes the long factors (as in vLLM), at some cost to "
            "short sequences; --max-model-len %d or less keeps the short ones",
            max_model_len,
            original,
            original,
        )
