"""Reading the bodies of the derender routes (derender_routes.py): vLLM 0.32's
DerenderChatRequest, DerenderCompletionRequest and their streamed counterparts
(vllm/entrypoints/scale_out/token_in_token_out/protocol.py).

`stream` picks the shape, as vLLM's union does: absent or false the whole answer
(`generate_response`, or `generate_responses` for completions), true one SSE chunk of
/inference/v1/generate (`generate_chunk`) with the `stream_state` the call before answered.
A body those shapes refuse is vLLM's validation answer: 400, type "Bad Request", `param` the
field's path under "body.<its model>" (e.g.
"body.DerenderChatRequest.generate_response.choices.0.token_ids"). Only
`output_mode: "tokens"` responses are taken (text ones are already detokenized).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from aioserve.server.derender_text import StreamState
from aioserve.server.errors import APIError


@dataclass
class Derender:
    """A derender body, read."""

    shape: str
    """vLLM's model name for it: DerenderChatRequest, DerenderChatStreamRequest, ..."""
    stream: bool
    model: str | None
    responses: list[dict[str, Any]]
    """The generate responses (one chunk when streamed), choices checked."""
    prompt_tokens: list[int | None]
    prompt_token_ids: list[list[int] | None]
    request: dict[str, Any] | None
    """chat_request / completion_request, as given."""
    state: StreamState | None = None


def read_derender(body: dict[str, Any], chat: bool) -> Derender:
    """The derender request in `body` (`chat`: the chat route's, else the completions')."""
    stream = body.get("stream", False)
    kind = "Chat" if chat else "Completion"
    shape = f"Derender{kind}StreamRequest" if stream is True else f"Derender{kind}Request"
    check = _Checker(shape)
    if stream not in (True, False):
        raise check.error("stream", "stream must be a boolean")
    model = check.optional(body, "model", str)
    request_field = "chat_request" if chat else "completion_request"
    request = check.optional(body, request_field, dict)
    if stream:
        responses = [
            check.response(check.required(body, "generate_chunk", dict), "generate_chunk", True)
        ]
        prompt_tokens = [check.optional(body, "prompt_tokens", int)]
        prompt_token_ids = [check.token_ids(body.get("prompt_token_ids"), "prompt_token_ids")]
        state = check.state(body.get("stream_state"))
    elif chat:
        responses = [
            check.response(
                check.required(body, "generate_response", dict), "generate_response", False
            )
        ]
        prompt_tokens = [check.optional(body, "prompt_tokens", int)]
        prompt_token_ids = [check.token_ids(body.get("prompt_token_ids"), "prompt_token_ids")]
        state = None
    else:
        given = check.required(body, "generate_responses", list)
        responses = [
            check.response(
                check.typed(r, f"generate_responses.{i}", dict), f"generate_responses.{i}", False
            )
            for i, r in enumerate(given)
        ]
        counts = check.optional(body, "prompt_tokens", list)
        ids = check.optional(body, "prompt_token_ids", list)
        for name, values in (("prompt_tokens", counts), ("prompt_token_ids", ids)):
            if values is not None and len(values) != len(responses):
                raise APIError(
                    f"{name} length ({len(values)}) must equal generate_responses length "
                    f"({len(responses)})",
                    param="body",
                    error_type="Bad Request",
                )
        prompt_tokens = (
            [None] * len(responses)
            if counts is None
            else [check.typed(c, f"prompt_tokens.{i}", int) for i, c in enumerate(counts)]
        )
        prompt_token_ids = (
            [None] * len(responses)
            if ids is None
            else [check.token_ids(v, f"prompt_token_ids.{i}") for i, v in enumerate(ids)]
        )
        state = None
    return Derender(
        shape, stream, model, responses, prompt_tokens, prompt_token_ids, request, state
    )


