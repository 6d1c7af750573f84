"""Reading the body of POST /inference/v1/generate: vLLM 0.32's scale-out `GenerateRequest`.

A refused body is vLLM's validation answer: 400, type "Bad Request", `param` the field's
path under "body" (e.g. "body.token_ids", "body.sampling_params.top_p"). The sampling
params are vLLM's JSON (vllm_sampling_wire.py); when they leave out `max_tokens`, the
request may use the rest of the context (vLLM's server-side default); a `max_tokens` past
that room is cut to it, as the OpenAI routes cut theirs. Multimodal input (`features`,
`content_parts`) and KV / encoder-cache transfer (`kv_transfer_params`,
`ec_transfer_params`) are refused: aioserve has neither.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from aioserve.engine.sampling_params import FieldError, RequestOutputKind, SamplingParams
from aioserve.server.body_fields import log_ignored_fields
from aioserve.server.errors import APIError
from aioserve.server.protocol import CACHE_SALT_FORBIDDEN
from aioserve.server.reasoning import reasoning_closed, reasoning_end_marker, thinks
from aioserve.server.state import ServerState
from aioserve.server.vllm_sampling_wire import WireError, from_wire

OUTPUT_MODES = ("tokens", "text")
GENERATE_FIELDS = frozenset(
    {
        "request_id",
        "token_ids",
        "token_offsets",
        "features",
        "content_parts",
        "sampling_params",
        "model",
        "reasoning_ended",
        "reasoning_parser_kwargs",
        "return_token_ids",
        "output_mode",
        "stream",
        "stream_options",
        "cache_salt",
        "priority",
        "kv_transfer_params",
        "ec_transfer_params",
    }
)
_REFUSED = {
    "features": "multimodal input is not supported by aioserve",
    "content_parts": "multimodal input is not supported by aioserve",
    "kv_transfer_params": "KV transfer is not supported by aioserve",
    "ec_transfer_params": "encoder cache transfer is not supported by aioserve",
}


@dataclass
class GenerateRequest:
    request_id: str
    """The engine request's id: "generate-tokens-<X-Request-Id or request_id>"."""
    token_ids: list[int]
    params: SamplingParams
    output_mode: str = "tokens"
    stream: bool = False
    include_usage: bool = False
    continuous_usage_stats: bool = False
    return_token_ids: bool = False
    cache_salt: str | None = None
    priority: int = 0

    def engine_prompt(self) -> dict[str, Any]:
        prompt: dict[str, Any] = {"prompt": None, "prompt_token_ids": self.token_ids}
        if self.cache_salt is not None:
            prompt["cache_salt"] = self.cache_salt
        return prompt


def invalid(field: str, message: str) -> APIError:
    """vLLM's answer to a body its GenerateRequest model refuses."""
    return APIError(message, param=f"body.{field}", error_type="Bad Request")


