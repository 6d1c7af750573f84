"""POST /v1/chat/completions/derender and /v1/completions/derender: vLLM 0.32's scale-out
derender (its derender/serving.py and renderers/online_derenderer.py). What
/inference/v1/generate answered, token ids, comes back as the OpenAI answer the coupled
route would have given: a ChatCompletionResponse or CompletionResponse, or with `stream:
true` one SSE chunk of it at a time.

The body (derender_request.py) carries the generate response (`generate_response`; for
completions `generate_responses`, one per prompt as /v1/completions/render gave them),
the prompt's token count for usage (`prompt_tokens`, else 0) and ids (`prompt_token_ids`,
else the response's own: the detokenizer starts in the prompt's last tokens, so that the
first output token decodes as in the whole text), and the original request
(`chat_request`, `completion_request`) for `skip_special_tokens`,
`spaces_between_special_tokens`, `return_token_ids`, tools and reasoning. The answer's id
is the response's `request_id`, its model the body's `model` or the served one; choices are
the response's in order (completions number them across the responses), each with its
text (derender_text.py), logprobs with token texts (chat's or the completions' lists),
`finish_reason` and `stop_reason` as given; usage counts the output token ids;
`kv_transfer_params` (when the responses agree), `prompt_logprobs` and `metrics` come from
the response, as in vLLM.

With --reasoning-parser, or --tool-call-parser with --enable-auto-tool-choice, a chat
derender needs `chat_request` (vLLM's 400 otherwise) and reads the text with special tokens
kept, as vLLM's parsers do: the reasoning goes to `reasoning`, the calls to `tool_calls`
(reasoning.py, tool_calls/), streamed by replaying the earlier chunks of the answer
(`stream_state.output_token_ids`, `output_chunk_lens`) through fresh parsers each call; the
calls' ids stay those first sent (`last_tool_call_ids`).

A stream's body is one chunk of /inference/v1/generate (at most one choice) and the
`stream_state` the call before answered (none the first time); the answer is `{"chunk",
"stream_state"}` for the next call. The chat's first chunk with a choice carries the role.

Refused with vLLM's 400s: an unknown model (404), a choice without token ids, more choices
than VLLM_MAX_N_SEQUENCES (16,384), token ids, logprobs or prompt ids past
--max-model-len, more top logprobs than --max-logprobs; a server without a tokenizer
(--tokens-only, --skip-tokenizer-init) cannot derender (400).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web
from transformers import PreTrainedTokenizerBase

from aioserve.server import responses
from aioserve.server.body_fields import read_json_body
from aioserve.server.chat import calls_in_answer
from aioserve.server.derender_request import Derender, read_derender
from aioserve.server.derender_stream import chat_stream, completion_stream, prompt_closed
from aioserve.server.derender_text import (
    chat_logprobs,
    completion_logprobs,
    decode_params,
    detokenize,
    seed_state,
)
from aioserve.server.errors import APIError
from aioserve.server.protocol import (
    ChatRequest,
    GenerationRequest,
    check_serving,
    parse_chat_request,
    parse_completion_request,
)
from aioserve.server.reasoning import ReasoningSplitter, split_whole
from aioserve.server.responses import ResponseHead
from aioserve.server.state import STATE, ServerState

_NEEDS_CHAT_REQUEST = (
    "chat_request is required when a tool or reasoning parser is configured because plain "
    "detokenization would leak raw parser markup into content."
)


async def derender_chat_completion(request: web.Request) -> web.Response:
    """The POST /v1/chat/completions/derender handler."""
    state = request.app[STATE]
    body = await read_json_body(request)
    read = read_derender(body, chat=True)
    check_serving(state, body)
    tokenizer = _tokenizer(state)
    chat: ChatRequest | None = _original(state, read.request, parse_chat_request, "chat_request")
    parses = _parses(state)
    if parses and chat is None:
        raise APIError(_NEEDS_CHAT_REQUEST)
    if read.stream:
        if parses and read.prompt_token_ids[0] is None:
            raise APIError(
                "prompt_token_ids is required when a tool or reasoning parser is configured. "
                "Without it parse_delta cannot tell whether the prompt left reasoning open "
                "(e.g. a chat template that pre-opens <think>) and would misclassify "
                "reasoning content as plain content."
            )
        _check_stream_bounds(state, read)
        chunk, stream_state = await state.off_loop(
            chat_stream, state, tokenizer, read, chat, parses
        )
        return _json({"chunk": chunk, "stream_state": stream_state.json()})
    _check_bounds(state, read)
    return _json(await state.off_loop(_chat_response, state, tokenizer, read, chat, parses))


async def derender_completion(request: web.Request) -> web.Response:
    """The POST /v1/completions/derender handler."""
    state = request.app[STATE]
    body = await read_json_body(request)
    read = read_derender(body, chat=False)
    check_serving(state, body)
    if not read.stream and not read.responses:
        raise APIError("generate_responses must not be empty")
    tokenizer = _tokenizer(state)
    model = read.model or state.model_name
    options = _original(state, read.request, parse_completion_request, "completion_request")
    skip, spaces = decode_params(
        tokenizer,
        options.params.skip_special_tokens if options else None,
        options.params.spaces_between_special_tokens if options else None,
    )
    if read.stream:
        _check_prompt_ids(state, read.prompt_token_ids)
        derender = completion_stream
    else:
        _check_bounds(state, read)
        derender = _completion_response
    return _json(await state.off_loop(derender, tokenizer, read, skip, spaces, model))


def _json(body: dict[str, Any]) -> web.Response:
    return web.Response(body=orjson.dumps(body), content_type="application/json")


def _tokenizer(state: ServerState) -> PreTrainedTokenizerBase:
    tokenizer = state.engine.tokenizer
    if tokenizer is None or state.frontend.tokens_only:
        raise APIError(
            "derender requires a tokenizer, but this server does not load one (--tokens-only "
            "or --skip-tokenizer-init). Send the request to a server that loads a tokenizer."
        )
    return tokenizer


def _parses(state: ServerState) -> bool:
    """Whether vLLM would build a parser: a reasoning parser, or auto tool calls."""
    frontend = state.frontend
    tools = frontend.enable_auto_tool_choice and bool(frontend.tool_call_parser)
    return bool(state.engine.settings.reasoning_parser) or tools


def _original(
    state: ServerState,
    body: dict[str, Any] | None,
    parse: Callable[[ServerState, dict[str, Any]], GenerationRequest],
    field: str,
) -> Any:
    """The original request (`chat_request`, `completion_request`), read as its route reads
    it; a 400 names the field under `field`."""
    if body is None:
        return None
    try:
        return parse(state, body)
    except APIError as error:
        if error.param:
            error.param = f"{field}.{error.param}"
        raise


# -- bounds -------------------------------------------------------------------------------------


def _max_n() -> int:
    return int(os.environ.get("VLLM_MAX_N_SEQUENCES", "16384"))


def _check_bounds(state: ServerState, read: Derender) -> None:
    """vLLM's `_validate_derender_bounds` and `_validate_prompt_token_ids`."""
    max_n = _max_n()
    max_len = state.engine.settings.max_model_len
    max_logprobs = state.engine.settings.max_logprobs
    if len(read.responses) > max_n:
        raise APIError(
            f"generate_responses count ({len(read.responses)}) exceeds server maximum "
            f"({max_n}). Set VLLM_MAX_N_SEQUENCES to increase this limit."
        )
    for response in read.responses:
        if len(response["choices"]) > max_n:
            raise APIError(
                f"choices count ({len(response['choices'])}) in response "
                f"'{response['request_id']}' exceeds server maximum ({max_n})."
            )
        for choice in response["choices"]:
            _check_choice_bounds(choice, max_len, max_logprobs)
        prompt_logprobs = response.get("prompt_logprobs")
        if prompt_logprobs and len(prompt_logprobs) > max_len:
            raise APIError(
                f"prompt_logprobs length ({len(prompt_logprobs)}) in response "
                f"'{response['request_id']}' exceeds max_model_len ({max_len})."
            )
    _check_prompt_ids(state, read.prompt_token_ids)


