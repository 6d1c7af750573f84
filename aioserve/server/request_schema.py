"""The fields of a /v1/completions and a /v1/chat/completions body, each declared once.

A `BodyField` is a field's name and the JSON schema of its value. protocol.py reads a body
only through its route's declarations (`BodyFields(body, COMPLETION_BODY).get(name)`: the
type checked is the declared one, and reading an undeclared field is a programming error),
and openapi.py lists the same declarations as the request schemas' properties, so what the
server checks and what /openapi.json says cannot drift apart.

`prompt`, `prompt_embeds` and `messages` are declared for the schema but read by
protocol.py's own code, as their shapes are richer than one JSON type. Fields vLLM defines
that aioserve refuses are not declared: protocol.py names them apart, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
"""vLLM 0.32's accepted `reasoning_effort` values (chat_completion/protocol.py)."""

_STRING = {"type": "string"}
_INTEGER = {"type": "integer"}
_NUMBER = {"type": "number"}
_BOOLEAN = {"type": "boolean"}
_OBJECT = {"type": "object"}
_TOKEN_IDS = {"type": "array", "items": _INTEGER}
_STRINGS = {"type": "array", "items": _STRING}


@dataclass(frozen=True)
class BodyField:
    name: str
    schema: dict[str, Any]

    @property
    def kind(self) -> str:
        """The JSON type a value must have, as BodyFields checks it: "integer", "string or
        array", ... (`null` always reads as the field's default)."""
        if "oneOf" in self.schema:
            return " or ".join(dict.fromkeys(option["type"] for option in self.schema["oneOf"]))
        kind = self.schema["type"]
        if isinstance(kind, list):
            (kind,) = [k for k in kind if k != "null"]
        return kind


def _declare(*fields: BodyField) -> dict[str, BodyField]:
    return {field.name: field for field in fields}


# The SamplingParams fields both routes take under the same name.
SAMPLING_BODY_FIELDS: dict[str, BodyField] = _declare(
    BodyField("n", _INTEGER),
    BodyField("temperature", _NUMBER),
    BodyField("top_p", _NUMBER),
    BodyField("top_k", _INTEGER),
    BodyField("min_p", _NUMBER),
    BodyField("presence_penalty", _NUMBER),
    BodyField("frequency_penalty", _NUMBER),
    BodyField("repetition_penalty", _NUMBER),
    BodyField("seed", _INTEGER),
    BodyField("stop", {"oneOf": [_STRING, _STRINGS]}),
    BodyField("stop_token_ids", _TOKEN_IDS),
    BodyField("include_stop_str_in_output", _BOOLEAN),
    BodyField("ignore_eos", _BOOLEAN),
    BodyField("min_tokens", _INTEGER),
    BodyField("logit_bias", {"type": "object", "additionalProperties": _NUMBER}),
    BodyField("allowed_token_ids", _TOKEN_IDS),
    BodyField("bad_words", _STRINGS),
    BodyField("logprob_token_ids", _TOKEN_IDS),
    BodyField("skip_special_tokens", _BOOLEAN),
    BodyField("stream_interval", {"type": "integer", "minimum": 1}),
    BodyField("thinking_token_budget", _INTEGER),
    BodyField(
        "repetition_detection",
        {
            "type": "object",
            "properties": {
                "max_pattern_size": _INTEGER,
                "min_pattern_size": _INTEGER,
                "min_count": _INTEGER,
            },
        },
    ),
    BodyField("spaces_between_special_tokens", _BOOLEAN),
)

# Structured outputs (structured_output_fields.py): both routes.
_JSON_SCHEMA = {"oneOf": [_STRING, _OBJECT]}
STRUCTURED_OUTPUT_BODY_FIELDS: dict[str, BodyField] = _declare(
    BodyField(
        "response_format",
        {
            "type": "object",
            "required": ["type"],
            "properties": {
                "type": {"enum": ["text", "json_object", "json_schema"]},
                "json_schema": {
                    "type": "object",
                    "required": ["name", "schema"],
                    "properties": {
                        "name": _STRING,
                        "description": _STRING,
                        "schema": _OBJECT,
                        "strict": _BOOLEAN,
                    },
                },
            },
        },
    ),
    BodyField(
        "structured_outputs",
        {
            "type": "object",
            "properties": {
                "json": _JSON_SCHEMA,
                "regex": _STRING,
                "choice": _STRINGS,
                "grammar": _STRING,
                "json_object": _BOOLEAN,
                "disable_any_whitespace": _BOOLEAN,
                "disable_additional_properties": _BOOLEAN,
                "whitespace_pattern": _STRING,
            },
        },
    ),
    BodyField("guided_json", _JSON_SCHEMA),
    BodyField("guided_regex", _STRING),
    BodyField("guided_choice", _STRINGS),
    BodyField("guided_grammar", _STRING),
    BodyField("guided_whitespace_pattern", _STRING),
    BodyField("guided_decoding_backend", _STRING),
)

