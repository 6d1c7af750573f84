"""The JSON objects the generation routes send: responses, stream chunks, usage, logprobs.

Shapes and key order are vLLM 0.32's, as captured in the reference samples (04-10): every
key vLLM writes is written here too, null where aioserve has nothing to put, so a client
that reads any of them finds it. Stream chunks carry only the keys vLLM's chunks carry.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aioserve.engine.outputs import Logprob, PromptLogprobs

# JSON has no -inf; vLLM clamps logprobs to this floor.
_MIN_LOGPROB = -9999.0


@dataclass
class ResponseHead:
    """What every response and chunk of one request starts with."""

    id: str
    object: str
    model: str
    created: int

    @classmethod
    def new(cls, response_id: str, obj: str, model: str) -> ResponseHead:
        return cls(response_id, obj, model, int(time.time()))

    def fields(self) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model}


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int | None = None,
    reasoning_tokens: int | None = None,
) -> dict[str, Any]:
    """A usage block; `cached_tokens` adds prompt_tokens_details (--enable-prompt-tokens-details),
    `reasoning_tokens` completion_tokens_details (with a --reasoning-parser)."""
    block: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if cached_tokens is not None:
        block["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if reasoning_tokens is not None:
        block["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return block


def full_usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int | None = None,
    reasoning_tokens: int | None = None,
) -> dict[str, Any]:
    """The usage block of a non-streamed response, with vLLM's null detail keys."""
    block = usage(prompt_tokens, completion_tokens)
    block["prompt_tokens_details"] = (
        {"cached_tokens": cached_tokens} if cached_tokens is not None else None
    )
    block["completion_tokens_details"] = (
        {"reasoning_tokens": reasoning_tokens} if reasoning_tokens is not None else None
    )
    return block


def token_text(token_id: int, logprob: Logprob, as_token_ids: bool) -> str:
    """A token as logprobs show it: its text, or "token_id:<id>"."""
    if as_token_ids or logprob.decoded_token is None:
        return f"token_id:{token_id}"
    return logprob.decoded_token


class CompletionLogprobs:
    """OpenAI's completions logprobs (tokens, token_logprobs, top_logprobs, text_offset).

    One per choice: `text_offset` runs on across the chunks of a stream. An echoed prompt's
    first token has no logprobs (nothing predicts it): null entries, its text from `decode`.
    """

    def __init__(
        self,
        as_token_ids: bool,
        text_offset: int = 0,
        decode: Callable[[int], str] | None = None,
        top_n: int | None = None,
    ) -> None:
        self.as_token_ids = as_token_ids
        self.text_offset = text_offset
        self.decode = decode
        # A position lists at most top_n + 1 tokens (OpenAI's rule, kept by vLLM): an echoed
        # prompt's positions may hold more, scored with prompt_logprobs.
        self.top_n = top_n

    def build(
        self, token_ids: list[int], logprobs: list[dict[int, Logprob] | None]
    ) -> dict[str, Any]:
        """The logprobs object of these tokens (the next ones of this choice)."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token_id, entries in zip(token_ids, logprobs, strict=True):
            if entries is None:
                unscored = self.as_token_ids or self.decode is None
                token = f"token_id:{token_id}" if unscored else self.decode(token_id)
                tokens.append(token)
                token_logprobs.append(None)
                top_logprobs.append(None)
            else:
                token = token_text(token_id, entries[token_id], self.as_token_ids)
                tokens.append(token)
                token_logprobs.append(max(entries[token_id].logprob, _MIN_LOGPROB))
                listed = list(entries.items())
                if self.top_n is not None:
                    listed = listed[: self.top_n + 1]
                top_logprobs.append(
                    {
                        token_text(i, lp, self.as_token_ids): max(lp.logprob, _MIN_LOGPROB)
                        for i, lp in listed
                    }
                )
            offsets.append(self.text_offset)
            self.text_offset += len(token)
        return {
            "text_offset": offsets,
            "token_logprobs": token_logprobs,
            "tokens": tokens,
            "top_logprobs": top_logprobs,
        }


def chat_logprobs(
    token_ids: list[int],
    logprobs: list[dict[int, Logprob]],
    top_n: int | None,
    as_token_ids: bool,
) -> dict[str, Any]:
    """OpenAI's chat logprobs: {"content": [{token, logprob, bytes, top_logprobs}]}. With
    top_n None (logprob_token_ids), every token a position holds, the sampled one first."""
    content = []
    for token_id, entries in zip(token_ids, logprobs, strict=True):
        if top_n is None:
            ranked = list(entries.items())
        else:
            # The top_n most likely tokens, by rank (the sampled one only if among them).
            ranked = sorted(
                ((i, lp) for i, lp in entries.items() if lp.rank is not None and lp.rank <= top_n),
                key=lambda item: item[1].rank,
            )
        entry = _chat_logprob(token_id, entries[token_id], as_token_ids)
        entry["top_logprobs"] = [_chat_logprob(i, lp, as_token_ids) for i, lp in ranked]
        content.append(entry)
    return {"content": content}


def _chat_logprob(token_id: int, logprob: Logprob, as_token_ids: bool) -> dict[str, Any]:
    token = token_text(token_id, logprob, as_token_ids)
    return {
        "token": token,
        "logprob": max(logprob.logprob, _MIN_LOGPROB),
        "bytes": list(token.encode("utf-8", errors="replace")),
    }


# -- /v1/completions -------------------------------------------------------------------------


def prompt_logprobs_json(prompt_logprobs: PromptLogprobs | None) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first, then {token id: its
    logprob, rank and decoded text} for the token and the top n (-inf clamped as logprobs)."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if entries is None
        else {
            str(token_id): {
                "logprob": max(lp.logprob, _MIN_LOGPROB),
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for token_id, lp in entries.items()
        }
        for entries in prompt_logprobs
    ]


def completion_choice(
    index: int,
    text: str,
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    stop_reason: int | str | None,
    token_ids: list[int] | None,
    prompt_token_ids: list[int] | None,
    prompt_logprobs: PromptLogprobs | None = None,
) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
        "token_ids": token_ids,
        "prompt_logprobs": prompt_logprobs_json(prompt_logprobs),
        "prompt_token_ids": prompt_token_ids,
        "routed_experts": None,
    }


def completion_response(
    head: ResponseHead,
    choices: list[dict[str, Any]],
    usage_block: dict[str, Any],
    fingerprint: str | None,
    metrics: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A whole completion; `metrics` from --enable-per-request-metrics (request_metrics.py)."""
    return {
        **head.fields(),
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": usage_block,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": metrics,
    }


