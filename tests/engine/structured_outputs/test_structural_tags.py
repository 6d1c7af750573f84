"""Structural tags in both of vLLM's forms, on every backend that takes them.

Outputs are drawn by random walks through the matcher (walks.py) and read back
independently: each tagged part is cut out by a regex and its content validated by
`jsonschema`; the text around the tags is left free.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from aioserve.engine.admission import InvalidRequest
from aioserve.engine.structured_outputs import StructuredOutputsParams as Constraint
from aioserve.engine.structured_outputs.structural_tags import read_structural_tag
from tests.engine.structured_outputs.walks import random_walk

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TRIGGER_FORM = {
    "structures": [
        {"begin": "<function=weather>", "schema": WEATHER, "end": "</function>"},
        {"begin": "<function=time>", "schema": {"enum": ["utc", "local"]}, "end": "</function>"},
    ],
    "triggers": ["<function="],
}
CALL = re.compile(r"<function=(weather|time)>(.*?)</function>", re.DOTALL)
# xgrammar's form: a fixed opening, then one tagged call that must come.
FORCED_CALL = {
    "type": "structural_tag",
    "format": {
        "type": "sequence",
        "elements": [
            {"type": "const_string", "value": "Calling: "},
            {
                "type": "tag",
                "begin": "<call>",
                "content": {"type": "json_schema", "json_schema": WEATHER},
                "end": "</call>",
            },
        ],
    },
}


def check_calls(text: str) -> int:
    """How many calls `text` makes, each checked: every trigger opens a call, and every
    call's content validates against its structure's schema."""
    calls = CALL.findall(text)
    assert text.count("<function=") == len(calls), text
    for name, content in calls:
        schema = TRIGGER_FORM["structures"][0 if name == "weather" else 1]["schema"]
        jsonschema.validate(json.loads(content), schema)
    return len(calls)


@pytest.mark.parametrize("backend", ["auto", "xgrammar", "guidance"])
def test_the_trigger_form_holds_every_call_to_its_schema(compiler, tokenizer, backend):
    constraint = Constraint(structural_tag=json.dumps(TRIGGER_FORM), backend=backend)
    calls = 0
    for seed in range(4):
        prefix = "Let me check. <function="
        text = random_walk(compiler, tokenizer, constraint, seed, prefix=prefix, skip_blanks=True)
        assert text.startswith("Let me check. <function=")
        calls += check_calls(text)
    assert calls >= 4  # the prefix's trigger opened a call in every walk
    # Free text ends anywhere, and needs no call.
    text = random_walk(compiler, tokenizer, constraint, 0, prefix="No tools", skip_blanks=True)
    assert check_calls(text) == 0


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_a_trigger_must_go_on_as_a_structure(compiler, tokenizer, backend):
    constraint = Constraint(structural_tag=json.dumps(TRIGGER_FORM), backend=backend)
    with pytest.raises(AssertionError, match="masked"):
        random_walk(compiler, tokenizer, constraint, 0, prefix="<function=search>")
    with pytest.raises(AssertionError, match="masked"):
        random_walk(compiler, tokenizer, constraint, 0, prefix='<function=weather>{"city": 3')


def test_a_special_token_opens_and_closes_a_structure_as_one_token(compiler, tokenizer):
    """SmolLM2's `<filename>` and `<file_sep>` are special tokens: guidance matches them as
    tokens (text never spells a special token), so the model can write them as it learnt."""
    tag = {
        "structures": [{"begin": "<filename>", "schema": WEATHER, "end": "<file_sep>"}],
        "triggers": ["<filename>"],
    }
    constraint = Constraint(structural_tag=tag, backend="guidance")
    opening = tokenizer.convert_tokens_to_ids("<filename>")
    assert tokenizer.encode("See <filename>", add_special_tokens=False)[-1] == opening
    for seed in range(3):
        text = random_walk(compiler, tokenizer, constraint, seed, prefix="See <filename>")
        calls = re.findall(r"<filename>(.*?)<file_sep>", text, re.DOTALL)
        assert calls and text.count("<filename>") == len(calls), text
        for content in calls:
            jsonschema.validate(json.loads(content), WEATHER)


@pytest.mark.parametrize("seed", range(3))
def test_xgrammars_form_forces_its_tag(compiler, tokenizer, seed):
    constraint = Constraint(structural_tag=FORCED_CALL)
    text = random_walk(compiler, tokenizer, constraint, seed, skip_blanks=True)
    match = re.fullmatch(r"Calling: <call>(.*)</call>", text, re.DOTALL)
    assert match, text
    jsonschema.validate(json.loads(match.group(1)), WEATHER)


def test_the_two_spellings_of_a_tag_compile_once(compiler):
    as_text = Constraint(structural_tag=json.dumps(FORCED_CALL, indent=2))
    assert compiler.compile(as_text) is compiler.compile(Constraint(structural_tag=FORCED_CALL))


@pytest.mark.parametrize(
    ("tag", "message"),
    [
        ("", "cannot be an empty string"),
        ("{oops", "not valid JSON"),
        ("[]", "must be a JSON object"),
        ({"triggers": ["<f"]}, '"structures" and "triggers"'),
        ({"structures": [], "triggers": ["<f"]}, "non-empty list"),
        ({"structures": [{"begin": "<f>", "end": "</f>"}], "triggers": ["<f"]}, '"schema"'),
        ({"structures": [{"begin": "<g>", "schema": {}, "end": ""}], "triggers": ["<f"]},
         "none of the triggers"),
        ({"structures": [{"begin": "<f>", "schema": {}, "end": ""}], "triggers": [""]},
         "non-empty strings"),
        ({"type": "other", "format": {}}, '"type" must be "structural_tag"'),
    ],
)  # fmt: skip
def test_a_malformed_tag_is_refused_before_it_compiles(tag, message):
    with pytest.raises(ValueError, match=message):
        read_structural_tag(tag)
    with pytest.raises(ValueError, match=message):
        Constraint(structural_tag=tag)


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (Constraint(structural_tag={"format": {"type": "nope"}}), "cannot be compiled by xgrammar"),
        (Constraint(structural_tag=FORCED_CALL, backend="guidance"), '"format" form'),
        (Constraint(structural_tag=json.dumps(TRIGGER_FORM), backend="outlines"),
         "outlines backend does not enforce structural tags"),
    ],
)  # fmt: skip
def test_a_tag_a_backend_cannot_read_is_refused_naming_the_field(compiler, constraint, message):
    with pytest.raises(InvalidRequest, match=message) as caught:
        compiler.compile(constraint)
    assert caught.value.param == "structured_outputs.structural_tag"
