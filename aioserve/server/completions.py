"""POST /v1/completions: one or more prompts in, text completions out (JSON or SSE).

Each prompt runs as its own engine request (id "<response id>-<prompt index>"), all at
once; with `n` samples per prompt, sample j of prompt i is choice i*n + j, as in vLLM, and
usage adds up every prompt once and every sample's tokens.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import orjson
import torch
from aiohttp import web

from aioserve.engine.admission import InvalidRequest
from aioserve.engine.async_engine import AsyncEngine
from aioserve.engine.outputs import CompletionOutput, PromptLogprobs, RequestOutput
from aioserve.engine.prompt_embeds import (
    check_prompt_embeds_taken,
    placeholder_prompt,
    prompt_embeds_of,
)
from aioserve.server import responses
from aioserve.server.beam_search_route import outputs_for
from aioserve.server.body_fields import read_json_body
from aioserve.server.errors import APIError, refusal
from aioserve.server.generation import merge_outputs, reserve_places
from aioserve.server.prompt_embeds_field import load_prompt_embeds
from aioserve.server.prompt_truncation import PromptTruncation
from aioserve.server.protocol import (
    CompletionRequest,
    PromptInput,
    check_prompt,
    check_serving,
    parse_completion_request,
)
from aioserve.server.request_metrics import timing_metrics
from aioserve.server.responses import CompletionLogprobs, ResponseHead
from aioserve.server.sse import stream_events
from aioserve.server.state import STATE, ServerState
from aioserve.server.structured_output_fields import compile_structured_output
from aioserve.server.tracing import request_trace


@dataclass
class _Prompt:
    text: str | None
    token_ids: list[int]  # a prompt of embeddings: one placeholder a row
    embeds: torch.Tensor | None = None  # its rows, for a prompt sent as embeddings

    @property
    def shown_token_ids(self) -> list[int] | None:
        """Its token ids as a response shows them: none for a prompt of embeddings."""
        return None if self.embeds is not None else self.token_ids


async def create_completion(request: web.Request) -> web.StreamResponse:
    """The /v1/completions handler."""
    state = request.app[STATE]
    body = await read_json_body(request)
    lora = check_serving(state, body)
    parsed = parse_completion_request(state, body, request.headers)
    await compile_structured_output(state.engine, parsed.params, parsed.structured_output_field)
    engine = state.engine
    num_prompts = len(parsed.prompt_embeds) + len(parsed.prompts)
    with reserve_places(engine, num_prompts * parsed.params.n) as reservation:
        prompts = await tokenized_prompts(state, parsed)
        params = [check_prompt(engine, prompt.token_ids, parsed, "prompt") for prompt in prompts]
        if parsed.echo:
            for prompt in prompts:
                if prompt.text is None:
                    prompt.text = await state.off_loop(_decode, engine, prompt.token_ids)
        head = ResponseHead.new(
            f"cmpl-{parsed.request_id}", "text_completion", state.response_model(lora)
        )
        trace = request_trace(state.tracer, request.headers, head.model)
        streams = [
            outputs_for(parsed.beam_search)(
                engine,
                parsed.engine_prompt(prompt.text, prompt.token_ids, prompt.embeds),
                params[i],
                f"{head.id}-{i}",
                parsed.priority,
                reservation,
                lora,
                trace,
            )
            for i, prompt in enumerate(prompts)
        ]
        merged = merge_outputs(streams)
        if parsed.stream:
            chunks = _chunks(state, parsed, prompts, head, merged)
            keep_alive = state.frontend.sse_keep_alive_interval
            return await stream_events(request, chunks, keep_alive=keep_alive)
        return await _full_response(state, parsed, prompts, head, merged)


async def tokenized_prompts(state: ServerState, parsed: CompletionRequest) -> list[_Prompt]:
    """The request's prompts as the engine takes them: those sent as embeddings first, then
    the others tokenized, each cut as the request asks (off the event loop)."""
    engine = state.engine
    prompts = [await state.off_loop(_embedded, engine, encoded) for encoded in parsed.prompt_embeds]
    prompts += [await state.off_loop(_tokenize, engine, prompt) for prompt in parsed.prompts]
    if parsed.truncation is not None:
        prompts = [_truncated(prompt, parsed.truncation) for prompt in prompts]
    return prompts


def _tokenize(engine: AsyncEngine, prompt: PromptInput) -> _Prompt:
    if isinstance(prompt, list):
        return _Prompt(None, prompt)
    try:
        text, token_ids = engine.tokenize_prompt(prompt)
    except ValueError as error:  # no tokenizer loaded
        raise APIError(str(error), param="prompt") from None
    return _Prompt(text, token_ids)


def _embedded(engine: AsyncEngine, encoded: str) -> _Prompt:
    """A prompt sent as embeddings, decoded and checked as the engine will take it."""
    settings = engine.settings
    try:
        check_prompt_embeds_taken(settings)
        tensor = load_prompt_embeds(encoded, settings.max_model_len, settings.hidden_size)
        embeds = prompt_embeds_of({"prompt_embeds": tensor}, settings)
    except InvalidRequest as error:
        raise refusal(str(error), error.param) from None
    return _Prompt(None, placeholder_prompt(embeds), embeds)


def _truncated(prompt: _Prompt, truncation: PromptTruncation) -> _Prompt:
    """The prompt cut as the request asks; its text, if cut, is left to be decoded from
    the kept tokens (for echo). A prompt of embeddings loses the same rows."""
    kept = truncation.apply(prompt.token_ids)
    if kept is prompt.token_ids:
        return prompt
    if prompt.embeds is not None:
        return _Prompt(None, kept, truncation.apply(prompt.embeds))
    return _Prompt(None, kept)


def _decode(engine: AsyncEngine, token_ids: list[int]) -> str:
    if engine.tokenizer is None:
        raise APIError(
            "echo needs the tokenizer, which is not loaded (--skip-tokenizer-init)", param="echo"
        )
    return engine.tokenizer.decode(token_ids)


async def _full_response(
    state: ServerState,
    parsed: CompletionRequest,
    prompts: list[_Prompt],
    head: ResponseHead,
    merged: AsyncIterator[tuple[int, RequestOutput]],
) -> web.Response:
    finals: list[RequestOutput | None] = [None] * len(prompts)
    async with aclosing(merged):
        async for i, output in merged:
            finals[i] = output
    n = parsed.params.n
    choices = []
    completion_tokens = cached_tokens = 0
    for i, (prompt, final) in enumerate(zip(prompts, finals, strict=True)):
        cached_tokens += final.num_cached_tokens
        for sample in sorted(final.outputs, key=lambda o: o.index):
            completion_tokens += len(sample.token_ids)
            text, token_ids, entries = _shown(parsed, prompt, final.prompt_logprobs, sample, True)
            logprobs = None
            if entries is not None:
                logprobs = _completion_logprobs(state, parsed).build(token_ids, entries)
            choices.append(
                responses.completion_choice(
                    i * n + sample.index,
                    text,
                    logprobs,
                    sample.finish_reason,
                    sample.stop_reason,
                    sample.token_ids if parsed.return_token_ids else None,
                    prompt.shown_token_ids if parsed.return_token_ids else None,
                    final.prompt_logprobs,
                )
            )
    usage = responses.full_usage(
        sum(len(p.token_ids) for p in prompts),
        completion_tokens,
        cached_tokens if state.frontend.enable_prompt_tokens_details else None,
    )
    metrics = _metrics(state, parsed, finals, completion_tokens)
    body = responses.completion_response(head, choices, usage, state.system_fingerprint, metrics)
    return web.Response(body=orjson.dumps(body), content_type="application/json")


def _metrics(
    state: ServerState,
    parsed: CompletionRequest,
    finals: list[RequestOutput | None],
    num_generated: int,
) -> dict[str, Any] | None:
    """--enable-per-request-metrics' timings, for one prompt and one choice only (vLLM's
    rule: timings of several sequences are not one request's)."""
    if not state.frontend.enable_per_request_metrics:
        return None
    if len(finals) != 1 or parsed.params.n != 1:
        return None
    final = finals[0]
    return timing_metrics(final.metrics if final is not None else None, num_generated)


