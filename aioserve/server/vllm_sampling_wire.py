"""aioserve's SamplingParams as vLLM 0.32 writes its own in JSON, and back.

vLLM's `SamplingParams` is a msgspec Struct with `omit_defaults=True`: its JSON (in a
scale-out `GenerateRequest`) holds only the fields whose value is not the declared default
object. msgspec compares by identity there, so the six float fields the OpenAI routes fill
from their own defaults (penalties, temperature, top_p, min_p) are always written (but
top_p and min_p of greedy sampling, which vLLM resets to the defaults themselves), while
ints, bools and None at their defaults are left out; `stop`, `stop_token_ids` and
`bad_words` are always lists (`[]`), `output_kind` is its number, `skip_clone` is true on
the render path, `output_text_buffer_length` is derived from the stop strings, and
`skip_reading_prefix_cache` is whether prompt logprobs are wanted. `to_wire` writes that.

`from_wire` reads such a JSON object (the body of POST /inference/v1/generate) into
aioserve's SamplingParams. vLLM's fields aioserve has no use for are taken when they change
nothing here: `output_kind` (the route sets it, as vLLM's does), `skip_clone`,
`output_text_buffer_length` (aioserve holds back stop-string text its own way),
`flat_logprobs` (a container layout inside vLLM), `routed_experts_prompt_start` (for
--enable-return-routed-experts, which aioserve does not have), and
`skip_reading_prefix_cache` (aioserve scores prompt logprobs on prefix-cache hits too).
`watermarking`, `prompt_logprob_token_ids`, `prompt_logprob_start` and
`trace_decode_token_ids` are refused unless at their defaults; unknown keys are refused.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from aioserve.engine.sampling_params import SAMPLING_EPS, SamplingParams
from aioserve.engine.structured_outputs import StructuredOutputsParams

# vLLM 0.32's SamplingParams fields, in its declaration order, with their defaults.
_VLLM_FIELDS: dict[str, Any] = {
    "n": 1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "watermarking": None,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "seed": None,
    "stop": None,
    "stop_token_ids": None,
    "ignore_eos": False,
    "max_tokens": 16,
    "min_tokens": 0,
    "logprobs": None,
    "prompt_logprobs": None,
    "prompt_logprob_token_ids": None,
    "prompt_logprob_start": None,
    "logprob_token_ids": None,
    "flat_logprobs": False,
    "detokenize": True,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "include_stop_str_in_output": False,
    "output_kind": 0,
    "stream_interval": None,
    "skip_clone": False,
    "output_text_buffer_length": 0,
    "structured_outputs": None,
    "logit_bias": None,
    "allowed_token_ids": None,
    "extra_args": None,
    "bad_words": None,
    "skip_reading_prefix_cache": None,
    "thinking_token_budget": None,
    "repetition_detection": None,
    "routed_experts_prompt_start": 0,
    "trace_decode_token_ids": None,
}
_ALWAYS_WRITTEN = frozenset(
    {"presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p"}
)
_ACCEPTED_AS_IS = frozenset(
    {
        "output_kind",
        "skip_clone",
        "output_text_buffer_length",
        "flat_logprobs",
        "routed_experts_prompt_start",
        "skip_reading_prefix_cache",
    }
)
_REFUSED_UNLESS_DEFAULT = ("watermarking", "prompt_logprob_token_ids", "prompt_logprob_start")
_SHARED = frozenset(f.name for f in fields(SamplingParams)) & _VLLM_FIELDS.keys()
_VLLM_MIN_TEMPERATURE = 0.01  # vLLM raises a temperature in (0, 0.01) to this


class WireError(ValueError):
    """A sampling_params field refused: its name and the reason."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def to_wire(params: SamplingParams, *, top_k_off: int = 0) -> dict[str, Any]:
    """vLLM's JSON of `params` as its render routes build them (`skip_clone` true).
    `top_k_off`: the request's spelling of "no top-k" (0, or -1 which vLLM keeps)."""
    values = {name: getattr(params, name) for name in _SHARED}
    values["top_k"] = top_k_off if params.top_k == -1 and not params.is_greedy else params.top_k
    if params.is_greedy:
        values["top_k"] = 0
    elif params.temperature < _VLLM_MIN_TEMPERATURE:
        values["temperature"] = _VLLM_MIN_TEMPERATURE
    values["bad_words"] = params.bad_words or []
    values["output_kind"] = params.output_kind.value
    values["skip_clone"] = True
    if params.stop and not params.include_stop_str_in_output:
        values["output_text_buffer_length"] = max(len(s) for s in params.stop) - 1
    values["skip_reading_prefix_cache"] = params.prompt_logprobs is not None
    if params.structured_outputs is not None:
        values["structured_outputs"] = _structured_outputs_wire(params.structured_outputs)
    if params.logit_bias is not None:
        values["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
    if params.repetition_detection is not None:
        detection = params.repetition_detection
        values["repetition_detection"] = {
            f.name: getattr(detection, f.name) for f in fields(detection)
        }
    # Greedy sampling resets top_p and min_p to the default objects themselves.
    always = _ALWAYS_WRITTEN - {"top_p", "min_p"} if params.is_greedy else _ALWAYS_WRITTEN
    wire: dict[str, Any] = {}
    for name, default in _VLLM_FIELDS.items():
        if name not in values:
            continue
        value = values[name]
        if name in always:
            wire[name] = float(value)
        elif not _is_default(value, default):
            wire[name] = value
    return wire


def _is_default(value: Any, default: Any) -> bool:
    if default is None:
        return value is None
    return type(value) is type(default) and value == default


def _structured_outputs_wire(so: StructuredOutputsParams) -> dict[str, Any]:
    """vLLM's StructuredOutputsParams as msgspec writes that dataclass: every field."""
    return {
        "json": so.json,
        "regex": so.regex,
        "choice": so.choice,
        "grammar": so.grammar,
        "json_object": so.json_object,
        "disable_any_whitespace": so.disable_any_whitespace,
        "disable_additional_properties": so.disable_additional_properties,
        "whitespace_pattern": so.whitespace_pattern,
        "structural_tag": so.structural_tag,
        "_backend": None,
        "_backend_was_auto": False,
    }


def from_wire(data: Any) -> dict[str, Any]:
    """The SamplingParams keywords of a vLLM SamplingParams JSON object; WireError names
    the field refused. The SamplingParams built from them checks the values."""
    if not isinstance(data, dict):
        raise WireError("sampling_params", "sampling_params must be an object")
    unknown = sorted(str(key) for key in data if key not in _VLLM_FIELDS)
    if unknown:
        raise WireError(unknown[0], f"unknown sampling parameter(s): {', '.join(unknown)}")
    for name in _REFUSED_UNLESS_DEFAULT:
        if data.get(name) not in (None, False):
            raise WireError(name, f"{name} is not supported by aioserve")
    if data.get("trace_decode_token_ids"):
        raise WireError("trace_decode_token_ids", "trace_decode_token_ids is not supported")
    kwargs = {name: value for name, value in data.items() if name in _SHARED}
    structured = kwargs.get("structured_outputs")
    if isinstance(structured, dict):
        kwargs["structured_outputs"] = {
            key: value
            for key, value in structured.items()
            if not key.startswith("_") and value is not None
        }
    if kwargs.get("temperature") is not None and _is_number(kwargs["temperature"]):
        if 0 < kwargs["temperature"] < SAMPLING_EPS:  # vLLM's raise to 0.01, not greedy
            kwargs["temperature"] = _VLLM_MIN_TEMPERATURE
    return kwargs


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
