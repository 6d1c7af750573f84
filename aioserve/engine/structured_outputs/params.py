"""StructuredOutputsParams: the constraint one request's output must follow (vLLM's fields).

Exactly one constraint is set: `json` (a JSON schema, as a dict or its JSON text), `regex`,
`choice` (a list of strings; the output is one of them), `grammar` (Lark, or the GBNF/EBNF
that vLLM's examples use), `json_object` (any JSON object) or `structural_tag` (free text
with tagged parts held to schemas, structural_tags.py; a JSON text). The options shape it:
`disable_any_whitespace` (no whitespace at all between JSON's tokens),
`disable_additional_properties` (objects take only the properties their schema lists) and
`whitespace_pattern` (the regex of the whitespace JSON may have between its tokens; by
default at most one space, compiler.py).

`StructuredOutputsParams.kind_and_spec()` is the constraint as (kind, canonical text): the
compiler's cache key, so that two requests with the same schema share one compiled guide.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from aioserve.config.engine import DecodingConfig
from aioserve.engine.structured_outputs.json_schemas import parse_schema
from aioserve.engine.structured_outputs.structural_tags import read_structural_tag

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    backend: str | None = None
    """The backend for this request (its `guided_decoding_backend`); None: the server's."""

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) is not None]
        if len(given) != 1:
            raise ValueError(
                "structured outputs take exactly one constraint of json, regex, choice, "
                f"grammar, json_object and structural_tag; got {len(given)}"
                + (f" ({', '.join(given)})" if given else "")
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(
                f"json must be a JSON schema (an object or its text), got {self.json!r}"
            )
        if isinstance(self.json, str):
            parse_schema(self.json)
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string, got {value!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError(f"choice must be a non-empty list of strings, got {self.choice!r}")
            # vLLM turns each choice into text; numbers and booleans are common in clients.
            self.choice = [c if isinstance(c, str) else json.dumps(c) for c in self.choice]
        if self.structural_tag is not None:
            read_structural_tag(self.structural_tag)
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"json_object must be true when given, got {self.json_object!r}")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) is not None)

    def kind_and_spec(self) -> tuple[str, str]:
        """(kind, the constraint as compact text). A schema keeps its keys' order: an
        object's properties are written in the order its schema lists them, as in vLLM."""
        kind = self.kind
        if kind == "json":
            schema = parse_schema(self.json) if isinstance(self.json, str) else self.json
            return kind, json.dumps(schema, separators=(",", ":"))
        if kind == "choice":
            return kind, json.dumps(self.choice)
        if kind == "json_object":
            return kind, ""
        if kind == "structural_tag":
            return kind, json.dumps(read_structural_tag(self.structural_tag), separators=(",", ":"))
        return kind, getattr(self, kind)

    @classmethod
    def from_dict(cls, data: Any) -> StructuredOutputsParams:
        """From a request body's `structured_outputs` object; unknown keys are refused."""
        if not isinstance(data, dict):
            raise ValueError(f"structured_outputs must be an object, got {data!r}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(str(key) for key in data if key not in known)
        if unknown:
            raise ValueError(f"unknown structured_outputs field(s): {', '.join(unknown)}")
        return cls(**{key: value for key, value in data.items() if value is not None})


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """The server's defaults (--structured-outputs-config and the --guided-decoding-* flags)."""

    backend: str = "auto"
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    enable_in_reasoning: bool = False
    """Constrain the reasoning too, from the first token (by default a constraint starts
    after the reasoning parser's end marker)."""

    @classmethod
    def from_decoding(cls, decoding: DecodingConfig) -> StructuredOutputsConfig:
        """The --guided-decoding-* settings, overridden by --structured-outputs-config's keys."""
        settings = {
            "backend": decoding.guided_decoding_backend,
            "disable_fallback": decoding.guided_decoding_disable_fallback,
            "disable_any_whitespace": decoding.guided_decoding_disable_any_whitespace,
            "disable_additional_properties": decoding.guided_decoding_disable_additional_properties,
        }
        return cls(**{**settings, **decoding.structured_outputs_config})


GuidedDecodingParams = StructuredOutputsParams
"""vLLM's older name, as `SamplingParams(guided_decoding=GuidedDecodingParams(json=...))`."""