def parse_generate_request(
    state: ServerState, body: dict[str, Any], headers: Mapping[str, str]
) -> GenerateRequest:
    """The request in `body`; 400 (vLLM's validation shape) for a body it cannot take."""
    for name, reason in _REFUSED.items():
        if body.get(name) not in (None, [], {}):
            raise invalid(name, reason)
    token_ids = body.get("token_ids")
    if not isinstance(token_ids, list) or not token_ids:
        raise invalid("token_ids", "token_ids must be a non-empty array of token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
        raise invalid("token_ids", "token_ids must be integers")
    if any(t < 0 for t in token_ids):
        raise invalid("token_ids", "token_ids must not contain negative values")
    output_mode = _typed(body, "output_mode", str, "tokens")
    if output_mode not in OUTPUT_MODES:
        raise invalid("output_mode", f"output_mode must be one of {', '.join(OUTPUT_MODES)}")
    stream = bool(_typed(body, "stream", bool, False))
    options = _typed(body, "stream_options", dict, None) or {}
    request_id = _typed(body, "request_id", str, None) or uuid.uuid4().hex[:16]
    given = body.get("sampling_params")
    if given is None:
        raise invalid("sampling_params", "sampling_params is required")
    params = _sampling_params(state, given, token_ids, stream)
    if output_mode == "text" and not params.detokenize:
        raise invalid(
            "output_mode",
            f"output_mode={output_mode!r} requires sampling_params.detokenize to be true",
        )
    request = GenerateRequest(
        request_id=f"generate-tokens-{headers.get('X-Request-Id') or request_id}",
        token_ids=token_ids,
        params=params,
        output_mode=output_mode,
        stream=stream,
        include_usage=bool(options.get("include_usage")),
        continuous_usage_stats=bool(options.get("continuous_usage_stats")),
        return_token_ids=bool(_typed(body, "return_token_ids", bool, False)),
        cache_salt=_cache_salt(body),
        priority=_typed(body, "priority", int, 0),
    )
    params.reasoning_end = _reasoning_end(state, body, params, token_ids)
    log_ignored_fields(body, GENERATE_FIELDS)
    return request


def _typed(body: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise invalid(name, f"{name} must be of type {kind.__name__}, got {value!r}")
    return value


def _sampling_params(
    state: ServerState, given: Any, token_ids: list[int], stream: bool
) -> SamplingParams:
    try:
        kwargs = from_wire(given)
        kwargs["output_kind"] = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        params = SamplingParams.from_dict(kwargs)
    except WireError as error:
        raise invalid(f"sampling_params.{error.field}", str(error)) from None
    except FieldError as error:
        raise invalid(f"sampling_params.{error.field}", str(error)) from None
    except (TypeError, ValueError) as error:
        name = str(error).split(" ", 1)[0]
        field = f"sampling_params.{name}" if name in given else "sampling_params"
        raise invalid(field, str(error)) from None
    max_num_seqs = state.engine.settings.max_num_seqs
    if params.n > max_num_seqs:
        raise APIError(
            f"sampling_params.n must be at most the server's max_num_seqs ({max_num_seqs}), "
            f"got {params.n}."
        )
    room = state.engine.settings.max_model_len - len(token_ids)
    if room < 1:
        raise APIError(
            f"The prompt ({len(token_ids)} tokens) leaves no room to generate within "
            f"max_model_len={state.engine.settings.max_model_len}.",
            HTTPStatus.BAD_REQUEST,
            param="token_ids",
        )
    if "max_tokens" not in given or params.max_tokens is None or params.max_tokens > room:
        try:
            params = dataclasses.replace(params, max_tokens=room)
        except ValueError as error:  # e.g. a min_tokens past the room
            raise APIError(str(error)) from None
    return params


def _cache_salt(body: dict[str, Any]) -> str | None:
    """vLLM's checks of `cache_salt` (validate_cache_salt, and 1 to 1024 characters)."""
    salt = _typed(body, "cache_salt", str, None)
    if salt is None:
        return None
    if not salt or len(salt) > 1024 or any(c in CACHE_SALT_FORBIDDEN for c in salt):
        raise invalid(
            "cache_salt",
            "Parameter 'cache_salt' must be a non-empty string of at most 1024 characters "
            "without '@', '/', '\\\\' or NUL.",
        )
    return salt


def _reasoning_end(
    state: ServerState, body: dict[str, Any], params: SamplingParams, token_ids: list[int]
) -> str | None:
    """Where the structured output starts, as vLLM's engine decides it from
    `reasoning_ended` and `reasoning_parser_kwargs`: at once (None) when the reasoning has
    ended or there is no --reasoning-parser; after the reasoning (its end marker) when it has
    not; when `reasoning_ended` is null, as the prompt leaves it."""
    settings = state.engine.settings
    parser = settings.reasoning_parser
    ended = _typed(body, "reasoning_ended", bool, None)
    if params.structured_outputs is None or not parser or ended is True:
        return None
    if settings.structured_outputs.enable_in_reasoning:
        return None
    kwargs = _typed(body, "reasoning_parser_kwargs", dict, None) or {}
    template_kwargs = kwargs.get("chat_template_kwargs") or {}
    if ended is None:
        tokenizer = state.engine.tokenizer
        if tokenizer is None:
            raise invalid(
                "reasoning_ended",
                "reasoning_ended is needed with structured outputs when the tokenizer is "
                "not loaded",
            )
        if reasoning_closed(parser, tokenizer.decode(token_ids)):
            return None
    return reasoning_end_marker(parser) if thinks(parser, template_kwargs) else None
