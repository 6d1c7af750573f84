"""POST /v1/chat/completions: messages in, the assistant's reply out (JSON or SSE).

The messages are rendered with the chat template (chat_template.py) into one prompt, run
as one engine request with `n` samples. The reply's role is `--response-role`
("assistant") when the template adds a generation prompt, else the last message's role
(the reply continues it). A stream opens each choice with a chunk carrying that role.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import orjson
from aiohttp import web

from aioserve.engine.outputs import CompletionOutput, RequestOutput
from aioserve.server import responses
from aioserve.server.beam_search_route import outputs_for
from aioserve.server.body_fields import read_json_body
from aioserve.server.chat_images import read_request_images, widened_prompt_ids
from aioserve.server.chat_messages import content_text
from aioserve.server.chat_template import render_chat
from aioserve.server.generation import reserve_places
from aioserve.server.output_log import COMPLETE, output_log
from aioserve.server.protocol import (
    ChatRequest,
    check_prompt,
    check_serving,
    parse_chat_request,
)
from aioserve.server.reasoning import (
    ReasoningSplitter,
    count_reasoning_tokens,
    reasoning_closed,
    split_whole,
)
from aioserve.server.request_metrics import timing_metrics
from aioserve.server.responses import ResponseHead
from aioserve.server.sse import stream_events
from aioserve.server.state import STATE, ServerState
from aioserve.server.structured_output_fields import compile_structured_output
from aioserve.server.tool_calls.streaming import ToolCallStream, tool_call_objects
from aioserve.server.tools import ToolUse
from aioserve.server.tracing import request_trace


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    """The /v1/chat/completions handler."""
    state = request.app[STATE]
    body = await read_json_body(request)
    lora = check_serving(state, body)
    parsed = parse_chat_request(state, body, request.headers)
    await compile_structured_output(state.engine, parsed.params, parsed.structured_output_field)
    engine = state.engine
    with reserve_places(engine, parsed.params.n) as reservation:
        rendered, text, token_ids, prompt_closed = await chat_prompt(state, parsed)
        if parsed.add_generation_prompt:
            role = state.frontend.response_role
        else:
            role = parsed.messages[-1]["role"]
        echo = _echoed_text(parsed, role)
        object_name = "chat.completion.chunk" if parsed.stream else "chat.completion"
        head = ResponseHead.new(
            f"chatcmpl-{parsed.request_id}", object_name, state.response_model(lora)
        )
        outputs = outputs_for(parsed.beam_search)(
            engine,
            parsed.engine_prompt(text, token_ids),
            parsed.params,
            head.id,
            parsed.priority,
            reservation,
            lora,
            request_trace(state.tracer, request.headers, head.model),
        )
        shown = rendered if parsed.return_prompt_text else None  # the prompt_text field
        if parsed.stream:
            events = chat_chunks(
                state, parsed, shown, token_ids, prompt_closed, role, echo, head, outputs
            )
            keep_alive = state.frontend.sse_keep_alive_interval
            return await stream_events(request, events, keep_alive=keep_alive)
        body = await full_chat_body(
            state, parsed, shown, token_ids, prompt_closed, role, echo, head, outputs
        )
        return web.Response(body=orjson.dumps(body), content_type="application/json")


async def chat_prompt(
    state: ServerState, parsed: ChatRequest, prompt_field: str = "messages"
) -> tuple[str, str, list[int], bool]:
    """The request's prompt: the rendered template (for prompt_text: vLLM cuts the ids
    only), the prompt's text and token ids once cut as the request asks, and whether it
    ended the reasoning (settle_reasoning). `parsed.params` get max_tokens cut to the room
    the prompt leaves (check_prompt, 400 for a prompt the engine refuses)."""
    engine = state.engine
    placeholder = await read_request_images(engine, parsed)
    text, token_ids = await state.off_loop(
        render_chat,
        state,
        parsed.messages,
        add_generation_prompt=parsed.add_generation_prompt,
        continue_final_message=parsed.continue_final_message,
        chat_template_kwargs=parsed.chat_template_kwargs,
        tools=parsed.tool_use.tools,
        add_special_tokens=parsed.add_special_tokens,
        chat_template=parsed.chat_template,
        image_placeholder=placeholder,
    )
    if parsed.images:
        token_ids = widened_prompt_ids(engine, token_ids, len(parsed.images))
    rendered = text
    if parsed.truncation is not None:
        kept = parsed.truncation.apply(token_ids)
        if kept is not token_ids:
            text, token_ids = await state.off_loop(engine.tokenizer.decode, kept), kept
    prompt_closed = settle_reasoning(state, parsed, text)
    parsed.params = check_prompt(engine, token_ids, parsed, prompt_field)
    return rendered, text, token_ids, prompt_closed


def settle_reasoning(state: ServerState, parsed: ChatRequest, prompt: str) -> bool:
    """Whether the rendered `prompt` already ended the answer's reasoning (under the
    server's --reasoning-parser). Then, or when the reasoning is not wanted, a constrained
    answer is constrained from its first token (vLLM's rule)."""
    parser = state.engine.settings.reasoning_parser
    prompt_closed = bool(parser) and reasoning_closed(parser, prompt)
    if prompt_closed or not parsed.include_reasoning:
        parsed.params.reasoning_end = None
    return prompt_closed


def _echoed_text(parsed: ChatRequest, role: str) -> str:
    """With `echo`, the last message's text when the reply continues its role (vLLM's rule)."""
    last = parsed.messages[-1]
    if not parsed.echo or last.get("role") != role:
        return ""
    return content_text(last)


async def full_chat_body(
    state: ServerState,
    parsed: ChatRequest,
    prompt_text: str | None,
    prompt_token_ids: list[int],
    prompt_closed: bool,
    role: str,
    echo: str,
    head: ResponseHead,
    outputs: AsyncIterator[RequestOutput],
) -> dict[str, Any]:
    """The chat completion of the whole answer `outputs` delivers (the Anthropic Messages
    route reads it too: anthropic_api.py)."""
    async with aclosing(outputs):
        async for output in outputs:
            final = output
    as_token_ids = parsed.tokens_as_ids(state.frontend.return_tokens_as_token_ids)
    parser = state.engine.settings.reasoning_parser
    # Hidden reasoning hides the token data that would show it too (vLLM's rule).
    hidden = bool(parser) and not parsed.include_reasoning
    choices = []
    reasoning_tokens = 0
    for sample in sorted(final.outputs, key=lambda o: o.index):
        logprobs = None
        if sample.logprobs is not None and not hidden:
            logprobs = responses.chat_logprobs(
                sample.token_ids, sample.logprobs, parsed.params.logprobs, as_token_ids
            )
        reasoning, content = None, sample.text
        if parser:
            reasoning, content, count = _split_reasoning(state, parsed, prompt_closed, sample)
            reasoning_tokens += count
        content, tool_calls, finish_reason = calls_in_answer(
            parsed.tool_use, content, sample.finish_reason
        )
        choices.append(
            responses.chat_choice(
                sample.index,
                role,
                echo + (content or "") if echo or content is not None else None,
                logprobs,
                finish_reason,
                sample.stop_reason,
                sample.token_ids if parsed.return_token_ids and not hidden else None,
                reasoning if parsed.include_reasoning else None,
                tool_calls,
            )
        )
    details = state.frontend.enable_prompt_tokens_details
    num_generated = sum(len(sample.token_ids) for sample in final.outputs)
    usage = responses.full_usage(
        len(prompt_token_ids),
        num_generated,
        final.num_cached_tokens if details else None,
        reasoning_tokens if parser else None,
    )
    log = output_log(state.frontend)
    if log is not None:
        tokens = {sample.index: sample.token_ids for sample in final.outputs}
        for choice in choices:
            message = choice["message"]
            log.chat_choice(
                head.id,
                message["content"],
                message.get("tool_calls"),
                tokens[choice["index"]],
                choice["finish_reason"],
            )
    prompt_ids = prompt_token_ids if parsed.return_token_ids else None
    return responses.chat_response(
        head,
        choices,
        usage,
        prompt_ids,
        final.prompt_logprobs,
        prompt_text,
        state.system_fingerprint,
        _metrics(state, parsed, final, num_generated),
    )


def _metrics(
    state: ServerState, parsed: ChatRequest, final: RequestOutput | None, num_generated: int
) -> dict[str, Any] | None:
    """--enable-per-request-metrics' timings, for an answer of one choice (vLLM's rule)."""
    if not state.frontend.enable_per_request_metrics or parsed.params.n != 1:
        return None
    return timing_metrics(final.metrics if final is not None else None, num_generated)


def _split_reasoning(
    state: ServerState, parsed: ChatRequest, prompt_closed: bool, sample: CompletionOutput
) -> tuple[str | None, str | None, int]:
    """(reasoning, content, reasoning tokens) of a whole answer."""
    splitter = ReasoningSplitter(
        state.engine.settings.reasoning_parser, parsed.chat_template_kwargs, prompt_closed
    )
    reasoning, content = split_whole(splitter, sample.text)
    skip_special_tokens = parsed.params.skip_special_tokens
    count = count_reasoning_tokens(
        splitter,
        sample.token_ids,
        lambda ids: state.engine.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens),
    )
    return reasoning, content, count


