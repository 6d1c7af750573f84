"""The structured-output fields of a completions or chat body, as one StructuredOutputsParams.

Three spellings reach the same constraint:

- OpenAI's `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`,
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`, and vLLM's
  `{"type": "structural_tag", ...}` (either form of structural_tags.py, the object being
  the tag);
- vLLM's `structured_outputs` object (json, regex, choice, grammar, json_object,
  structural_tag and the options), which `response_format` overrides as in vLLM;
- the older top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`,
  with `guided_whitespace_pattern` and `guided_decoding_backend`. vLLM 0.32 ignores these
  (with a warning); aioserve honours them, as the vLLM versions that defined them did.

Errors, here and from the engine's compiler, name the field the request used.
"""

from __future__ import annotations

from typing import Any

from aioserve.engine.admission import InvalidRequest
from aioserve.engine.async_engine import AsyncEngine
from aioserve.engine.sampling_params import SamplingParams
from aioserve.engine.structured_outputs import StructuredOutputsParams
from aioserve.engine.structured_outputs.params import KINDS
from aioserve.server.body_fields import BodyFields, shown_value
from aioserve.server.errors import bad_parameter

GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_RESPONSE_FORMATS = ("text", "json_object", "json_schema", "structural_tag")


def read_structured_outputs(fields: BodyFields) -> tuple[StructuredOutputsParams | None, str]:
    """(the body's constraint or None, the field it came from, for errors)."""
    given = fields.get("structured_outputs")
    whitespace = fields.get("guided_whitespace_pattern")
    guided = {kind: fields.get(name) for name, kind in GUIDED_FIELDS.items()}
    guided = {kind: value for kind, value in guided.items() if value is not None}
    source = "structured_outputs"
    if guided:
        source = next(name for name, kind in GUIDED_FIELDS.items() if kind in guided)
        if given is not None or len(guided) > 1:
            others = [n for n, k in GUIDED_FIELDS.items() if k in guided and n != source]
            others += ["structured_outputs"] if given is not None else []
            raise bad_parameter(
                source, shown_value(guided[GUIDED_FIELDS[source]]),
                f"give one structured-output constraint; {source} comes with {', '.join(others)}",
            )  # fmt: skip
        given = dict(guided)
        if whitespace is not None:
            given["whitespace_pattern"] = whitespace
    backend = fields.get("guided_decoding_backend")
    override = _response_format_constraint(fields.get("response_format"))
    if override is not None:  # it replaces structured_outputs' constraint, keeps its options
        source = "response_format"
        options = {k: v for k, v in (given or {}).items() if k not in KINDS}
        given = options | override
    if given is None:
        return None, source  # a backend alone constrains nothing
    try:
        params = StructuredOutputsParams.from_dict(given)
    except ValueError as error:
        raise bad_parameter(source, shown_value(given), str(error)) from None
    if backend is not None:
        params.backend = backend
    return params, source


def _response_format_constraint(response_format: Any) -> dict[str, Any] | None:
    """The constraint a `response_format` asks for (None for text or none)."""
    field = "response_format"
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind not in _RESPONSE_FORMATS:
        message = f"response_format type must be one of {', '.join(_RESPONSE_FORMATS)}"
        raise bad_parameter(field, shown_value(response_format), message)
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "structural_tag":
        return {"structural_tag": response_format}
    json_schema = response_format.get("json_schema")
    if not isinstance(json_schema, dict):
        raise bad_parameter(
            field,
            shown_value(response_format),
            "When response_format type is 'json_schema', the 'json_schema' field must be provided.",
        )
    schema = json_schema.get("schema")
    if not isinstance(schema, dict):
        raise bad_parameter(
            field,
            shown_value(response_format),
            "response_format.json_schema.schema must be an object",
        )
    return {"json": schema}


async def compile_structured_output(
    engine: AsyncEngine, params: SamplingParams, source: str
) -> None:
    """Compile the request's constraint off the event loop before it is admitted; a 400
    naming `source` when it cannot be."""
    try:
        await engine.compile_structured_output(params)
    except InvalidRequest as error:
        param = body_field(error.param, source)
        raise bad_parameter(param, shown_value(error.value), str(error)) from None


def body_field(engine_param: str, source: str) -> str:
    """The body field to blame for the compiler's InvalidRequest on `engine_param`."""
    return "guided_decoding_backend" if engine_param.endswith(".backend") else source
