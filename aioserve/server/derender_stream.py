"""The streamed derender (derender_routes.py): one chunk of /inference/v1/generate in, one
chunk of the OpenAI stream and the state for the next call out, as vLLM 0.32's
OnlineDerenderer.derender_chat_stream and derender_completion_stream.

Without parsers the state carries the detokenizer's window (derender_text.py) and the last
sampled ids for the logprobs' token texts; completions' logprobs offsets run on from
`logprob_text_offset`. With parsers (a chat with --reasoning-parser, or auto tool calls)
the parsers' own state is not carried: each call builds fresh ones (reasoning.py's splitter,
tool_calls/'s stream), replays the answer's earlier chunks through them as they came
(`output_token_ids` cut by `output_chunk_lens`, their output dropped) and reads this
chunk's; the detokenizer restarts from the prompt each call. A call keeps the id it was
first sent with (`last_tool_call_ids`); once calls were sent the finish reason is
"tool_calls" (but for a named function). That path has no logprobs, as vLLM's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from aioserve.server import responses
from aioserve.server.derender_request import Derender
from aioserve.server.derender_text import (
    StreamState,
    chat_logprobs,
    completion_logprobs,
    context_tail,
    decode_params,
    detokenize,
    seed_state,
)
from aioserve.server.errors import APIError
from aioserve.server.protocol import ChatRequest
from aioserve.server.reasoning import ReasoningSplitter, reasoning_closed
from aioserve.server.responses import ResponseHead
from aioserve.server.state import ServerState
from aioserve.server.tool_calls.streaming import ToolCallStream


def prompt_closed(
    tokenizer: PreTrainedTokenizerBase, parser: str, prompt_token_ids: list[int] | None
) -> bool:
    """Whether the prompt ended its reasoning itself (reasoning.reasoning_closed)."""
    if not prompt_token_ids:
        return False
    return reasoning_closed(parser, tokenizer.decode(prompt_token_ids))


def _stream_usage(chunk: dict[str, Any], prompt_tokens: int | None) -> dict[str, Any] | None:
    """A chunk's usage: the generate chunk's, with the render step's prompt count."""
    usage = chunk.get("usage")
    if usage is None:
        return None
    prompt = prompt_tokens if prompt_tokens is not None else (usage.get("prompt_tokens") or 0)
    return responses.full_usage(prompt, usage.get("completion_tokens") or 0)


def chat_stream(
    state: ServerState,
    tokenizer: PreTrainedTokenizerBase,
    read: Derender,
    chat: ChatRequest | None,
    parses: bool,
) -> tuple[dict[str, Any], StreamState]:
    generate_chunk = read.responses[0]
    if parses:
        choices, stream_state = _parsed_stream_choices(state, tokenizer, read, chat)
    else:
        choices, stream_state = _plain_stream_choices(tokenizer, read, chat)
    model = read.model or state.model_name
    head = ResponseHead.new(generate_chunk["request_id"], "chat.completion.chunk", model)
    chunk = {
        **head.fields(),
        "choices": choices,
        "usage": _stream_usage(generate_chunk, read.prompt_tokens[0]),
        "system_fingerprint": None,
        "prompt_token_ids": None,
        "prompt_text": None,
        "metrics": generate_chunk.get("metrics"),
    }
    return chunk, stream_state


def _first_state(tokenizer: PreTrainedTokenizerBase, read: Derender, skip: bool) -> StreamState:
    """The state the call before left, or the prompt's seed on the first call."""
    if read.state is not None:
        return read.state
    given = read.prompt_token_ids[0]
    return seed_state(
        tokenizer, given if given is not None else read.responses[0]["prompt_token_ids"], skip
    )


def _plain_stream_choices(
    tokenizer: PreTrainedTokenizerBase, read: Derender, chat: ChatRequest | None
) -> tuple[list[dict[str, Any]], StreamState]:
    options = chat.params if chat is not None else None
    skip, spaces = decode_params(
        tokenizer,
        options.skip_special_tokens if options else None,
        options.spaces_between_special_tokens if options else None,
    )
    start = stream_state = _first_state(tokenizer, read, skip)
    choices = []
    for choice in read.responses[0]["choices"]:
        token_ids = choice["token_ids"] or []
        text, stream_state = detokenize(tokenizer, token_ids, stream_state, skip, spaces)
        logprobs = None
        if choice["logprobs"] is not None:
            logprobs = chat_logprobs(tokenizer, choice["logprobs"], start.logprob_context_token_ids)
        role = None if stream_state.role_sent else "assistant"
        stream_state = replace(
            stream_state,
            role_sent=True,
            logprob_context_token_ids=context_tail(start.logprob_context_token_ids, token_ids),
        )
        choices.append(
            {
                "index": choice["index"],
                "delta": {"role": role, "content": text or None, "reasoning": None},
                "logprobs": logprobs,
                "finish_reason": choice["finish_reason"],
                "stop_reason": choice["stop_reason"],
                "token_ids": choice["token_ids"] if chat and chat.return_token_ids else None,
            }
        )
    return choices, stream_state


