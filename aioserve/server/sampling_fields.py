"""From a completion or chat body's fields to the request's SamplingParams: the server's
defaults (generation config), the sampling fields both routes share, what the route read
apart (max_tokens, logprobs, structured outputs) and `vllm_xargs`, the arguments of custom
logits processors."""

from __future__ import annotations

from typing import Any

from aioserve.engine.sampling_params import FieldError, RequestOutputKind, SamplingParams
from aioserve.engine.structured_outputs import StructuredOutputsParams
from aioserve.server.body_fields import BodyFields, shown_value
from aioserve.server.errors import APIError, bad_parameter
from aioserve.server.request_schema import SAMPLING_BODY_FIELDS
from aioserve.server.state import ServerState


def sampling_params_of(
    state: ServerState,
    fields: BodyFields,
    max_tokens: int | None,
    max_tokens_field: str,
    logprobs: int | None,
    logprobs_field: str,
    prompt_logprobs: int | None,
    structured_outputs: StructuredOutputsParams | None,
) -> SamplingParams:
    """The SamplingParams of a body (400 naming the field for a value they refuse); a
    stream gets its output as deltas, a JSON answer as one final output."""
    values: dict[str, Any] = dict(state.engine.settings.default_sampling)
    request_names = {"max_tokens": max_tokens_field, "logprobs": logprobs_field}
    for name in SAMPLING_BODY_FIELDS:
        value = fields.get(name)
        if value is not None:
            values[name] = value
    values["max_tokens"] = max_tokens
    values["logprobs"] = logprobs
    values["prompt_logprobs"] = prompt_logprobs
    values["structured_outputs"] = structured_outputs
    values["extra_args"] = read_vllm_xargs(fields)
    # A stream sends what is new after each step; a JSON answer only the final output.
    stream = fields.get("stream", False)
    output_kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    try:
        params = SamplingParams(**values, output_kind=output_kind)
    except FieldError as error:
        raise bad_parameter(error.field, shown_value(error.value), str(error)) from None
    except ValueError as error:
        message = str(error)
        # SamplingParams' other messages start with the field's name ("top_p must be ...").
        name = message.split(" ", 1)[0]
        if name in values:
            raise bad_parameter(
                request_names.get(name, name), shown_value(values[name]), message
            ) from None
        raise APIError(message) from None
    max_num_seqs = state.engine.settings.max_num_seqs
    if params.n > max_num_seqs:
        raise bad_parameter("n", params.n, f"n must be at most --max-num-seqs ({max_num_seqs})")
    return params


def read_vllm_xargs(fields: BodyFields) -> dict[str, Any] | None:
    """`vllm_xargs`: arguments for custom logits processors (SamplingParams.extra_args),
    each value a string, a number or a list of those, as vLLM's request model types them."""
    xargs = fields.get("vllm_xargs")
    if xargs is None:
        return None

    def scalar(value: Any) -> bool:
        return isinstance(value, (str, int, float)) and not isinstance(value, bool)

    for key, value in xargs.items():
        if not (scalar(value) or (isinstance(value, list) and all(map(scalar, value)))):
            raise bad_parameter(
                "vllm_xargs",
                shown_value(xargs),
                f"vllm_xargs[{key!r}] must be a string, a number or a list of them",
            )
    return xargs