def calls_in_answer(
    tool_use: ToolUse, content: str | None, finish_reason: str | None
) -> tuple[str | None, list[dict[str, Any]] | None, str | None]:
    """(content, tool_calls, finish_reason) of a finished answer, as tools.py describes."""
    if tool_use.parser is None or content is None:
        return content, None, finish_reason
    answer = tool_use.parser.read_whole(content)
    if not answer.has_calls:
        return content, None, finish_reason
    # vLLM's non-streamed finish: "tool_calls" for auto calls whatever ended them, for
    # "required" only after a "stop" (chat_completion/serving.py).
    auto = tool_use.constraint is None
    if tool_use.calls_finish_as_tool_calls and (auto or finish_reason == "stop"):
        finish_reason = "tool_calls"
    text: str | None = answer.content
    if not text.strip():
        # Only whitespace around the calls: none under "auto", "" for forced calls
        # (vLLM's parser/abstract_parser.py and chat_completion/serving.py).
        text = None if auto else ""
    calls = tool_call_objects(answer, tool_use.parser, tool_use.single_call)
    return text, calls, finish_reason


async def chat_chunks(
    state: ServerState,
    parsed: ChatRequest,
    prompt_text: str | None,
    prompt_token_ids: list[int],
    prompt_closed: bool,
    role: str,
    echo: str,
    head: ResponseHead,
    outputs: AsyncIterator[RequestOutput],
) -> AsyncIterator[dict[str, Any]]:
    """The chunks of the answer `outputs` delivers in deltas (the Anthropic Messages route
    turns them into its events: anthropic_stream.py)."""
    as_token_ids = parsed.tokens_as_ids(state.frontend.return_tokens_as_token_ids)
    details = state.frontend.enable_prompt_tokens_details
    num_prompt_tokens = len(prompt_token_ids)
    n = parsed.params.n
    num_tokens = [0] * n
    cached_tokens = 0
    started = False
    parser = state.engine.settings.reasoning_parser
    kwargs = parsed.chat_template_kwargs
    splitters = [
        ReasoningSplitter(parser, kwargs, prompt_closed) for _ in range(n if parser else 0)
    ]
    reasoning_tokens = [0] * n
    # Hidden reasoning hides the token data that would show it too (vLLM's rule).
    hidden = bool(parser) and not parsed.include_reasoning
    fingerprint = state.system_fingerprint
    log = output_log(state.frontend)
    texts = [""] * n  # each choice's raw generated text, for the output log
    last: RequestOutput | None = None

    def usage_of(completion_tokens: int, *, cached: int | None = None) -> dict[str, Any]:
        return responses.usage(
            num_prompt_tokens,
            completion_tokens,
            cached,
            sum(reasoning_tokens) if parser else None,
        )

    tool_parser = parsed.tool_use.parser
    single_call = parsed.tool_use.single_call
    call_streams = [
        ToolCallStream(tool_parser, single_call) for _ in range(n if tool_parser else 0)
    ]
    async with aclosing(outputs):
        async for output in outputs:
            last = output
            cached_tokens = output.num_cached_tokens
            if not started:
                # The role chunks wait for the first output, so that a request the engine
                # refuses is still answered with a JSON error (sse.py).
                started = True
                for index in range(n):
                    event = responses.chat_role_chunk(
                        head,
                        index,
                        role,
                        prompt_token_ids if parsed.return_token_ids else None,
                        prompt_text,
                    )
                    if parsed.continuous_usage_stats:
                        event["usage"] = responses.usage(
                            num_prompt_tokens, 0, reasoning_tokens=0 if parser else None
                        )
                    yield event
                    if echo:
                        choice = responses.chat_chunk_choice(index, echo, None, None, None, None)
                        yield responses.chunk(head, [choice])
            for sample in output.outputs:
                num_tokens[sample.index] += len(sample.token_ids)
                texts[sample.index] += sample.text
                has_token_data = (
                    bool(sample.token_ids)
                    and (sample.logprobs is not None or parsed.return_token_ids)
                    and not hidden
                )
                content, reasoning = sample.text, None
                if parser:
                    splitter = splitters[sample.index]
                    if splitter.in_reasoning:
                        reasoning_tokens[sample.index] += len(sample.token_ids)
                    split = splitter.feed(sample.text, last=sample.finish_reason is not None)
                    content = split.content or None
                    if parsed.include_reasoning:
                        reasoning = split.reasoning or None
                tool_calls, finish_reason = None, sample.finish_reason
                if tool_parser is not None:
                    calls = call_streams[sample.index]
                    content, tool_calls = calls.feed(content or "", last=finish_reason is not None)
                    # vLLM's streamed finish: "tool_calls" only when calls were sent and
                    # the engine stopped (chat_completion/serving.py).
                    if calls.made_calls and finish_reason == "stop":
                        if parsed.tool_use.calls_finish_as_tool_calls:
                            finish_reason = "tool_calls"
                # Without a parser, as in vLLM, every step that generated tokens sends its
                # chunk, even with its text held back (clients time tokens by chunks).
                passed_through = not parser and tool_parser is None and bool(sample.token_ids)
                if (
                    not (content or reasoning or tool_calls or passed_through)
                    and sample.finish_reason is None
                    and not has_token_data
                ):
                    continue
                logprobs = None
                if sample.logprobs is not None and not hidden:
                    logprobs = responses.chat_logprobs(
                        sample.token_ids, sample.logprobs, parsed.params.logprobs, as_token_ids
                    )
                choice = responses.chat_chunk_choice(
                    sample.index,
                    content,
                    logprobs,
                    finish_reason,
                    sample.stop_reason,
                    sample.token_ids if parsed.return_token_ids and not hidden else None,
                    reasoning,
                    tool_calls,
                )
                if log is not None:
                    log.chat_delta(
                        head.id, content, reasoning, tool_calls, sample.token_ids,
                        sample.finish_reason,
                    )  # fmt: skip
                event = responses.chunk(head, [choice])
                if parsed.continuous_usage_stats:
                    event["usage"] = usage_of(num_tokens[sample.index])
                # vLLM stamps each choice's last chunk, unless a usage chunk follows.
                finishing = sample.finish_reason is not None
                if finishing and fingerprint is not None and not parsed.include_usage:
                    event["system_fingerprint"] = fingerprint
                yield event
    if parsed.include_usage:
        yield responses.usage_chunk(
            head,
            usage_of(sum(num_tokens), cached=cached_tokens if details else None),
            fingerprint,
            _metrics(state, parsed, last, sum(num_tokens)),
        )
    if log is not None:
        for text in texts:
            log.log(head.id, text, None, "streaming_complete", COMPLETE)