def _parsed_stream_choices(
    state: ServerState,
    tokenizer: PreTrainedTokenizerBase,
    read: Derender,
    chat: ChatRequest,
) -> tuple[list[dict[str, Any]], StreamState]:
    """The parser path: fresh parsers, the earlier chunks replayed through them (their
    output dropped), then this chunk's."""
    skip, spaces = decode_params(
        tokenizer, chat.params.skip_special_tokens, chat.params.spaces_between_special_tokens
    )
    previous = read.state or StreamState()
    prompt_ids = read.prompt_token_ids[0]
    detok = seed_state(tokenizer, prompt_ids, skip)
    parser = state.engine.settings.reasoning_parser
    splitter = None
    if parser:
        closed = prompt_closed(tokenizer, parser, prompt_ids)
        splitter = ReasoningSplitter(parser, chat.chat_template_kwargs, closed)
    tool_parser = chat.tool_use.parser
    calls = ToolCallStream(tool_parser, chat.tool_use.single_call) if tool_parser else None

    def feed(token_ids: list[int], last: bool) -> tuple[str | None, str | None, list | None]:
        nonlocal detok
        text, detok = detokenize(tokenizer, token_ids, detok, skip, spaces)
        reasoning, content = None, text
        if splitter is not None:
            split = splitter.feed(text, last)
            reasoning, content = split.reasoning or None, split.content or None
        tool_calls = None
        if calls is not None:
            content, tool_calls = calls.feed(content or "", last)
        return reasoning, content, tool_calls

    at = 0
    for length in previous.output_chunk_lens:
        feed(previous.output_token_ids[at : at + length], False)
        at += length
    output_ids = list(previous.output_token_ids)
    lens = list(previous.output_chunk_lens)
    call_ids = list(previous.last_tool_call_ids)
    role_sent, tools_streamed = previous.role_sent, previous.tools_streamed
    choices = []
    for choice in read.responses[0]["choices"]:
        token_ids = choice["token_ids"] or []
        finished = choice["finish_reason"] is not None
        reasoning = content = tool_calls = None
        if token_ids or finished:
            reasoning, content, tool_calls = feed(token_ids, finished)
        if token_ids:
            output_ids.extend(token_ids)
            lens.append(len(token_ids))
        for call in tool_calls or []:
            tools_streamed = True
            if "id" in call:
                if call["index"] < len(call_ids):
                    call["id"] = call_ids[call["index"]]
                else:
                    call_ids.append(call["id"])
        delta: dict[str, Any] = {
            "role": None if role_sent else "assistant",
            "content": content,
            "reasoning": reasoning if chat.include_reasoning else None,
        }
        if tool_calls:  # vLLM's DeltaToolCall, every field written
            delta["tool_calls"] = [
                {
                    "id": call.get("id"),
                    "type": call.get("type"),
                    "index": call["index"],
                    "function": {
                        "name": call["function"].get("name"),
                        "arguments": call["function"].get("arguments"),
                    },
                }
                for call in tool_calls
            ]
        role_sent = True
        finish_reason = choice["finish_reason"]
        named = (
            chat.tool_use.constraint is not None and not chat.tool_use.calls_finish_as_tool_calls
        )
        if finish_reason is not None and tools_streamed and not named:
            finish_reason = "tool_calls"
        shows_ids = chat.return_token_ids and chat.include_reasoning
        choices.append(
            {
                "index": choice["index"],
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": choice["stop_reason"],
                "token_ids": choice["token_ids"] if shows_ids else None,
            }
        )
    stream_state = replace(
        previous,
        output_token_ids=output_ids,
        output_chunk_lens=lens,
        role_sent=role_sent,
        tools_streamed=tools_streamed,
        last_tool_call_ids=call_ids,
    )
    return choices, stream_state


def completion_stream(
    tokenizer: PreTrainedTokenizerBase, read: Derender, skip: bool, spaces: bool, model: str
) -> dict[str, Any]:
    generate_chunk = read.responses[0]
    if len(generate_chunk["choices"]) > 1:
        raise APIError("derender_completion_stream expects at most one choice per chunk")
    start = stream_state = _first_state(tokenizer, read, skip)
    choices = []
    for choice in generate_chunk["choices"]:
        token_ids = choice["token_ids"] or []
        text, stream_state = detokenize(tokenizer, token_ids, stream_state, skip, spaces)
        logprobs = None
        if choice["logprobs"] is not None:
            resolved = chat_logprobs(tokenizer, choice["logprobs"], start.logprob_context_token_ids)
            logprobs = completion_logprobs(resolved, start.logprob_text_offset)
        stream_state = replace(
            stream_state,
            logprob_context_token_ids=context_tail(start.logprob_context_token_ids, token_ids),
            logprob_text_offset=start.logprob_text_offset + len(text),
        )
        choices.append(
            responses.completion_chunk_choice(
                choice["index"],
                text,
                logprobs,
                choice["finish_reason"],
                choice["stop_reason"],
                None,
                None,
            )
        )
    chunk = {
        **ResponseHead.new(generate_chunk["request_id"], "text_completion", model).fields(),
        "choices": choices,
        "usage": _stream_usage(generate_chunk, read.prompt_tokens[0]),
        "system_fingerprint": None,
        "metrics": generate_chunk.get("metrics"),
    }
    return {"chunk": chunk, "stream_state": stream_state.json()}