def _check_choice_bounds(choice: dict[str, Any], max_len: int, max_logprobs: int) -> None:
    index, token_ids = choice["index"], choice["token_ids"]
    if token_ids and len(token_ids) > max_len:
        raise APIError(
            f"token_ids length ({len(token_ids)}) in choice {index} exceeds max_model_len "
            f"({max_len})."
        )
    content = (choice["logprobs"] or {}).get("content")
    if not content:
        return
    if len(content) > max_len:
        raise APIError(
            f"logprobs.content length ({len(content)}) in choice {index} exceeds "
            f"max_model_len ({max_len})."
        )
    for entry in content:
        tops = entry.get("top_logprobs") or []
        if max_logprobs >= 0 and len(tops) > max_logprobs:
            raise APIError(
                f"top_logprobs count ({len(tops)}) in choice {index} exceeds max_logprobs "
                f"({max_logprobs})."
            )


def _check_prompt_ids(state: ServerState, prompt_token_ids: list[list[int] | None]) -> None:
    max_len = state.engine.settings.max_model_len
    for ids in prompt_token_ids:
        if ids is not None and len(ids) > max_len:
            raise APIError(
                f"prompt_token_ids length ({len(ids)}) exceeds max_model_len ({max_len})."
            )


def _check_stream_bounds(state: ServerState, read: Derender) -> None:
    """A chat chunk: one choice at most, and prompt, output so far and the chunk within
    the context."""
    choices = read.responses[0]["choices"]
    if len(choices) > 1:
        raise APIError(
            f"derender_chat_stream expects at most one choice per chunk (got {len(choices)})."
        )
    prompt = len(read.prompt_token_ids[0] or ())
    prior = len(read.state.output_token_ids) if read.state is not None else 0
    delta = sum(len(c["token_ids"] or ()) for c in choices)
    max_len = state.engine.settings.max_model_len
    if prompt + prior + delta > max_len:
        raise APIError(
            f"prompt_token_ids length ({prompt}) plus output_token_ids length ({prior}) "
            f"plus delta ({delta}) exceeds max_model_len ({max_len})."
        )


