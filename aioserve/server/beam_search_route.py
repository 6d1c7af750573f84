"""`use_beam_search` on /v1/completions and /v1/chat/completions, as vLLM 0.32 serves it.

`n` is the beam width; `length_penalty` (default 1.0), `temperature` (the request's, else
the server's default, as for sampling), `ignore_eos`, `include_stop_str_in_output`,
`skip_special_tokens` and `max_tokens` (cut to the context, as for sampling) shape the
search (engine/beam_search.py). The answer is the routes' own, built from the one finished
output beam search gives: one choice per beam, best first, `finish_reason` "stop" (with
the EOS id as `stop_reason`) or "length"; `logprobs` (and chat's `top_logprobs`) show each
token's logprob with the first entries of the step that chose it, as vLLM shows them;
usage counts the prompt once and every beam's tokens. A chat stream sends each beam whole
in one chunk, as vLLM's does; a completions stream is vLLM's 400.

Refused with vLLM's words: a completions stream, `logprob_token_ids`, completions' `echo`
with `logprobs`, prompts sent as embeddings. Refused by aioserve, where vLLM's beam search
silently does without them (its beams are ranked by the raw logprobs, unconstrained,
unpenalised, without stop conditions): a body that sets a sampling filter or penalty
(`top_p`, `top_k`, `min_p`, `presence_penalty`, `frequency_penalty`,
`repetition_penalty`, `logit_bias`, `allowed_token_ids`, `bad_words`), a stop condition
(`stop`, `stop_token_ids`, `min_tokens`, `repetition_detection`), a structured output
(`structured_outputs`, `response_format`, `guided_*`, a tool_choice that constrains),
`prompt_logprobs`, `vllm_xargs` or `spaces_between_special_tokens: false`, each to
anything but its neutral value. `seed` seeds the steps' sampling (with a temperature above
0 the sampled token may add a candidate); `priority`, `cache_salt`, the LoRA adapter and
truncation apply to every step's requests.

Each step's requests are engine requests as vLLM's are (metrics; with
--otlp-traces-endpoint one span each); the search is admitted by load shedding as its
`n` sequences, and its steps are not shed.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncGenerator, Callable
from dataclasses import replace
from http import HTTPStatus
from typing import Any

from aioserve.engine.admission import InvalidRequest
from aioserve.engine.async_engine import AsyncEngine
from aioserve.engine.beam_search import BeamSearchParams, beam_search_output
from aioserve.engine.load_shedding import Reservation
from aioserve.engine.lora_requests import LoRARequest
from aioserve.engine.outputs import RequestOutput
from aioserve.engine.sampling_params import SamplingParams
from aioserve.server.body_fields import optional_bool, shown_value
from aioserve.server.errors import APIError, bad_parameter, refusal
from aioserve.server.generation import engine_outputs
from aioserve.server.tracing import RequestTrace, traced_outputs

STREAMING = "Streaming is not currently supported with beam search"
"""vLLM's refusal of a completions stream with beam search."""
EMBEDDINGS = "Embedding prompt not supported for beam search"

# Body fields beam search does without, each with the values that change nothing.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "top_p": (1, 1.0),
    "top_k": (-1, 0),
    "min_p": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "logit_bias": ({},),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "stop": ("", []),
    "stop_token_ids": ([],),
    "min_tokens": (0,),
    "repetition_detection": (),
    "thinking_token_budget": (-1,),
    "prompt_logprobs": (),
    "vllm_xargs": ({},),
    "spaces_between_special_tokens": (True,),
}


def wants_beam_search(body: dict[str, Any]) -> bool:
    """Whether the body asks for beam search (`use_beam_search`, a boolean)."""
    return optional_bool(body, "use_beam_search", False)


def refuse_with_beam_search(body: dict[str, Any], *, chat: bool) -> None:
    """What a body with `use_beam_search` may not ask for (vLLM's checks first, in its
    order, then aioserve's)."""
    if not wants_beam_search(body):
        return
    if not chat and body.get("stream"):
        raise APIError(STREAMING)
    if body.get("logprob_token_ids"):
        raise refusal("`logprob_token_ids` is not supported with beam search.", "logprob_token_ids")
    if not chat and body.get("echo") and body.get("logprobs") is not None:
        raise refusal(
            "`echo` with `logprobs` is not supported with beam search because beam search "
            "does not compute prompt logprobs.",
            "echo",
        )
    if not chat and body.get("prompt_embeds"):
        raise refusal(EMBEDDINGS, "prompt_embeds")
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value is not None and not any(_same(value, v) for v in neutral):
            raise bad_parameter(
                name,
                shown_value(value),
                f"{name} is not supported with beam search (use_beam_search), which ranks "
                "beams by the model's raw logprobs alone",
            )


