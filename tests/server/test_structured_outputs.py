"""Structured outputs over real HTTP with the official `openai` client, on the default model.

The three spellings of a constraint (OpenAI's response_format, vLLM's structured_outputs,
the older guided_* fields) on both routes, streamed and not; every JSON output validates
against its schema (`jsonschema`). A constraint that cannot be compiled is a 400 naming the
field the request used, decided before the request is admitted.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.engine.structured_outputs.schemas import SCHEMAS, messages_for
from tests.server.conftest import MODEL
from tests.server.openai_helpers import client, post


@pytest.fixture(scope="module")
def api(openai_server) -> openai.OpenAI:
    api = client(openai_server)
    api.model_name = MODEL
    return api


def model(api: openai.OpenAI) -> str:
    return api.model_name


@pytest.mark.parametrize("name", ["nested", "bounds"])
def test_response_format_json_schema_validates_streamed_and_not(api, name):
    schema = SCHEMAS[name]
    request = dict(
        model=model(api),
        messages=messages_for(schema),
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
        max_tokens=160,
        temperature=0.9,
        seed=3,
    )
    reply = api.chat.completions.create(n=2, **request)
    assert len(reply.choices) == 2
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)
    stream = api.chat.completions.create(stream=True, **request)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), schema)


def test_guided_and_structured_outputs_fields_on_completions(api):
    phone = api.completions.create(
        model=model(api),
        prompt="My phone number is",
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"regex": r" \d{3}-\d{4}"}},
    )
    assert re.fullmatch(r" \d{3}-\d{4}", phone.choices[0].text)
    choice = api.completions.create(
        model=model(api),
        prompt="Is water wet?",
        max_tokens=5,
        stream=True,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert "".join(c.choices[0].text for c in choice) in ("yes", "no")
    schema = SCHEMAS["enum"]
    answer = api.chat.completions.create(
        model=model(api),
        messages=messages_for(schema),
        max_tokens=40,
        extra_body={"guided_json": schema, "guided_decoding_backend": "guidance"},
    )
    jsonschema.validate(json.loads(answer.choices[0].message.content), schema)


def test_json_object_parses(api):
    reply = api.chat.completions.create(
        model=model(api),
        messages=[{"role": "user", "content": 'Reply with the JSON {"ok": true}.'}],
        response_format={"type": "json_object"},
        max_tokens=40,
        temperature=0,
    )
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_a_structural_tag_as_response_format_streamed_and_not(api):
    """xgrammar's form, as vLLM takes it in response_format: fixed text, then one tag."""
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": "Answer: "},
                {"type": "tag", "begin": "<n>", "end": "</n>",
                 "content": {"type": "regex", "pattern": "[0-9]{1,3}"}},
            ],
        },
    }  # fmt: skip
    request = dict(
        model=model(api),
        messages=[{"role": "user", "content": "How many legs has a spider?"}],
        response_format=tag,
        max_tokens=20,
    )
    reply = api.chat.completions.create(**request)
    assert re.fullmatch(r"Answer: <n>[0-9]{1,3}</n>", reply.choices[0].message.content)
    assert reply.choices[0].finish_reason == "stop"
    stream = api.chat.completions.create(stream=True, **request)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert re.fullmatch(r"Answer: <n>[0-9]{1,3}</n>", text)


@pytest.mark.parametrize("backend", ["guidance", "xgrammar"])
def test_a_structural_tag_of_the_trigger_form_in_structured_outputs(api, backend):
    """A call the model makes validates; text without one is left free."""
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"]}
    tag = {"structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}], "triggers": ["<f>"]}
    reply = api.completions.create(
        model=model(api),
        prompt="Call the tool f: <f>",
        max_tokens=24,
        seed=1,
        temperature=1.0,
        extra_body={"structured_outputs": {"structural_tag": json.dumps(tag)},
                    "guided_decoding_backend": backend},
    )  # fmt: skip
    text = reply.choices[0].text
    calls = re.findall(r"<f>(.*?)</f>", text, re.DOTALL)
    opened = text.count("<f>")
    assert opened == len(calls) or (
        opened == len(calls) + 1 and reply.choices[0].finish_reason == "length"
    )
    for content in calls:
        jsonschema.validate(json.loads(content), schema)


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "strin"}},
                }
            },
            "response_format",
            "strin",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "'json_schema' field"),
        ({"response_format": {"type": "structural_tag"}}, "response_format", '"structures"'),
        (
            {"response_format": {"type": "structural_tag", "format": {"type": "nope"}}},
            "response_format",
            "cannot be compiled by xgrammar",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", "must be one of"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            "exactly one",
        ),
        (
            {"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}},
            "structured_outputs",
            "uniqueItems",
        ),
        ({"guided_regex": "(a"}, "guided_regex", "unclosed group"),
        ({"guided_grammar": "start: nowhere"}, "guided_grammar", "nowhere"),
        (
            {"guided_json": {"type": "object"}, "guided_regex": "a"},
            "guided_json",
            "one structured-output",
        ),
        (
            {"guided_choice": ["a"], "guided_decoding_backend": "lm-format-enforcer"},
            "guided_decoding_backend",
            "lm-format-enforcer",
        ),
        ({"guided_choice": "a"}, "guided_choice", "array"),
    ],
)
def test_a_bad_constraint_is_a_400_naming_its_field(openai_server, fields, param, message):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    reply = post(openai_server, "/v1/chat/completions", body)
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert error["param"] == param
    assert message in error["message"]
