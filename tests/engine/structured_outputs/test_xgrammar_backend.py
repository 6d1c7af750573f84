"""The xgrammar backend: every kind of constraint through it, read back independently
(`re.fullmatch`, `jsonschema`, `lark`), vLLM's whitespace settings, and what it refuses."""

from __future__ import annotations

import json
import re

import jsonschema
import lark
import pytest

from aioserve.engine.admission import InvalidRequest
from aioserve.engine.structured_outputs import StructuredOutputsParams as Constraint
from aioserve.engine.structured_outputs.compiler import StructuredOutputCompiler
from aioserve.engine.structured_outputs.json_schemas import keyword_xgrammar_ignores
from aioserve.engine.structured_outputs.params import StructuredOutputsConfig
from aioserve.engine.structured_outputs.xgrammar_backend import XgrammarGrammar, is_lark
from tests.engine.structured_outputs.walks import VOCAB, random_walk

ORDER = {
    "type": "object",
    "properties": {
        "item": {"type": "string", "maxLength": 6},
        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
        "rush": {"type": "boolean"},
    },
    "required": ["item", "qty"],
}
LARK_SQL = 'start: "SELECT " NAME " FROM " NAME ";"\nNAME: /[a-z]{1,6}/'
EBNF_SUM = 'root ::= num (" + " num)*\nnum ::= [1-9] [0-9]?'
CHOICES = ["yes", 'say "no"', "back\\slash", "tab\there"]


def xgrammar(**constraint) -> Constraint:
    return Constraint(**constraint, backend="xgrammar")


def _valid(schema):
    return lambda text: jsonschema.validate(json.loads(text), schema) or True


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    ("constraint", "check"),
    [
        (xgrammar(json=ORDER), _valid(ORDER)),
        (xgrammar(regex=r"[0-9]{3}-[a-z]{2}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
        (xgrammar(choice=CHOICES), lambda t: t in CHOICES),
        (xgrammar(grammar=LARK_SQL), lambda t: lark.Lark(LARK_SQL).parse(t)),
        (xgrammar(grammar=EBNF_SUM), lambda t: re.fullmatch(r"[1-9][0-9]?( \+ [1-9][0-9]?)*", t)),
    ],
    ids=["json", "regex", "choice", "lark", "ebnf"],
)
def test_random_walks_satisfy_the_constraint(compiler, tokenizer, constraint, check, seed):
    text = random_walk(compiler, tokenizer, constraint, seed, skip_blanks=True)
    assert check(text), text


def test_extra_properties_are_refused_where_a_schema_is_silent(compiler, tokenizer):
    """xgrammar's strict mode, which vLLM keeps: only the listed properties."""
    for seed in range(4):
        text = random_walk(compiler, tokenizer, xgrammar(json=ORDER), seed, skip_blanks=True)
        assert set(json.loads(text)) <= set(ORDER["properties"]), text


def test_disable_any_whitespace_writes_compact_json(tokenizer):
    compact = StructuredOutputCompiler(
        tokenizer, VOCAB, StructuredOutputsConfig(disable_any_whitespace=True)
    )
    for seed in range(3):
        text = random_walk(compact, tokenizer, xgrammar(json=ORDER), seed)
        assert json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False) == text


def test_json_object_takes_any_object_and_nothing_else(compiler, tokenizer):
    """(A random walk through any object's keys would not end: the object is given.)"""
    constraint = xgrammar(json_object=True)
    text = random_walk(compiler, tokenizer, constraint, 0, prefix='{"ok": [1, {"a": null}]}')
    assert json.loads(text) == {"ok": [1, {"a": None}]}
    with pytest.raises(AssertionError, match="masked"):
        random_walk(compiler, tokenizer, constraint, 0, prefix="[1]")


def test_a_named_backend_is_used_for_every_kind(compiler):
    for constraint in (xgrammar(json=ORDER), xgrammar(regex="a+"), xgrammar(grammar=EBNF_SUM)):
        assert isinstance(compiler.compile(constraint), XgrammarGrammar)


@pytest.mark.parametrize(
    ("schema", "found"),
    [
        ({"type": "number", "multipleOf": 2}, "multipleOf"),
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "string", "format": "color"}, "format 'color'"),
        ({"type": "string", "pattern": "a+", "maxLength": 3}, "minLength/maxLength"),
        ({"type": "object", "propertyNames": {"maxLength": 2}, "properties": {}}, "propertyNames"),
        ({"type": "object", "patternProperties": {"a": {}, "b": {}}}, "patternProperties"),
        ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "allOf"),
        ({"properties": {"deep": {"type": "integer", "multipleOf": 3}}}, "multipleOf"),
        ({"type": "string", "format": "date", "pattern": "x"}, None),
        ({"type": "integer", "minimum": 3}, None),
    ],
)
def test_what_xgrammar_would_let_through_is_found(schema, found):
    said = keyword_xgrammar_ignores(schema)
    assert said == found if found is None else found in said


@pytest.mark.parametrize(
    ("constraint", "param", "message"),
    [
        (xgrammar(json={"type": "array", "uniqueItems": True}), "structured_outputs.json",
         "does not enforce uniqueItems"),
        (xgrammar(json={"type": "strin"}), "structured_outputs.json", "cannot be compiled by xgrammar"),
        (xgrammar(grammar="root ::= nowhere"), "structured_outputs.grammar", "nowhere"),
        (xgrammar(regex="(a"), "structured_outputs.regex", "cannot be compiled by xgrammar"),
        (xgrammar(regex="a\x00"), "structured_outputs.regex", "NUL"),
        (xgrammar(json=ORDER, whitespace_pattern=" "), "structured_outputs.whitespace_pattern",
         "does not take whitespace_pattern"),
    ],
)  # fmt: skip
def test_a_constraint_xgrammar_refuses_names_its_field(compiler, constraint, param, message):
    with pytest.raises(InvalidRequest, match=message) as caught:
        compiler.compile(constraint)
    assert caught.value.param == param


def test_lark_is_told_from_ebnf_as_vllm_tells_them():
    assert is_lark(LARK_SQL)
    assert not is_lark(EBNF_SUM)
    assert is_lark('start: "a"  # root ::= "b" in a comment')