# -- whole answers ------------------------------------------------------------------------------


def _head(read: Derender, state: ServerState, response_id: str, obj: str) -> ResponseHead:
    return ResponseHead.new(response_id, obj, read.model or state.model_name)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return responses.full_usage(prompt_tokens, completion_tokens)


def _chat_response(
    state: ServerState,
    tokenizer: PreTrainedTokenizerBase,
    read: Derender,
    chat: ChatRequest | None,
    parses: bool,
) -> dict[str, Any]:
    response = read.responses[0]
    parsed = parses and chat is not None
    options = chat.params if chat is not None else None
    skip, spaces = decode_params(
        tokenizer,
        options.skip_special_tokens if options else None,
        options.spaces_between_special_tokens if options else None,
    )
    prompt_ids = read.prompt_token_ids[0]
    seed = seed_state(
        tokenizer, prompt_ids if prompt_ids is not None else response["prompt_token_ids"], skip
    )
    shows_ids = (
        chat is not None and chat.return_token_ids and (not parsed or chat.include_reasoning)
    )
    choices = []
    for choice in response["choices"]:
        token_ids = _token_ids(choice)
        logprobs = choice["logprobs"]
        resolved = chat_logprobs(tokenizer, logprobs) if logprobs is not None else None
        text, _ = detokenize(tokenizer, token_ids, seed, skip, spaces)
        reasoning, content, calls = None, text, None
        if parsed:
            reasoning, content, calls = _parsed_message(
                state, tokenizer, chat, text, response["prompt_token_ids"]
            )
        choices.append(
            responses.chat_choice(
                choice["index"],
                "assistant",
                content,
                resolved,
                choice["finish_reason"],
                choice["stop_reason"],
                token_ids if shows_ids else None,
                reasoning,
                calls,
            )
        )
    completion_tokens = sum(len(c["token_ids"] or ()) for c in response["choices"])
    body = responses.chat_response(
        _head(read, state, response["request_id"], "chat.completion"),
        choices,
        _usage(read.prompt_tokens[0] or 0, completion_tokens),
        None,
        metrics=response.get("metrics"),
    )
    body["prompt_logprobs"] = response.get("prompt_logprobs")
    body["kv_transfer_params"] = response.get("kv_transfer_params")
    return body


def _token_ids(choice: dict[str, Any], where: str = "") -> list[int]:
    if not choice["token_ids"]:
        raise APIError(f"choice {choice['index']}{where} has empty or null token_ids")
    return choice["token_ids"]


def _parsed_message(
    state: ServerState,
    tokenizer: PreTrainedTokenizerBase,
    chat: ChatRequest,
    text: str,
    prompt_token_ids: list[int] | None,
) -> tuple[str | None, str | None, list[dict[str, Any]] | None]:
    """(reasoning, content, tool_calls) of a whole answer's text, read by the server's
    parsers as /v1/chat/completions reads it."""
    reasoning, content = None, text
    parser = state.engine.settings.reasoning_parser
    if parser:
        splitter = ReasoningSplitter(
            parser, chat.chat_template_kwargs, prompt_closed(tokenizer, parser, prompt_token_ids)
        )
        reasoning, content = split_whole(splitter, text)
    content, calls, _ = calls_in_answer(chat.tool_use, content, None)
    if not chat.include_reasoning:
        reasoning = None
    if chat.tool_use.constraint is not None and content is None:
        content = ""  # named or required: vLLM's
    return reasoning, content, calls


def _completion_response(
    tokenizer: PreTrainedTokenizerBase, read: Derender, skip: bool, spaces: bool, model: str
) -> dict[str, Any]:
    choices = []
    prompt_tokens = completion_tokens = 0
    for response, count, given_ids in zip(
        read.responses, read.prompt_tokens, read.prompt_token_ids, strict=True
    ):
        seed_ids = given_ids if given_ids is not None else response["prompt_token_ids"]
        seed = seed_state(tokenizer, seed_ids, skip)
        for choice in response["choices"]:
            token_ids = _token_ids(choice, f" in response {response['request_id']}")
            text, _ = detokenize(tokenizer, token_ids, seed, skip, spaces)
            logprobs = None
            if choice["logprobs"] is not None:
                logprobs = completion_logprobs(chat_logprobs(tokenizer, choice["logprobs"]))
            choices.append(
                responses.completion_choice(
                    len(choices),
                    text,
                    logprobs,
                    choice["finish_reason"],
                    choice["stop_reason"],
                    None,
                    None,
                )
            )
            completion_tokens += len(token_ids)
        prompt_tokens += count or 0
    first = read.responses[0]
    kv_params = first.get("kv_transfer_params")
    if any(r.get("kv_transfer_params") != kv_params for r in read.responses[1:]):
        kv_params = None  # vLLM's: they differ across the prompts
    body = responses.completion_response(
        ResponseHead.new(first["request_id"], "text_completion", model),
        choices,
        _usage(prompt_tokens, completion_tokens),
        None,
        first.get("metrics") if len(read.responses) == 1 else None,
    )
    body["kv_transfer_params"] = kv_params
    return body
