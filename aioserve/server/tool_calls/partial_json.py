"""Reading JSON that is still being generated: where a value ends, if it has ended yet.

Tool calls are streamed as the raw text of their arguments, cut into pieces as it arrives:
every piece is a prefix extension of the last, and the pieces join to the complete value
exactly as the model wrote it, so no partial-JSON re-serialising (and none of its diffing
errors) is needed. These functions find the spans: `value_end` where a value ends,
`object_members` the members of an object seen so far, with their spans.
`canonical_prefix` is for the formats whose arguments vLLM re-serialises
(`json.dumps(..., ensure_ascii=False)`): the part of that serialisation a value's text so far
already fixes, so that the pieces still only grow and join to the re-serialised value.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WHITESPACE = " \t\n\r"
_CLOSING = {"{": "}", "[": "]"}


def skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def string_end(text: str, pos: int) -> int | None:
    """The index after the JSON string starting at text[pos] == '"' (None: unfinished)."""
    pos += 1
    while pos < len(text):
        char = text[pos]
        if char == "\\":
            pos += 2
            continue
        if char == '"':
            return pos + 1
        pos += 1
    return None


def value_end(text: str, pos: int) -> int | None:
    """The index after the JSON value starting at text[pos] (None: unfinished). A number
    or literal at the very end of the text is unfinished: more digits may follow."""
    if pos >= len(text):
        return None
    char = text[pos]
    if char == '"':
        return string_end(text, pos)
    if char in _CLOSING:
        expected = [_CLOSING[char]]
        pos += 1
        while pos < len(text):
            char = text[pos]
            if char == '"':
                end = string_end(text, pos)
                if end is None:
                    return None
                pos = end
                continue
            if char in _CLOSING:
                expected.append(_CLOSING[char])
            elif char in "}]":
                if char != expected.pop():
                    raise ValueError(f"mismatched {char!r} at {pos}")
                if not expected:
                    return pos + 1
            pos += 1
        return None
    while pos < len(text) and text[pos] not in ",}] \t\n\r":
        pos += 1
    return pos if pos < len(text) else None


@dataclass
class Member:
    start: int  # where its value starts
    end: int | None  # after its value; None while unfinished


def object_members(text: str, pos: int) -> tuple[dict[str, Member], int | None]:
    """The members of the JSON object starting at text[pos] == '{' seen so far, and the
    index after its closing brace (None while it is open). ValueError for text that
    cannot become a JSON object."""
    members: dict[str, Member] = {}
    pos = skip_whitespace(text, pos + 1)
    while pos < len(text):
        if text[pos] == "}":
            return members, pos + 1
        if text[pos] != '"':
            raise ValueError(f"expected a key at {pos}")
        key_end = string_end(text, pos)
        if key_end is None:
            break
        key = json.loads(text[pos:key_end])
        pos = skip_whitespace(text, key_end)
        if pos >= len(text):
            break
        if text[pos] != ":":
            raise ValueError(f"expected ':' at {pos}")
        pos = skip_whitespace(text, pos + 1)
        if pos >= len(text):
            break
        end = value_end(text, pos)
        members[key] = Member(pos, end)
        if end is None:
            break
        pos = skip_whitespace(text, end)
        if pos < len(text) and text[pos] == ",":
            pos = skip_whitespace(text, pos + 1)
    return members, None


def canonical_prefix(text: str, complete: bool = False) -> str:
    """The start of `json.dumps(json.loads(value), ensure_ascii=False)` that the text of a
    JSON value so far already fixes (all of it once `complete`): containers, keys and
    strings as they arrive, numbers and literals once they end."""
    out: list[str] = []
    depth = 0
    pos = 0
    while True:
        pos = skip_whitespace(text, pos)
        if pos >= len(text):
            break
        char = text[pos]
        if char in "{[" or char in "}]":
            depth += 1 if char in "{[" else -1
            out.append(char)
            pos += 1
        elif char in ",:":
            out.append(char + " ")
            pos += 1
        elif char == '"':
            end = string_end(text, pos)
            if end is None:
                out.append(_string_prefix(text[pos + 1 :]))
                break
            out.append(_dumps(text[pos:end]))
            pos = end
        else:
            end = pos
            while end < len(text) and text[end] not in ",:}] \t\n\r":
                end += 1
            if end == len(text) and not complete:
                break  # more digits may follow
            try:
                out.append(_dumps(text[pos:end]))
            except ValueError:
                break
            pos = end
        if depth <= 0:
            break
    return "".join(out)


def _dumps(value_text: str) -> str:
    return json.dumps(json.loads(value_text), ensure_ascii=False)


def _string_prefix(raw: str) -> str:
    """The serialised start of an unfinished string (the text after its opening quote),
    up to its last complete character."""
    cut = 0
    pos = 0
    while pos < len(raw):
        if raw[pos] != "\\":
            pos += 1
            cut = pos
            continue
        size = 6 if raw[pos + 1 : pos + 2] == "u" else 2
        if pos + size > len(raw):
            break
        if size == 6 and 0xD800 <= int(raw[pos + 2 : pos + 6], 16) <= 0xDBFF:
            # A surrogate pair's first half: its character needs the second.
            if pos + 12 > len(raw):
                break
            size = 12
        pos += size
        cut = pos
    try:
        return _dumps(f'"{raw[:cut]}"')[:-1]
    except ValueError:
        return '"'
