"""SamplingParams: how one request's tokens are chosen and returned, with vLLM's surface.

Field names, defaults, normalization and validation messages follow vLLM's
`vllm/sampling_params.py`, so code and clients written for vLLM behave the same here.
Construction normalizes and validates (`ValueError` naming the field and the bad value):

- `stop` may be a string or a list of strings and becomes a list; `stop_token_ids` becomes
  a list without duplicates; `logit_bias` keys may be strings of integers, as JSON sends
  them, and become ints, with values clamped to [-100, 100] as in vLLM.
- `seed=-1` means no seed.
- A temperature below 1e-5 means greedy sampling: top_p, top_k and min_p are reset to
  their "off" values (1.0, -1, 0.0), as vLLM does, and `n` must then be 1.

- `top_k` 0 or -1 disables top-k (vLLM 0.32 prefers 0 and quietly accepts -1); it is
  held as -1.

Where this differs from current vLLM, on purpose: `logprobs` and `prompt_logprobs` must be
non-negative (no -1 for "the whole vocabulary"); a temperature in (0, 0.01) is kept as
given rather than raised to 0.01 (the sampler works in float32 on max-subtracted values
and stays finite). Limits that need the model, its tokenizer or the server's settings
(vocabulary range of token ids, `bad_words`' tokens, `--max-logprobs`) are checked by the
engine, not here.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import InitVar, dataclass
from enum import Enum, IntEnum
from typing import Any

from aioserve.engine.repetition import RepetitionDetectionParams
from aioserve.engine.structured_outputs.params import StructuredOutputsParams

# Below this temperature a request is greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# The most tokens `logprob_token_ids` may name (vLLM's MAX_LOGPROB_TOKEN_IDS).
MAX_LOGPROB_TOKEN_IDS = 128

_INT64_MIN = -(2**63)


class FieldError(ValueError):
    """A refused value whose message does not start with its field's name (vLLM's own
    wordings): the field and the value to show, as vLLM's VLLMValidationError carries them."""

    def __init__(self, message: str, field: str, value: Any) -> None:
        super().__init__(message)
        self.field = field
        self.value = value


_INT64_MAX = 2**63 - 1
_MAX_ABS_LOGIT_BIAS = 100.0


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(Enum):
    CUMULATIVE = 0  # every RequestOutput carries the whole output so far
    DELTA = 1  # every RequestOutput carries only what is new since the last one
    FINAL_ONLY = 2  # one RequestOutput, when the request finishes


