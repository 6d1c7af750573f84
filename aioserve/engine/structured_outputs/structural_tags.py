"""Structural tags: free text in which tagged parts are held to a format (vLLM's
`structural_tag`, given as JSON text in `structured_outputs` or as a `response_format`).

vLLM takes two forms, and so does aioserve:

- **The trigger form** (vLLM's first, which it still takes):
  `{"structures": [{"begin": "<function=f>", "schema": {...}, "end": "</function>"}],
  "triggers": ["<function="]}`. The text is free until it writes one of the triggers; from
  there it must continue as one of the structures whose `begin` starts with that trigger —
  its content JSON valid under `schema`, closed by `end` — and then it is free again.
  Every backend but outlines takes it: guidance (as llguidance's lazy trigger lexemes,
  what vLLM's guidance backend makes of it; aioserve's `auto`) and xgrammar (vLLM's
  `auto`).
- **xgrammar's form**: `{"type": "structural_tag", "format": {...}}`, where a format nests
  others (`const_string`, `json_schema`, `regex`, `grammar`, `sequence`, `or`, `tag`,
  `triggered_tags`, `tags_with_separator`, `any_text`, ...). Only xgrammar reads it, as in
  vLLM; xgrammar checks it when it compiles, and its message is the 400's.

`read_structural_tag` checks the shape both forms share here, and the trigger form whole,
so that a malformed tag is refused before it is compiled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TaggedStructure:
    """One structure of the trigger form, with the trigger its `begin` starts with."""

    trigger: str
    begin: str
    schema: dict[str, Any]
    end: str


def read_structural_tag(value: Any) -> dict[str, Any]:
    """The structural tag of `value` (its JSON text, or the object itself); ValueError with
    what is wrong when it is neither form."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("structural_tag cannot be an empty string")
        try:
            tag = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"structural_tag is not valid JSON ({error})") from None
    else:
        tag = value
    if not isinstance(tag, dict):
        raise ValueError(f"structural_tag must be a JSON object, got {str(value)[:80]}")
    if uses_triggers(tag):
        tagged_structures(tag)
    elif not isinstance(tag.get("format"), dict):
        raise ValueError(
            'structural_tag takes "structures" and "triggers", or xgrammar\'s '
            '{"type": "structural_tag", "format": {...}}'
        )
    elif tag.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f'structural_tag\'s "type" must be "structural_tag", got {tag["type"]!r}')
    return tag


def uses_triggers(tag: dict[str, Any]) -> bool:
    """Whether `tag` is of the trigger form (it has "structures")."""
    return "structures" in tag


def tagged_structures(tag: dict[str, Any]) -> list[TaggedStructure]:
    """The trigger form's structures, each with its trigger; ValueError naming the first
    thing that is wrong."""
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(triggers, list) or not triggers:
        raise ValueError('structural_tag needs "triggers", a non-empty list of strings')
    if not all(isinstance(trigger, str) and trigger for trigger in triggers):
        raise ValueError(f"structural_tag's triggers must be non-empty strings, got {triggers}")
    if not isinstance(structures, list) or not structures:
        raise ValueError('structural_tag needs "structures", a non-empty list')
    found = []
    for i, structure in enumerate(structures):
        where = f"structural_tag's structures[{i}]"
        if not isinstance(structure, dict):
            raise ValueError(f"{where} must be an object, got {structure!r}")
        begin, schema, end = structure.get("begin"), structure.get("schema"), structure.get("end")
        if not isinstance(begin, str) or not isinstance(end, str):
            raise ValueError(f'{where} needs "begin" and "end" strings')
        if not isinstance(schema, dict):
            raise ValueError(f'{where} needs "schema", a JSON schema object')
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise ValueError(f"{where}'s begin {begin!r} starts with none of the triggers")
        found.append(TaggedStructure(trigger, begin, schema, end))
    return found