def _shown(
    parsed: CompletionRequest,
    prompt: _Prompt,
    prompt_logprobs: PromptLogprobs | None,
    sample: CompletionOutput,
    with_prompt: bool,
) -> tuple[str, list[int], list | None]:
    """What a choice shows of `sample` (in a stream, of its newest part): the text, the
    tokens and their logprobs (None unless asked for). With echo the prompt comes first
    (`with_prompt`: in the whole answer, or a stream's first chunk of the choice), scored by
    the prompt logprobs; with echo and max_tokens 0, the prompt alone. With return_token_ids
    the echoed prompt is its token ids alone, not its text (vLLM's rule)."""
    text, token_ids, entries = sample.text, sample.token_ids, sample.logprobs
    if parsed.echo_only:  # the one token generated is not shown
        text, token_ids = "", []
        entries = None if entries is None else []
    if parsed.echo and with_prompt:
        if not parsed.return_token_ids:
            text = prompt.text + text
        if entries is not None:  # then prompt logprobs were asked for too (protocol.py)
            entries = [*prompt_logprobs, *entries]
            token_ids = [*prompt.token_ids, *token_ids]
    return text, token_ids, entries


def _completion_logprobs(state: ServerState, parsed: CompletionRequest) -> CompletionLogprobs:
    tokenizer = state.engine.tokenizer
    decode = (lambda token_id: tokenizer.decode([token_id])) if tokenizer is not None else None
    return CompletionLogprobs(
        parsed.tokens_as_ids(state.frontend.return_tokens_as_token_ids),
        decode=decode,
        top_n=parsed.params.logprobs,
    )