@dataclass
class SamplingParams:
    """Sampling parameters for text generation (vLLM's fields, defaults and checks)."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    """The tokens whose logprobs each output position reports, in this order, after the
    sampled token's, instead of the `logprobs` most likely ones."""
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    """Words the output must not contain (engine/bad_words.py)."""
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: InitVar[StructuredOutputsParams | None] = None
    """vLLM's older name of `structured_outputs`."""
    reasoning_end: str | None = None
    """The text that ends the output's reasoning (`</think>`): structured outputs apply only
    after it. The server sets it for chat requests with --reasoning-parser."""
    stream_interval: int | None = None
    """Tokens each streamed output gathers (DELTA outputs; the first token and the end are
    sent at once); raised to the engine's --stream-interval if below it."""
    repetition_detection: RepetitionDetectionParams | None = None
    """End the output early, finish_reason "repetition", once it repeats a short token
    pattern back to back (engine/repetition.py); a dict of its fields is taken too."""
    thinking_token_budget: int | None = None
    """Most tokens the output may think for (after the reasoning start marker, counting a
    thought the prompt began); then the reasoning end marker is forced
    (runner/thinking_budget.py). -1 means no budget. Needs --reasoning-parser or
    --reasoning-config."""
    extra_args: dict[str, Any] | None = None
    """Arguments for custom logits processors (--logits-processors), which read them; the
    server takes them from the body's `vllm_xargs`. Nothing else reads them."""

    def __post_init__(self, guided_decoding: StructuredOutputsParams | None = None) -> None:
        if guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("give structured_outputs or guided_decoding, not both.")
            self.structured_outputs = guided_decoding
        self._normalize_types()
        if self.top_k == 0:
            self.top_k = -1
        self._verify_args()
        if self.temperature < SAMPLING_EPS:
            self.top_p = 1.0
            self.top_k = -1
            self.min_p = 0.0
            if self.n > 1:
                raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplingParams:
        """Build from a mapping such as a decoded JSON body.

        Unknown keys are rejected, naming them. A None value for a field that cannot be
        None (e.g. `"temperature": null`) means "use the default", as OpenAI clients send
        null for "not set"; for a field that can (e.g. `max_tokens`), None is kept.
        """
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(str(key) for key in data if key not in known)
        if unknown:
            names = ", ".join(repr(name) for name in unknown)
            raise ValueError(f"unknown sampling parameter(s): {names}")
        kwargs = {
            key: value
            for key, value in data.items()
            if value is not None or "None" in str(known[key].type)
        }
        return cls(**kwargs)

    def clone(self, **changes: Any) -> SamplingParams:
        """A deep copy, with `changes` applied (and validated) when given."""
        if changes:
            return dataclasses.replace(copy.deepcopy(self), **changes)
        return copy.deepcopy(self)

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type is SamplingType.GREEDY

    @property
    def wants_logprobs(self) -> bool:
        """Whether each output position reports logprobs (`logprobs` or `logprob_token_ids`)."""
        return self.logprobs is not None or self.logprob_token_ids is not None

    def __repr__(self) -> str:
        # Only the fields that differ from the defaults: short in logs, and still valid
        # Python that rebuilds an equal object.
        changed = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(_DEFAULTS, f.name)
        ]
        return f"SamplingParams({', '.join(changed)})"

    def _verify_logprob_token_ids(self) -> None:
        """vLLM's checks of logprob_token_ids (but its vocabulary range: the engine's)."""
        ids = self.logprob_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) for t in ids):
            raise ValueError(f"logprob_token_ids must be a list of integers, got {ids!r}.")
        if not ids:  # vLLM reads an empty list as not set
            self.logprob_token_ids = None
            return
        if len(ids) > MAX_LOGPROB_TOKEN_IDS:
            raise FieldError(
                f"Requested logprob_token_ids of length {len(ids)}, which is greater than max "
                f"allowed: {MAX_LOGPROB_TOKEN_IDS}",
                "logprob_token_ids",
                len(ids),
            )
        if self.logprobs is not None and self.logprobs != len(ids):
            raise FieldError(
                "When both logprobs and logprob_token_ids are set, logprobs must equal "
                f"len(logprob_token_ids). Got logprobs={self.logprobs}, "
                f"len(logprob_token_ids)={len(ids)}.",
                "logprob_token_ids",
                len(ids),
            )
        self.logprob_token_ids = list(ids)

    def _normalize_types(self) -> None:
        for name in ("n", "top_k", "min_tokens"):
            setattr(self, name, _as_int(name, getattr(self, name)))
        for name in ("max_tokens", "prompt_logprobs", "stream_interval"):
            value = getattr(self, name)
            setattr(self, name, None if value is None else _as_int(name, value))
        # vLLM accepts logprobs=True as "1 top logprob".
        if self.logprobs is True:
            self.logprobs = 1
        elif self.logprobs is not None:
            self.logprobs = _as_int("logprobs", self.logprobs)
        for name in (
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "temperature",
            "top_p",
            "min_p",
        ):
            setattr(self, name, _as_float(name, getattr(self, name)))
        for name in (
            "ignore_eos",
            "detokenize",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}.")
        if self.extra_args is not None and not (
            isinstance(self.extra_args, dict) and all(isinstance(k, str) for k in self.extra_args)
        ):
            raise ValueError(
                f"extra_args must be a dict with string keys, got {self.extra_args!r}."
            )
        try:
            self.repetition_detection = RepetitionDetectionParams.of(self.repetition_detection)
        except ValueError as error:
            raise FieldError(
                str(error), "repetition_detection", self.repetition_detection
            ) from None
        self.thinking_token_budget = _thinking_token_budget(self.thinking_token_budget)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}.")

        if self.seed is not None:
            self.seed = _as_int("seed", self.seed)
            if self.seed == -1:
                self.seed = None
            elif not _INT64_MIN <= self.seed <= _INT64_MAX:
                raise ValueError(f"seed must fit in a signed 64-bit integer, got {self.seed}.")

        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}.")

        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)) and all(
            _is_int(t) for t in self.stop_token_ids
        ):
            self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))
        else:
            raise ValueError(
                f"stop_token_ids must contain only integers, got {self.stop_token_ids!r}."
            )

        if self.logit_bias is not None:
            self.logit_bias = _normalize_logit_bias(self.logit_bias)

        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not all(_is_int(t) for t in ids):
                raise ValueError(f"allowed_token_ids must be a list of integers, got {ids!r}.")
            if not ids:
                raise ValueError("allowed_token_ids is not None and empty!")
            if any(t < 0 for t in ids):
                raise ValueError(f"allowed_token_ids must be non-negative, got {list(ids)}.")
            self.allowed_token_ids = list(ids)

        if self.logprob_token_ids is not None:
            self._verify_logprob_token_ids()

        if self.bad_words is not None:
            words = self.bad_words
            if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
                raise ValueError(f"bad_words must be a list of strings, got {words!r}.")
            if not all(words):
                raise ValueError(
                    f"bad_words cannot contain an empty string. Got bad_words={list(words)}"
                )
            self.bad_words = list(dict.fromkeys(words)) or None

        if isinstance(self.structured_outputs, Mapping):
            self.structured_outputs = StructuredOutputsParams.from_dict(
                dict(self.structured_outputs)
            )
        if self.reasoning_end is not None and not (
            isinstance(self.reasoning_end, str) and self.reasoning_end
        ):
            raise ValueError(
                f"reasoning_end must be a non-empty string, got {self.reasoning_end!r}."
            )
        if not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams, got "
                f"{self.structured_outputs!r}."
            )

    def _verify_args(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not math.isfinite(self.repetition_penalty):
            raise ValueError(
                f"repetition_penalty must be a finite number, got {self.repetition_penalty}."
            )
        if self.repetition_penalty <= 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}."
            )
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if self.temperature > 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.stream_interval is not None and self.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {self.stream_interval}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(
                f"min_tokens must be greater than or equal to 0, got {self.min_tokens}."
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}."
            )
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}.")
        if any(not s for s in self.stop):
            raise ValueError("stop cannot contain an empty string.")
        if self.stop and not self.detokenize:
            raise ValueError(
                "stop strings are only supported when detokenize is True. "
                "Set detokenize=True to use stop."
            )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_int(name: str, value: Any) -> int:
    """`value` as an int; a float is accepted only when it is whole (16.0, as JSON may send)."""
    if _is_int(value):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ValueError(f"{name} must be an integer, got {value!r}.")


