"""StructuredOutputsParams (vLLM's checks) and the JSON-schema reading of the compiler."""

from __future__ import annotations

import pytest

from aioserve.engine.sampling_params import SamplingParams
from aioserve.engine.structured_outputs import GuidedDecodingParams, StructuredOutputsParams
from aioserve.engine.structured_outputs.json_schemas import (
    forbid_additional_properties,
    keyword_outlines_ignores,
)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "got 0"),
        ({"regex": "a", "choice": ["a"]}, "got 2 \\(regex, choice\\)"),
        ({"choice": []}, "non-empty"),
        ({"json": 3}, "JSON schema"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": "[1]"}, "must be a JSON object"),
        ({"json_object": False}, "must be true"),
        ({"regex": "a", "disable_any_whitespace": "yes"}, "boolean"),
    ],
)
def test_exactly_one_well_typed_constraint(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)


def test_from_dict_refuses_unknown_keys():
    with pytest.raises(ValueError, match="unknown structured_outputs field"):
        StructuredOutputsParams.from_dict({"regex": "a", "foo": 1})


def test_choices_become_text_and_schemas_keep_their_order():
    assert StructuredOutputsParams(choice=[1, True, "x"]).choice == ["1", "true", "x"]
    a = StructuredOutputsParams(json={"type": "object", "title": "t"})
    b = StructuredOutputsParams(json='{"type": "object",  "title": "t"}')
    assert a.kind_and_spec() == b.kind_and_spec()
    # Properties are written in their schema's order: another order is another constraint.
    c = StructuredOutputsParams(json='{"title": "t", "type": "object"}')
    assert a.kind_and_spec() != c.kind_and_spec()


def test_sampling_params_take_both_names_and_dicts():
    constraint = GuidedDecodingParams(regex="[0-9]+")
    assert SamplingParams(guided_decoding=constraint).structured_outputs is constraint
    from_dict = SamplingParams.from_dict({"structured_outputs": {"choice": ["a", "b"]}})
    assert from_dict.structured_outputs == StructuredOutputsParams(choice=["a", "b"])
    assert from_dict.clone().structured_outputs == from_dict.structured_outputs
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(structured_outputs=constraint, guided_decoding=constraint)


def test_keywords_outlines_ignores_are_found_however_deep():
    assert keyword_outlines_ignores({"type": "string", "pattern": "a"}) is None
    nested = {"properties": {"a": {"items": {"anyOf": [{"type": "integer", "maximum": 3}]}}}}
    assert keyword_outlines_ignores(nested) == "maximum"
    in_defs = {"$defs": {"x": {"type": "array", "uniqueItems": True}}, "$ref": "#/$defs/x"}
    assert keyword_outlines_ignores(in_defs) == "uniqueItems"


def test_forbid_additional_properties_closes_every_listed_object():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {}}}},
        "$defs": {"c": {"properties": {}, "additionalProperties": True}},
    }
    closed = forbid_additional_properties(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["$defs"]["c"]["additionalProperties"] is True  # said explicitly: kept


def test_the_server_settings_merge_with_the_newer_config_winning():
    from aioserve.config.engine import engine_config_from_kwargs
    from aioserve.engine.structured_outputs.params import StructuredOutputsConfig

    config = engine_config_from_kwargs(
        guided_decoding_backend="outlines",
        guided_decoding_disable_any_whitespace=True,
        structured_outputs_config={
            "backend": "guidance", "disable_fallback": True, "enable_in_reasoning": True
        },
    )  # fmt: skip
    assert StructuredOutputsConfig.from_decoding(config.decoding) == StructuredOutputsConfig(
        backend="guidance",
        disable_fallback=True,
        disable_any_whitespace=True,
        enable_in_reasoning=True,
    )