async def _chunks(
    state: ServerState,
    parsed: CompletionRequest,
    prompts: list[_Prompt],
    head: ResponseHead,
    merged: AsyncIterator[tuple[int, RequestOutput]],
) -> AsyncIterator[dict[str, Any]]:
    details = state.frontend.enable_prompt_tokens_details
    n = parsed.params.n
    num_choices = len(prompts) * n
    logprobs = [_completion_logprobs(state, parsed) for _ in range(num_choices)]
    num_tokens = [0] * num_choices
    started = [False] * num_choices
    cached_tokens = [0] * len(prompts)
    # Sent once per prompt, with its first output: kept for the choices that start later.
    prompt_logprobs: list[PromptLogprobs | None] = [None] * len(prompts)
    fingerprint = state.system_fingerprint
    finals: list[RequestOutput | None] = [None] * len(prompts)
    async with aclosing(merged):
        async for i, output in merged:
            finals[i] = output
            cached_tokens[i] = output.num_cached_tokens
            if output.prompt_logprobs is not None:
                prompt_logprobs[i] = output.prompt_logprobs
            for sample in output.outputs:
                index = i * n + sample.index
                num_tokens[index] += len(sample.token_ids)
                choice = _chunk_choice(
                    parsed, prompts[i], prompt_logprobs[i], index, sample, logprobs[index], started
                )
                if choice is None:
                    continue
                event = responses.chunk(head, [choice])
                if parsed.continuous_usage_stats:
                    event["usage"] = responses.usage(len(prompts[i].token_ids), num_tokens[index])
                # vLLM stamps each choice's last chunk, unless a usage chunk follows.
                finishing = sample.finish_reason is not None
                if finishing and fingerprint is not None and not parsed.include_usage:
                    event["system_fingerprint"] = fingerprint
                yield event
    if parsed.include_usage:
        usage = responses.usage(
            sum(len(p.token_ids) for p in prompts),
            sum(num_tokens),
            sum(cached_tokens) if details else None,
        )
        metrics = _metrics(state, parsed, finals, sum(num_tokens))
        yield responses.usage_chunk(head, usage, fingerprint, metrics)


def _chunk_choice(
    parsed: CompletionRequest,
    prompt: _Prompt,
    prompt_logprobs: PromptLogprobs | None,
    index: int,
    sample: CompletionOutput,
    logprobs: CompletionLogprobs,
    started: list[bool],
) -> dict[str, Any] | None:
    """The choice of one sample's chunk, or None when the step added nothing to send. As
    vLLM's, a step that generated tokens sends its chunk even when their text is held back
    (a stop string may start there) or empty (a special token): clients time tokens by
    chunks."""
    first = not started[index]
    text, token_ids, entries = _shown(parsed, prompt, prompt_logprobs, sample, first)
    if not (text or token_ids or sample.token_ids) and sample.finish_reason is None:
        return None
    started[index] = True
    # The prompt's ids come with the first chunk when asked for, and with an echo (vLLM's).
    with_prompt_ids = first and (parsed.return_token_ids or parsed.echo)
    return responses.completion_chunk_choice(
        index,
        text,
        logprobs.build(token_ids, entries) if entries is not None else None,
        sample.finish_reason,
        sample.stop_reason,
        sample.token_ids if parsed.return_token_ids else None,
        prompt.shown_token_ids if with_prompt_ids else None,
    )