def _as_float(name: str, value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}.")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}.")
    return value


def _normalize_logit_bias(logit_bias: Any) -> dict[int, float]:
    if not isinstance(logit_bias, Mapping):
        raise ValueError(f"logit_bias must be a mapping of token id to bias, got {logit_bias!r}.")
    invalid_keys = []
    normalized: dict[int, float] = {}
    for key, bias in logit_bias.items():
        try:
            token_id = key if _is_int(key) else int(key)
        except (TypeError, ValueError):
            invalid_keys.append(key)
            continue
        if isinstance(key, float):
            invalid_keys.append(key)
            continue
        if token_id < 0:
            raise ValueError(f"logit_bias token ids must be non-negative, got {key!r}.")
        if not isinstance(bias, (int, float)) or isinstance(bias, bool) or math.isnan(bias):
            raise ValueError(f"logit_bias values must be numbers, got {bias!r} for token {key!r}.")
        normalized[token_id] = min(_MAX_ABS_LOGIT_BIAS, max(-_MAX_ABS_LOGIT_BIAS, float(bias)))
    if invalid_keys:
        raise ValueError(
            "logit_bias contains key(s) that cannot be converted to integer token IDs: "
            f"{invalid_keys!r}"
        )
    return normalized


def _thinking_token_budget(value: Any) -> int | None:
    """vLLM's rule: a non-negative integer (not a float, not a bool), -1 for no budget."""
    if value is None:
        return None
    if not _is_int(value) or value < -1:
        raise FieldError(
            "`thinking_token_budget` must be a non-negative integer or -1 for unlimited.",
            "thinking_token_budget",
            value,
        )
    return None if value == -1 else value


_DEFAULTS = SamplingParams()