def _same(value: Any, neutral: Any) -> bool:
    # True is not 1 here: a boolean where a number is due is not neutral.
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)


def sampling_body(body: dict[str, Any]) -> dict[str, Any]:
    """The body the sampling parameters are read from: with `use_beam_search`, `n` is the
    beam width, not a number of samples (so a greedy beam search may have n > 1, as
    vLLM's), and is read by `beam_search_params`."""
    return {**body, "n": None} if wants_beam_search(body) else body


def beam_search_params(
    body: dict[str, Any],
    params: SamplingParams,
    structured_output_field: str,
    max_tokens: int | None,
) -> BeamSearchParams | None:
    """The request's beam search, or None without `use_beam_search`; `max_tokens` is the
    request's (None: up to the context), cut per prompt by `beam_outputs`. `params` (read
    from `sampling_body`) get the beam width as their `n`: the routes answer with that
    many choices a prompt."""
    if not wants_beam_search(body):
        return None
    width = body.get("n")
    if width is None:
        width = 1
    elif isinstance(width, float) and width.is_integer():
        width = int(width)
    elif isinstance(width, bool) or not isinstance(width, int):
        raise bad_parameter("n", shown_value(width), "n must be an integer")
    if params.structured_outputs is not None:
        raise bad_parameter(
            structured_output_field,
            shown_value(body.get(structured_output_field)),
            f"{structured_output_field} is not supported with beam search (use_beam_search)",
        )
    length_penalty = body.get("length_penalty")
    if length_penalty is None:
        length_penalty = 1.0
    elif isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)):
        raise bad_parameter(
            "length_penalty", shown_value(length_penalty), "length_penalty must be a number"
        )
    try:
        beam = BeamSearchParams(
            beam_width=width,
            max_tokens=sys.maxsize if max_tokens is None else max_tokens,
            ignore_eos=params.ignore_eos,
            temperature=params.temperature,
            length_penalty=float(length_penalty),
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
        )
    except ValueError as error:  # vLLM's "beam_width must be at least 1, got 0."
        raise bad_parameter("n", width, str(error)) from None
    # Set past SamplingParams' checks, which are a sampler's (n > 1 needs a temperature):
    # the params never reach the engine, beam search's own steps do.
    params.n = width
    return beam


def outputs_for(
    beam: BeamSearchParams | None,
) -> Callable[..., AsyncGenerator[RequestOutput, None]]:
    """`engine_outputs`, or for a beam search request `beam_outputs` with the same
    arguments."""
    if beam is None:
        return engine_outputs

    def run(*args: Any, **kwargs: Any) -> AsyncGenerator[RequestOutput, None]:
        return beam_outputs(*args, beam=beam, **kwargs)

    return run


async def beam_outputs(
    engine: AsyncEngine,
    prompt: dict[str, Any],
    params: SamplingParams,
    request_id: str,
    priority: int = 0,
    reservation: Reservation | None = None,
    lora_request: LoRARequest | None = None,
    trace: RequestTrace | None = None,
    *,
    beam: BeamSearchParams,
) -> AsyncGenerator[RequestOutput, None]:
    """engine_outputs' counterpart: the one finished output of a beam search over
    `prompt` (with `params` as check_prompt cut them for it), its errors as APIError."""
    if "prompt_embeds" in prompt:
        raise refusal(EMBEDDINGS, "prompt_embeds")
    if params.max_tokens is not None:  # the room the context leaves (check_prompt's cut)
        beam = replace(beam, max_tokens=min(beam.max_tokens, params.max_tokens))
    step = SamplingParams(n=1, max_tokens=1, logprobs=2 * beam.beam_width)
    try:
        engine.check_request(list(prompt["prompt_token_ids"]), step)
    except InvalidRequest as error:  # 2 * n logprobs a step, within --max-logprobs
        raise bad_parameter("n", beam.beam_width, str(error)) from None
    hook = None
    if trace is not None:

        def hook(stream, step_id: str, step_params: SamplingParams):
            return traced_outputs(stream, trace, step_id, step_params, engine.settings)

    if reservation is not None:
        reservation.release(params.n)
    try:
        output = await beam_search_output(
            engine,
            prompt,
            beam,
            request_id,
            lora_request=lora_request,
            priority=priority,
            seed=params.seed,
            with_logprobs=params.logprobs is not None,
            hook=hook,
        )
    except InvalidRequest as error:
        raise bad_parameter(error.param, shown_value(error.value), str(error)) from None
    except ValueError as error:
        raise APIError(str(error)) from None
    except RuntimeError as error:  # a model step or the engine loop failed
        raise APIError(str(error), HTTPStatus.INTERNAL_SERVER_ERROR) from None
    yield output