STREAM_OPTIONS_BODY: dict[str, BodyField] = _declare(
    BodyField("include_usage", _BOOLEAN),
    BodyField("continuous_usage_stats", _BOOLEAN),
)

# How to answer, and who asks: both routes.
_ANSWER_BODY_FIELDS: dict[str, BodyField] = _declare(
    BodyField("model", _STRING),
    BodyField("stream", _BOOLEAN),
    BodyField(
        "stream_options",
        {"type": "object", "properties": {n: f.schema for n, f in STREAM_OPTIONS_BODY.items()}},
    ),
    BodyField("user", _STRING),
    BodyField("priority", _INTEGER),
    BodyField("request_id", _STRING),
    BodyField("return_token_ids", _BOOLEAN),
    BodyField("return_tokens_as_token_ids", {"type": ["boolean", "null"]}),
    BodyField("echo", _BOOLEAN),
)

# The prompt in the engine: its truncation (prompt_truncation.py) and its prefix-cache
# salt. Both routes.
_PROMPT_BODY_FIELDS: dict[str, BodyField] = _declare(
    BodyField("truncate_prompt_tokens", {"type": "integer", "minimum": -1}),
    BodyField("truncation_side", {"type": "string", "enum": ["left", "right"]}),
    BodyField("cache_salt", {"type": "string", "minLength": 1, "maxLength": 128}),
)

# Arguments for custom logits processors (--logits-processors): both routes. vLLM's type:
# each value a string, a number, or a list of those.
_XARG_SCALAR = {"oneOf": [_STRING, _NUMBER]}
XARGS_BODY_FIELD = BodyField(
    "vllm_xargs",
    {
        "type": "object",
        "additionalProperties": {
            "oneOf": [*_XARG_SCALAR["oneOf"], {"type": "array", "items": _XARG_SCALAR}]
        },
    },
)

COMPLETION_BODY: dict[str, BodyField] = _declare(
    BodyField(
        "prompt",
        {"oneOf": [_STRING, _STRINGS, _TOKEN_IDS, {"type": "array", "items": _TOKEN_IDS}]},
    ),
    # Base64 torch.save tensors [tokens, hidden size], with --enable-prompt-embeds.
    BodyField("prompt_embeds", {"oneOf": [_STRING, _STRINGS]}),
    BodyField("max_tokens", {"type": ["integer", "null"]}),
    BodyField("logprobs", {"type": ["integer", "null"]}),
    BodyField("prompt_logprobs", {"type": ["integer", "null"]}),
    *_ANSWER_BODY_FIELDS.values(),
    *_PROMPT_BODY_FIELDS.values(),
    *SAMPLING_BODY_FIELDS.values(),
    *STRUCTURED_OUTPUT_BODY_FIELDS.values(),
    XARGS_BODY_FIELD,
)

CHAT_BODY: dict[str, BodyField] = _declare(
    BodyField(
        "messages",
        {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["role"],
                "properties": {
                    "role": _STRING,
                    "content": {"oneOf": [_STRING, {"type": "array", "items": _OBJECT}]},
                },
            },
        },
    ),
    BodyField("max_tokens", {"type": ["integer", "null"]}),
    BodyField("max_completion_tokens", {"type": ["integer", "null"]}),
    BodyField("logprobs", _BOOLEAN),
    BodyField("top_logprobs", _INTEGER),
    BodyField("prompt_logprobs", {"type": ["integer", "null"]}),
    BodyField("add_generation_prompt", _BOOLEAN),
    BodyField("continue_final_message", _BOOLEAN),
    BodyField("chat_template", _STRING),
    BodyField("chat_template_kwargs", _OBJECT),
    BodyField("documents", {"type": "array", "items": _OBJECT}),
    BodyField("reasoning_effort", {"type": "string", "enum": list(REASONING_EFFORTS)}),
    BodyField("add_special_tokens", _BOOLEAN),
    BodyField(
        "tools",
        {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["function"],
                "properties": {
                    "type": {"const": "function"},
                    "function": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {
                            "name": _STRING,
                            "description": _STRING,
                            "parameters": _OBJECT,
                            "strict": _BOOLEAN,
                        },
                    },
                },
            },
        },
    ),
    BodyField("tool_choice", {"oneOf": [_STRING, _OBJECT]}),
    BodyField("parallel_tool_calls", _BOOLEAN),
    BodyField("include_reasoning", _BOOLEAN),
    BodyField("return_prompt_text", _BOOLEAN),
    *_ANSWER_BODY_FIELDS.values(),
    *_PROMPT_BODY_FIELDS.values(),
    *SAMPLING_BODY_FIELDS.values(),
    *STRUCTURED_OUTPUT_BODY_FIELDS.values(),
    XARGS_BODY_FIELD,
)


def properties(fields: dict[str, BodyField]) -> dict[str, Any]:
    """The fields as a JSON schema's `properties`."""
    return {name: field.schema for name, field in fields.items()}
