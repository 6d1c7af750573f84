"""JSON schemas as the structured-output compiler reads them.

outlines turns a schema into a regex and skips the keywords a regex cannot express
(`minimum`, `multipleOf`, `uniqueItems`, ...): its outputs could then break the schema.
`keyword_outlines_ignores` finds the first keyword outside the set outlines enforces, so
that such a schema goes to guidance (or is refused by name under `outlines`).
xgrammar enforces more, but not everything: `keyword_xgrammar_ignores` finds what it would
let through (the combinations vLLM's xgrammar backend lists), to refuse it by name.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

# Keywords whose meaning outlines' regex enforces, or that constrain nothing. Not allOf:
# outlines writes its schemas one after the other (two objects in a row), not as one.
_OUTLINES_KEYWORDS = frozenset(
    {
        "type", "properties", "required", "additionalProperties", "items", "prefixItems",
        "minItems", "maxItems", "enum", "const", "pattern", "minLength", "maxLength",
        "format", "$ref", "$defs", "definitions", "anyOf",
        "title", "description", "default", "examples", "$schema", "$id", "$comment",
    }
)  # fmt: skip
# Keywords whose value maps names to subschemas, or is one subschema or a list of them.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = (
    "additionalProperties", "items", "prefixItems", "anyOf", "allOf", "oneOf", "not",
    "if", "then", "else", "contains", "propertyNames",
)  # fmt: skip


def parse_schema(spec: str) -> dict[str, Any]:
    """The schema of a JSON text (ValueError unless it is a JSON object)."""
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as error:
        raise ValueError(f"not valid JSON ({error})") from None
    if not isinstance(schema, dict):
        raise ValueError(f"a schema must be a JSON object, got {spec[:80]}")
    return schema


def subschemas(schema: dict[str, Any]) -> list[dict[str, Any]]:
    """The schemas directly inside `schema`."""
    found = []
    for key in _SCHEMA_MAPS:
        value = schema.get(key)
        if isinstance(value, dict):
            found.extend(v for v in value.values() if isinstance(v, dict))
    for key in _SUBSCHEMAS:
        value = schema.get(key)
        if isinstance(value, dict):
            found.append(value)
        elif isinstance(value, list):
            found.extend(v for v in value if isinstance(v, dict))
    return found


def keyword_outlines_ignores(schema: dict[str, Any]) -> str | None:
    """The first keyword of `schema` (or of a schema inside it) that outlines does not enforce."""
    return _first_found(schema, _outlines_gap)


def _outlines_gap(schema: dict[str, Any]) -> str | None:
    return next((key for key in schema if key not in _OUTLINES_KEYWORDS), None)


def _first_found(
    schema: dict[str, Any], find: Callable[[dict[str, Any]], str | None]
) -> str | None:
    """What `find` finds first in `schema`, else in the schemas inside it, depth first."""
    found = find(schema)
    if found is not None:
        return found
    for inner in subschemas(schema):
        found = _first_found(inner, find)
        if found is not None:
            return found
    return None


def forbid_additional_properties(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` (changed in place) with `additionalProperties: false` on every object schema
    that lists its properties and says nothing of others (vLLM's
    disable_additional_properties)."""
    for inner in subschemas(schema):
        forbid_additional_properties(inner)
    if "additionalProperties" not in schema and isinstance(schema.get("properties"), dict):
        schema["additionalProperties"] = False
    return schema


# The string formats xgrammar enforces (its json_schema_converter).
_XGRAMMAR_FORMATS = frozenset(
    {
        "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
        "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
    }
)  # fmt: skip


def keyword_xgrammar_ignores(schema: dict[str, Any]) -> str | None:
    """What of `schema` (or of a schema inside it) xgrammar does not enforce, in words."""
    return _first_found(schema, _xgrammar_gap)


def _xgrammar_gap(schema: dict[str, Any]) -> str | None:
    types = _types(schema)
    if types & {"integer", "number"} and "multipleOf" in schema:
        return "multipleOf"
    if "array" in types:
        for key in ("uniqueItems", "contains", "minContains", "maxContains"):
            if key in schema:
                return key
    if "string" in types:
        if "format" in schema and schema["format"] not in _XGRAMMAR_FORMATS:
            return f"format {schema['format']!r}"
        if _pattern_with_length(schema):
            return "minLength/maxLength with a pattern or format"
    if "object" in types and "propertyNames" in schema:
        names = schema["propertyNames"]
        if (
            (isinstance(names, dict) and _pattern_with_length(names))
            or "patternProperties" in schema
            or "properties" in schema
            or schema.get("unevaluatedProperties", True) is not True
        ):
            return "propertyNames with other property keywords"
    patterns = schema.get("patternProperties")
    if "object" in types and isinstance(patterns, dict):
        if "properties" in schema or len(patterns) > 1:
            return "patternProperties with properties or with another pattern"
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        return "allOf of more than one schema"
    return None


def _types(schema: dict[str, Any]) -> set[str]:
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {item for item in kind if isinstance(item, str)}
    return set()


def _pattern_with_length(schema: dict[str, Any]) -> bool:
    return ("pattern" in schema or "format" in schema) and (
        "minLength" in schema or "maxLength" in schema
    )
