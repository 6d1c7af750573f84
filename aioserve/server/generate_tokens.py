"""POST /inference/v1/generate (tokens in, tokens out) and POST
/inference/v1/abort_requests: vLLM 0.32's token_in_token_out routes.

The body is a GenerateRequest (generate_request.py), as /v1/*/render gives it. The answer
is vLLM's GenerateTokensResponse: `request_id` ("generate-tokens-<id>"), `model`,
`created`, `usage`, `prompt_logprobs` (when asked for), `prompt_token_ids` (with
`return_token_ids`), and one choice per sample with its `token_ids`, `finish_reason`,
`stop_reason` and, when asked for, logprobs by token id
(`{"content": [{"token_id", "logprob", "rank", "top_logprobs": [...]}]}`: the sampled token's,
then the top ones, -inf as -9999.0). `output_mode: "text"` adds each choice's `text` (the
detokenized output, stop string excluded); logprobs in that mode are refused (not yet
served). With `stream`, SSE: one chunk per sample and step with the new `token_ids` (the
prompt's ids on the first with `return_token_ids`; usage on each with
`stream_options.continuous_usage_stats`), a usage chunk at the end with
`stream_options.include_usage`, then `[DONE]`. A client that goes away aborts the request
(its KV blocks are returned), as on every generation route (generation.py).

--tokens-only (vLLM's dedicated mode, no tokenizer): the output is never detokenized, and a
request with stop strings or `output_mode: "text"` is refused with vLLM's words.

/inference/v1/abort_requests takes `{"request_ids": [...]}` (the ids /generate answers
with) and answers 200 with an empty body; `/abort_requests` is the same route under
--tokens-only (vLLM's legacy path) unless VLLM_SERVER_DEV_MODE's own is there.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import orjson
from aiohttp import web

from aioserve.engine.admission import InvalidRequest
from aioserve.engine.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from aioserve.server import responses
from aioserve.server.body_fields import read_json_body, shown_value
from aioserve.server.errors import APIError
from aioserve.server.generate_request import GenerateRequest, invalid, parse_generate_request
from aioserve.server.generation import engine_outputs, reserve_places
from aioserve.server.protocol import check_serving
from aioserve.server.sse import stream_events
from aioserve.server.state import STATE, ServerState
from aioserve.server.structured_output_fields import compile_structured_output
from aioserve.server.tracing import request_trace

_CHOICE_TAIL = {"routed_experts": None, "sampling_mask": None, "weight_versions": None}


async def generate(request: web.Request) -> web.StreamResponse:
    """The /inference/v1/generate handler."""
    state = request.app[STATE]
    body = await read_json_body(request)
    lora = check_serving(state, body)
    parsed = parse_generate_request(state, body, request.headers)
    _check_mode(state, parsed)
    params = parsed.params
    await compile_structured_output(state.engine, params, "structured_outputs")
    try:
        state.engine.check_request(parsed.token_ids, params)
    except InvalidRequest as error:
        field = "token_ids" if error.param == "prompt" else f"sampling_params.{error.param}"
        raise invalid(field, f"{error} (value={shown_value(error.value)})") from None
    model = state.response_model(lora)
    with reserve_places(state.engine, params.n) as reservation:
        outputs = engine_outputs(
            state.engine,
            parsed.engine_prompt(),
            params,
            parsed.request_id,
            parsed.priority,
            reservation,
            lora,
            request_trace(state.tracer, request.headers, model),
        )
        if parsed.stream:
            keep_alive = state.frontend.sse_keep_alive_interval
            chunks = _chunks(state, parsed, outputs)
            return await stream_events(request, chunks, keep_alive=keep_alive)
        body = await _full_response(state, parsed, model, outputs)
        return web.Response(body=orjson.dumps(body), content_type="application/json")


def _check_mode(state: ServerState, parsed: GenerateRequest) -> None:
    """--tokens-only's refusals and setting (vLLM's ServingTokens with force_no_detokenize),
    and what text mode needs."""
    params = parsed.params
    tokens_only = state.frontend.tokens_only
    if tokens_only and params.stop:
        raise APIError(
            "stop strings are not supported on a --tokens-only server because "
            "detokenization is disabled. Check stop strings on the coordinator, or use "
            "stop_token_ids."
        )
    if parsed.output_mode != "tokens":
        if tokens_only or state.engine.tokenizer is None:
            raise APIError(
                f"output_mode={parsed.output_mode!r} requires a tokenizer, but this server "
                "does not load one (--tokens-only or --skip-tokenizer-init). Send the request "
                "to a server that loads a tokenizer, or use output_mode='tokens'."
            )
        if params.logprobs is not None or params.logprob_token_ids is not None:
            raise invalid(
                "output_mode", "logprobs with output_mode='text' are not served by aioserve yet"
            )
    if tokens_only:
        params.detokenize = False


async def _full_response(
    state: ServerState, parsed: GenerateRequest, model: str, outputs: AsyncIterator[RequestOutput]
) -> dict[str, Any]:
    final: RequestOutput | None = None
    async with aclosing(outputs):
        async for output in outputs:
            final = output
    choices = [
        _choice(parsed, sample, sample.finish_reason or "stop")
        for sample in sorted(final.outputs, key=lambda s: s.index)
    ]
    completion_tokens = sum(len(s.token_ids) for s in final.outputs)
    details = state.frontend.enable_prompt_tokens_details
    usage = responses.full_usage(
        len(final.prompt_token_ids),
        completion_tokens,
        final.num_cached_tokens if details else None,
    )
    return {
        "request_id": parsed.request_id,
        "model": model,
        "created": int(time.time()),
        "usage": usage,
        "prompt_logprobs": _prompt_logprobs(final.prompt_logprobs),
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": final.prompt_token_ids if parsed.return_token_ids else None,
        "mm_placeholders": None,
        "metrics": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "output_mode": parsed.output_mode,
        "choices": choices,
    }


async def _chunks(
    state: ServerState, parsed: GenerateRequest, outputs: AsyncIterator[RequestOutput]
) -> AsyncIterator[dict[str, Any]]:
    num_tokens = [0] * parsed.params.n
    prompt_tokens = 0
    prompt_ids: list[int] | None = None
    first = True
    async with aclosing(outputs):
        async for output in outputs:
            if first:
                prompt_tokens = len(output.prompt_token_ids)
                prompt_ids = output.prompt_token_ids if parsed.return_token_ids else None
                first = False
            for sample in output.outputs:
                num_tokens[sample.index] += len(sample.token_ids)
                text = parsed.output_mode == "text" and sample.text
                if not (sample.token_ids or sample.finish_reason is not None or text):
                    continue
                chunk: dict[str, Any] = {"request_id": parsed.request_id, "usage": None}
                if parsed.continuous_usage_stats:
                    chunk["usage"] = responses.full_usage(prompt_tokens, num_tokens[sample.index])
                if prompt_ids is not None:
                    chunk["prompt_token_ids"] = prompt_ids
                    prompt_ids = None
                chunk["output_mode"] = parsed.output_mode
                chunk["choices"] = [_choice(parsed, sample, sample.finish_reason)]
                yield chunk
    if parsed.include_usage:
        usage = responses.usage(prompt_tokens, sum(num_tokens))
        if state.frontend.enable_prompt_tokens_details and not first:
            usage["prompt_tokens_details"] = {"cached_tokens": output.num_cached_tokens}
        yield {
            "request_id": parsed.request_id,
            "usage": usage,
            "output_mode": parsed.output_mode,
            "choices": [],
        }


def _choice(
    parsed: GenerateRequest, sample: CompletionOutput, finish_reason: str | None
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": sample.index,
        "finish_reason": finish_reason,
        "stop_reason": sample.stop_reason,
        "token_ids": list(sample.token_ids),
        **_CHOICE_TAIL,
    }
    if parsed.output_mode == "text":
        choice["text"] = sample.text
    choice["logprobs"] = _logprobs(parsed, sample)
    return choice


def _logprobs(parsed: GenerateRequest, sample: CompletionOutput) -> dict[str, Any] | None:
    """vLLM's GenerateLogProbs: per token its logprob and rank, and the first entries of
    its step (the sampled token's, then the top ones; at least one, all with -1)."""
    wanted = parsed.params.logprobs
    if wanted is None or sample.logprobs is None:  # logprob_token_ids alone: none (vLLM's)
        return None
    content = []
    for token_id, step in zip(sample.token_ids, sample.logprobs, strict=False):
        own = step.get(token_id) if step else None
        if own is None:
            content.append(
                {"token_id": token_id, "logprob": -9999.0, "rank": None, "top_logprobs": []}
            )
            continue
        entries = list(step.items())
        if wanted != -1:
            entries = entries[: max(wanted, 1)]
        content.append(
            {
                **_entry(token_id, own),
                "top_logprobs": [_entry(t, logprob) for t, logprob in entries],
            }
        )
    return {"content": content}


def _entry(token_id: int, logprob: Logprob) -> dict[str, Any]:
    return {
        "token_id": token_id,
        "logprob": _clamped(logprob.logprob),
        "rank": logprob.rank or None,
    }


def _clamped(value: float) -> float:
    """The OpenAI shapes' floor for a logprob: -inf and NaN become -9999.0 (vLLM's)."""
    return -9999.0 if math.isnan(value) else max(value, -9999.0)


def _prompt_logprobs(prompt_logprobs: PromptLogprobs | None) -> list | None:
    """vLLM's clamp_prompt_logprobs, as JSON: token id (a string key) -> its Logprob."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if step is None
        else {
            str(token_id): {
                "logprob": _clamped(logprob.logprob),
                "rank": logprob.rank,
                "decoded_token": logprob.decoded_token,
            }
            for token_id, logprob in step.items()
        }
        for step in prompt_logprobs
    ]


async def abort_requests(request: web.Request) -> web.Response:
    """POST /inference/v1/abort_requests: abort the requests `request_ids` names."""
    body = await read_json_body(request)
    request_ids = body.get("request_ids")
    if request_ids is None:
        raise APIError("Missing 'request_ids' in request body")
    if not isinstance(request_ids, list) or not all(isinstance(i, str) for i in request_ids):
        raise APIError("'request_ids' must be an array of strings", param="request_ids")
    engine = request.app[STATE].engine
    for request_id in request_ids:
        engine.abort(request_id)
    return web.Response()