class _Checker:
    def __init__(self, shape: str) -> None:
        self.shape = shape

    def error(self, path: str, message: str) -> APIError:
        return APIError(message, param=f"body.{self.shape}.{path}", error_type="Bad Request")

    def typed(self, value: Any, path: str, kind: type) -> Any:
        ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
        if kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok:
            raise self.error(path, f"{path} must be of type {kind.__name__}, got {value!r}")
        return value

    def required(self, body: dict[str, Any], name: str, kind: type) -> Any:
        if name not in body:
            raise self.error(name, f"Field required: {name}")
        return self.typed(body[name], name, kind)

    def optional(self, body: dict[str, Any], name: str, kind: type, path: str = "") -> Any:
        value = body.get(name)
        return None if value is None else self.typed(value, path + name, kind)

    def token_ids(self, value: Any, path: str) -> list[int] | None:
        if value is None:
            return None
        self.typed(value, path, list)
        for i, token_id in enumerate(value):
            self.typed(token_id, f"{path}.{i}", int)
        if any(t < 0 for t in value):
            raise self.error(path, "token_ids must not contain negative values")
        return value

    def response(self, response: dict[str, Any], path: str, stream: bool) -> dict[str, Any]:
        """A GenerateTokensResponse (or its stream chunk), its defaults filled in."""
        mode = response.get("output_mode", "tokens")
        if mode != "tokens":
            raise self.error(f"{path}.output_mode", "Input should be 'tokens'")
        request_id = self.optional(response, "request_id", str, f"{path}.")
        checked = dict(response, request_id=request_id or uuid.uuid4().hex)
        for name, kind in (("usage", dict), ("kv_transfer_params", dict), ("metrics", dict)):
            self.optional(response, name, kind, f"{path}.")
        self.optional(response, "prompt_logprobs", list, f"{path}.")
        checked["prompt_token_ids"] = self.token_ids(
            response.get("prompt_token_ids"), f"{path}.prompt_token_ids"
        )
        choices = self.required_in(response, "choices", list, path)
        checked["choices"] = [
            self.choice(self.typed(c, f"{path}.choices.{i}", dict), f"{path}.choices.{i}", stream)
            for i, c in enumerate(choices)
        ]
        return checked

    def required_in(self, obj: dict[str, Any], name: str, kind: type, path: str) -> Any:
        if name not in obj:
            raise self.error(f"{path}.{name}", f"Field required: {path}.{name}")
        return self.typed(obj[name], f"{path}.{name}", kind)

    def choice(self, choice: dict[str, Any], path: str, stream: bool) -> dict[str, Any]:
        index = self.required_in(choice, "index", int, path)
        token_ids = self.token_ids(choice.get("token_ids"), f"{path}.token_ids")
        finish = choice.get("finish_reason", None if stream else "stop")
        if finish is not None:
            self.typed(finish, f"{path}.finish_reason", str)
        stop = choice.get("stop_reason")
        if stop is not None and (not isinstance(stop, (int, str)) or isinstance(stop, bool)):
            raise self.error(f"{path}.stop_reason", "stop_reason must be an integer or a string")
        logprobs = choice.get("logprobs")
        if logprobs is not None:
            self.logprobs(self.typed(logprobs, f"{path}.logprobs", dict), f"{path}.logprobs")
        return {
            "index": index,
            "finish_reason": finish,
            "stop_reason": stop,
            "token_ids": token_ids,
            "logprobs": logprobs,
        }

    def logprobs(self, logprobs: dict[str, Any], path: str) -> None:
        content = self.optional(logprobs, "content", list, f"{path}.")
        for i, entry in enumerate(content or []):
            where = f"{path}.content.{i}"
            self.candidate(self.typed(entry, where, dict), where)
            tops = self.optional(entry, "top_logprobs", list, f"{where}.") or []
            for j, top in enumerate(tops):
                self.candidate(
                    self.typed(top, f"{where}.top_logprobs.{j}", dict), f"{where}.top_logprobs.{j}"
                )

    def candidate(self, entry: dict[str, Any], path: str) -> None:
        self.required_in(entry, "token_id", int, path)
        self.required_in(entry, "logprob", float, path)
        self.optional(entry, "rank", int, f"{path}.")

    def state(self, state: Any) -> StreamState | None:
        """vLLM's DerenderStreamState, with its bounds."""
        if state is None:
            return None
        self.typed(state, "stream_state", dict)
        path = "stream_state."
        tokens = self.optional(state, "prev_tokens", list, path) or []
        if len(tokens) > 1024:
            raise self.error(
                "stream_state.prev_tokens",
                f"prev_tokens length ({len(tokens)}) exceeds maximum (1024)",
            )
        for i, token in enumerate(tokens):
            self.typed(token, f"stream_state.prev_tokens.{i}", str)
        numbers = {}
        for name in ("prefix_offset", "read_offset", "logprob_text_offset"):
            value = self.optional(state, name, int, path) or 0
            if value < 0:
                raise self.error(path + name, f"{name} must be greater than or equal to 0")
            numbers[name] = value
        context = (
            self.token_ids(
                state.get("logprob_context_token_ids"), path + "logprob_context_token_ids"
            )
            or []
        )
        if len(context) > 4:
            raise self.error(path + "logprob_context_token_ids", "List should have at most 4 items")
        output = self.token_ids(state.get("output_token_ids"), path + "output_token_ids") or []
        lens = self.optional(state, "output_chunk_lens", list, path) or []
        for i, n in enumerate(lens):
            if self.typed(n, f"{path}output_chunk_lens.{i}", int) <= 0:
                raise self.error(f"{path}output_chunk_lens.{i}", "Input should be greater than 0")
        if sum(lens) != len(output):
            raise self.error(
                "stream_state",
                "output_chunk_lens must sum to len(output_token_ids) "
                f"(got sum={sum(lens)}, len(output_token_ids)={len(output)})",
            )
        ids = self.optional(state, "last_tool_call_ids", list, path) or []
        for i, call_id in enumerate(ids):
            self.typed(call_id, f"{path}last_tool_call_ids.{i}", str)
        flags = {
            name: bool(self.optional(state, name, bool, path))
            for name in ("role_sent", "tools_streamed")
        }
        return StreamState(
            prev_tokens=tokens,
            prefix_offset=numbers["prefix_offset"],
            read_offset=numbers["read_offset"],
            role_sent=flags["role_sent"],
            logprob_context_token_ids=context,
            logprob_text_offset=numbers["logprob_text_offset"],
            output_token_ids=output,
            output_chunk_lens=lens,
            tools_streamed=flags["tools_streamed"],
            last_tool_call_ids=ids,
        )
