"""The compiler's backend choice, its errors, its cache, and the matchers of both backends.

The matchers are checked by random walks on the real tokenizer (walks.py): the decoded
text must satisfy the constraint as an independent checker reads it (`re.fullmatch`,
`jsonschema`, `lark`).
"""

from __future__ import annotations

import json
import re

import jsonschema
import lark
import pytest

from aioserve.engine.admission import InvalidRequest
from aioserve.engine.structured_outputs import StructuredOutputsParams as Constraint
from aioserve.engine.structured_outputs.compiler import StructuredOutputCompiler
from aioserve.engine.structured_outputs.matchers import GuidanceGrammar, OutlinesIndex
from aioserve.engine.structured_outputs.params import StructuredOutputsConfig
from tests.engine.structured_outputs.walks import VOCAB, random_walk

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
        "ref": {"$ref": "#/$defs/code"},
    },
    "required": ["name", "tags"],
    "$defs": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"}},
}
BOUNDED = {
    "type": "object",
    "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 30},
        "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    },
    "required": ["age", "score"],
    "additionalProperties": False,
}
SQL = 'start: "SELECT " NAME " FROM " NAME ";"\nNAME: /[a-z]{1,6}/'
# Both parts hold: one object with both properties (outlines wrote two objects in a row).
BOTH = {
    "allOf": [
        {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]},
        {"type": "object", "properties": {"b": {"enum": ["x", "y"]}}, "required": ["b"]},
    ],
    "properties": {"a": True, "b": True},
    "additionalProperties": False,
}
DATE = {"type": "string", "format": "date"}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    ("constraint", "check"),
    [
        (Constraint(regex=r"[0-9]{3}-[a-z]{2}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
        (
            Constraint(choice=["red", "green", "blue (dark)"]),
            lambda t: t in ("red", "green", "blue (dark)"),
        ),
        (Constraint(json=PERSON), lambda t: jsonschema.validate(json.loads(t), PERSON) or True),
        (Constraint(json=BOUNDED), lambda t: jsonschema.validate(json.loads(t), BOUNDED) or True),
        (Constraint(grammar=SQL), lambda t: lark.Lark(SQL).parse(t)),
        # ASCII digits, letters and spaces, as vLLM's xgrammar reads \d, \w, \s.
        (Constraint(regex=r"\d{2}\s\w{2}"), lambda t: re.fullmatch(r"\d{2}\s\w{2}", t, re.ASCII)),
        (
            Constraint(regex=r"\d{2}\s\w{2}", backend="guidance"),
            lambda t: re.fullmatch(r"\d{2}\s\w{2}", t, re.ASCII),
        ),
        (Constraint(json=BOTH), lambda t: jsonschema.validate(json.loads(t), BOTH) or True),
        (
            Constraint(json=DATE),
            lambda t: jsonschema.validate(
                json.loads(t), DATE, format_checker=jsonschema.FormatChecker()
            )
            or t.isascii(),
        ),
    ],
    ids=["regex", "choice", "json-outlines", "json-guidance", "grammar", "regex-ascii",
         "regex-ascii-guidance", "all-of", "date"],
)  # fmt: skip
def test_random_walks_satisfy_the_constraint(compiler, tokenizer, constraint, check, seed):
    text = random_walk(compiler, tokenizer, constraint, seed)
    assert check(text), text


@pytest.mark.parametrize("backend", ["outlines", "guidance"])
def test_properties_come_in_the_schemas_order(compiler, tokenizer, backend):
    """As in vLLM: the object's keys in the order its schema lists them, not sorted."""
    names = ["zeta", "alpha", "mid"]
    schema = {
        "type": "object",
        "properties": {name: {"enum": [1, 2, 3]} for name in names},
        "required": names,
        "additionalProperties": False,
    }
    for seed in range(2):
        text = random_walk(compiler, tokenizer, Constraint(json=schema, backend=backend), seed)
        assert list(json.loads(text)) == names, text


def test_auto_picks_outlines_where_it_enforces_the_schema_and_guidance_elsewhere(compiler):
    assert isinstance(compiler.compile(Constraint(json=PERSON)), OutlinesIndex)
    assert isinstance(compiler.compile(Constraint(regex="a+")), OutlinesIndex)
    assert isinstance(compiler.compile(Constraint(json=BOUNDED)), GuidanceGrammar)
    assert isinstance(compiler.compile(Constraint(grammar=SQL)), GuidanceGrammar)
    assert isinstance(compiler.compile(Constraint(json_object=True)), GuidanceGrammar)
    # outlines would write allOf's parts one after the other: two objects in a row.
    assert isinstance(compiler.compile(Constraint(json={"allOf": BOTH["allOf"]})), GuidanceGrammar)
    forced = Constraint(json=PERSON, backend="guidance")
    assert isinstance(compiler.compile(forced), GuidanceGrammar)


def test_outlines_refuses_a_keyword_it_would_ignore(compiler):
    with pytest.raises(InvalidRequest, match="does not enforce the schema keyword") as caught:
        compiler.compile(Constraint(json=BOUNDED, backend="outlines"))
    assert caught.value.param == "structured_outputs.json"


def test_without_fallback_auto_refuses_what_outlines_cannot_compile(tokenizer):
    strict = StructuredOutputCompiler(
        tokenizer, VOCAB, StructuredOutputsConfig(disable_fallback=True)
    )
    with pytest.raises(InvalidRequest, match="outlines"):
        strict.compile(Constraint(json=BOUNDED))


@pytest.mark.parametrize(
    ("constraint", "param", "message"),
    [
        (Constraint(json={"type": "strin"}), "structured_outputs.json", "strin"),
        (Constraint(regex="(a"), "structured_outputs.regex", "unclosed"),
        (Constraint(grammar="start: foo"), "structured_outputs.grammar", "foo"),
        (Constraint(json={"uniqueItems": True}), "structured_outputs.json", "uniqueItems"),
        (
            Constraint(regex="a", backend="lm-format-enforcer"),
            "structured_outputs.backend",
            "not supported",
        ),
        (Constraint(regex="a", backend="nope"), "structured_outputs.backend", "unknown"),
    ],
)
def test_a_constraint_that_cannot_compile_is_refused_naming_its_field(
    compiler, constraint, param, message
):
    with pytest.raises(InvalidRequest, match=message) as caught:
        compiler.compile(constraint)
    assert caught.value.param == param


def test_the_same_constraint_compiles_once(compiler):
    first = compiler.compile(
        Constraint(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    )
    as_text = '{"type": "object",\n "properties": {"a": {"type": "integer"}}}'
    assert compiler.compile(Constraint(json=as_text)) is first
    spaced = Constraint(json=as_text, disable_any_whitespace=True)
    assert compiler.compile(spaced) is not first


def test_disable_any_whitespace_leaves_no_space(compiler, tokenizer):
    constraint = Constraint(json=PERSON, disable_any_whitespace=True)
    for seed in range(3):
        text = random_walk(compiler, tokenizer, constraint, seed)
        assert json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False) == text