def completion_chunk_choice(
    index: int,
    text: str,
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    stop_reason: int | str | None,
    token_ids: list[int] | None,
    prompt_token_ids: list[int] | None,
) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
        "prompt_token_ids": prompt_token_ids,
        "token_ids": token_ids,
    }


# -- /v1/chat/completions --------------------------------------------------------------------


def chat_choice(
    index: int,
    role: str,
    content: str | None,
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    stop_reason: int | str | None,
    token_ids: list[int] | None,
    reasoning: str | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    message = {
        "role": role,
        "content": content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
    }
    if tool_calls:  # vLLM leaves the key out when no call was made
        message["tool_calls"] = tool_calls
    message["reasoning"] = reasoning
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
        "token_ids": token_ids,
        "routed_experts": None,
    }


def chat_response(
    head: ResponseHead,
    choices: list[dict[str, Any]],
    usage_block: dict[str, Any],
    prompt_token_ids: list[int] | None,
    prompt_logprobs: PromptLogprobs | None = None,
    prompt_text: str | None = None,
    fingerprint: str | None = None,
    metrics: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A whole chat completion; `metrics` from --enable-per-request-metrics."""
    return {
        **head.fields(),
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": usage_block,
        "prompt_logprobs": prompt_logprobs_json(prompt_logprobs),
        "prompt_token_ids": prompt_token_ids,
        "prompt_text": prompt_text,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": metrics,
    }


def chat_role_chunk(
    head: ResponseHead,
    index: int,
    role: str,
    prompt_token_ids: list[int] | None,
    prompt_text: str | None = None,
) -> dict[str, Any]:
    """A chat stream's first chunk for one choice: the role, empty content."""
    return {
        **head.fields(),
        "choices": [
            {
                "index": index,
                "delta": {"role": role, "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
        "prompt_token_ids": prompt_token_ids,
        "prompt_text": prompt_text,
    }


def chat_chunk_choice(
    index: int,
    content: str | None,
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    stop_reason: int | str | None,
    token_ids: list[int] | None,
    reasoning: str | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A chat stream chunk's choice; its delta has `content`, `reasoning` and `tool_calls`
    when given (vLLM writes only the delta's fields that were set)."""
    delta: dict[str, Any] = {}
    if content is not None:
        delta["content"] = content
    if reasoning is not None:
        delta["reasoning"] = reasoning
    if tool_calls is not None:
        delta["tool_calls"] = tool_calls
    choice: dict[str, Any] = {
        "index": index,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }
    if finish_reason is not None:  # vLLM adds stop_reason to the finishing chunk only
        choice["stop_reason"] = stop_reason
    choice["token_ids"] = token_ids
    return choice


# -- both ------------------------------------------------------------------------------------


def chunk(head: ResponseHead, choices: list[dict[str, Any]]) -> dict[str, Any]:
    """A stream chunk; add "usage" or "system_fingerprint" (last chunk) to it as needed."""
    return {**head.fields(), "choices": choices}


def usage_chunk(
    head: ResponseHead,
    usage_block: dict[str, Any],
    fingerprint: str | None,
    metrics: dict[str, Any] | None,
) -> dict[str, Any]:
    """A stream's last chunk, with the usage (stream_options.include_usage): the
    fingerprint and the metrics (with their null fields) only when there are some, as
    vLLM leaves null fields out of it."""
    event = {**head.fields(), "choices": [], "usage": usage_block}
    if fingerprint is not None:
        event["system_fingerprint"] = fingerprint
    if metrics is not None:
        event["metrics"] = {key: value for key, value in metrics.items() if value is not None}
    return event
