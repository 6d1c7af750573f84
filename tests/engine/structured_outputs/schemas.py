"""A battery of JSON schemas for end-to-end structured-output tests, and a prompt for each.

Strings and arrays have bounds, and objects say `additionalProperties: false`, so that a
135M model's output ends: what is tested is that it validates, not how long it rambles.
"""

from __future__ import annotations

import json

_SHORT = {"type": "string", "maxLength": 12}

SCHEMAS: dict[str, dict] = {
    "nested": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": _SHORT,
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": _SHORT,
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["person"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue", "yellow"]},
                "minItems": 2,
                "maxItems": 3,
            }
        },
        "required": ["colors"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "sure": {"type": "boolean"}},
        "required": ["answer", "sure"],
        "additionalProperties": False,
    },
    "bounds": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            "price": {"type": "number", "minimum": 0, "maximum": 100},
        },
        "required": ["age", "rating", "price"],
        "additionalProperties": False,
    },
    "optional": {
        "type": "object",
        "properties": {"title": _SHORT, "subtitle": _SHORT, "pages": {"type": "integer"}},
        "required": ["title"],
        "additionalProperties": False,
    },
    "ref": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -9, "maximum": 9},
                    "y": {"type": "integer", "minimum": -9, "maximum": 9},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
            "day": {"type": "string", "pattern": "^(mon|tue|wed)$"},
        },
        "required": ["code", "day"],
        "additionalProperties": False,
    },
}


def messages_for(schema: dict) -> list[dict[str, str]]:
    return [
        {
            "role": "user",
            "content": "Reply with one JSON object that follows this JSON schema:\n"
            + json.dumps(schema),
        }
    ]
