"""What the pooling routes share (embeddings.py, classify.py, scoring.py): their common body
fields, the prompts' tokenization, truncation and checks, and running them through
`AsyncEngine.encode` (a cross-encoder's pair with its token types).

As vLLM 0.32 (entrypoints/pooling/base/): every route takes `model`, `user`,
`truncate_prompt_tokens`, `truncation_side`, `padding`, `request_id`, `priority`,
`cache_salt` and `use_activation`. The response id is "<prefix>-<request id>" (the
X-Request-Id header, else the body's `request_id`, else a fresh hex id), and each prompt
runs as its own engine request "<response id>-<index>", all at once. Differences from
generation, all vLLM's:

- a pooling prompt may fill the whole context (no token follows it), so
  `truncate_prompt_tokens: -1` keeps --max-model-len tokens, not one fewer;
- unset, `truncation_side` is the pooling tokenizer's, "right" (the first tokens kept);
- a `truncate_prompt_tokens` past the context is refused with the pooling routes' wording;
- a text with `truncate_prompt_tokens` and no `truncation_side` is cut by the tokenizer
  itself (`truncation=True, max_length=N`), which keeps the special tokens ([CLS] ... [SEP]:
  N - 2 of the text's own); with an explicit side, and for token ids and chats, the tokens
  are sliced, special tokens or not (vLLM's TokenizeParams.get_encode_kwargs);
- without truncation a text is tokenized no further than one token past the context, so
  a long document costs no more than that, and one that long is refused as having "at
  least" that many tokens;
- a body naming `normalize` (removed in 0.32 for `use_activation`), or a removed `task`, is
  refused whatever the value.

The prompts are checked against the engine (engine/pooling_params.py: length, vocabulary,
`dimensions`) before any of them is submitted, so a request is refused whole or runs whole.
Load shedding is as for generation (generation.py): places are reserved before tokenizing
and handed to the engine as each prompt is registered.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from aioserve.engine.admission import InvalidRequest
from aioserve.engine.async_engine import AsyncEngine
from aioserve.engine.load_shedding import QueueFullError, Reservation
from aioserve.engine.outputs import PoolingRequestOutput
from aioserve.engine.pooling_params import PoolingParams, check_pooling_request
from aioserve.server.body_fields import BodyFields, shown_value
from aioserve.server.chat_template import refuse_request_mm_kwargs
from aioserve.server.errors import APIError, bad_parameter, refusal
from aioserve.server.generation import overloaded
from aioserve.server.prompt_truncation import SIDES, PromptTruncation, read_truncation
from aioserve.server.protocol import read_cache_salt
from aioserve.server.request_schema import BodyField
from aioserve.server.responses import full_usage
from aioserve.server.state import ServerState
from aioserve.server.tracing import RequestTrace, request_trace

_STRING = {"type": "string"}
_INTEGER = {"type": "integer"}
_BOOLEAN = {"type": "boolean"}

COMMON_BODY: dict[str, BodyField] = {
    field.name: field
    for field in (
        BodyField("model", _STRING),
        BodyField("user", _STRING),
        BodyField("truncate_prompt_tokens", {"type": "integer", "minimum": -1}),
        BodyField("truncation_side", {"type": "string", "enum": list(SIDES)}),
        BodyField("padding", {"type": "string", "enum": ["do_not_pad"]}),
        BodyField("request_id", _STRING),
        BodyField("priority", _INTEGER),
        BodyField("cache_salt", {"type": "string", "minLength": 1, "maxLength": 128}),
        BodyField(
            "use_activation",
            {
                "type": "boolean",
                "description": "The pooler's activation (an embedding's L2 normalization, a "
                "classifier's sigmoid or softmax); unset: the model's default.",
            },
        ),
    )
}
"""The fields of every pooling route (vLLM's PoolingBasicRequestMixin, plus use_activation)."""

_REMOVED_TASKS = {
    "score": "`score` task was removed; use `classify` instead.",
    "encode": "`encode` task was removed; use `token_embed` or `token_classify` instead.",
}


@dataclass(frozen=True)
class PoolingRequest:
    """The common fields of a pooling request, read and checked."""

    request_id: str
    """The header's, the body's or a fresh id; the response id is "<prefix>-<this>"."""
    priority: int = 0
    truncation: PromptTruncation | None = None
    cache_salt: str | None = None
    use_activation: bool | None = None
    tokenizer_max_length: int | None = None
    """Where the tokenizer cuts texts: N for truncate_prompt_tokens N without a side; else,
    without truncation, one token past the context (a longer text is refused all the same,
    as vLLM, which then says "at least"); None when the tokens are sliced instead."""
    trace: RequestTrace | None = None
    """With --otlp-traces-endpoint, the trace its engine requests' spans join (tracing.py)."""


@dataclass
class Prompt:
    """One text (or token id list, or a cross-encoder's text pair) to pool, tokenized."""

    text: str | None
    token_ids: list[int]
    token_type_ids: list[int] | None = None
    """A BERT text pair's segment of each token (0 the first text, 1 the second); None for
    one text."""
    cut: bool = False
    """Tokenized with the tokenizer's cut (PoolingRequest.tokenizer_max_length)."""


def refuse_removed_fields(body: dict[str, Any]) -> None:
    """vLLM 0.32's 400s for what it removed: `normalize` (any value), the `score` and
    `encode` tasks."""
    if "normalize" in body:
        raise refusal(
            "Parameter `normalize` was removed; use `use_activation` instead.", "normalize"
        )
    task = body.get("task")
    if isinstance(task, str) and task in _REMOVED_TASKS:
        raise refusal(_REMOVED_TASKS[task], "task")


def read_pooling_request(
    state: ServerState, fields: BodyFields, headers: Mapping[str, str]
) -> PoolingRequest:
    """The common fields of `fields.body` (declared with COMMON_BODY), or a 400."""
    refuse_removed_fields(fields.body)
    refuse_request_mm_kwargs(fields.body)
    fields.get("user")  # checked, otherwise unused
    padding = fields.get("padding")
    if padding is not None and padding != "do_not_pad":
        if padding == "max_length":
            raise bad_parameter(
                "padding", padding, "padding 'max_length' is not supported by aioserve"
            )
        raise bad_parameter(
            "padding", shown_value(padding), "padding must be 'max_length' or 'do_not_pad'"
        )
    truncation = read_truncation(fields, state.engine.settings.max_model_len, pooling=True)
    by_tokenizer = (
        truncation is not None and truncation.keep > 0 and fields.get("truncation_side") is None
    )
    return PoolingRequest(
        request_id=headers.get("X-Request-Id") or fields.get("request_id") or uuid.uuid4().hex[:16],
        priority=fields.get("priority", 0),
        truncation=truncation,
        cache_salt=read_cache_salt(fields),
        use_activation=fields.get("use_activation"),
        tokenizer_max_length=(
            truncation.keep
            if by_tokenizer
            else state.engine.settings.max_model_len + 1
            if truncation is None
            else None
        ),
        trace=request_trace(state.tracer, headers, state.model_name),
    )


def pooling_task(engine: AsyncEngine) -> str:
    """The served model's pooling task: "embed" (an embedding model) or "classify" (a
    sequence classifier or cross-encoder)."""
    return engine.settings.pooler.task


def tokenizer_of(state: ServerState):
    """The engine's tokenizer, or a 400 when it is not loaded."""
    tokenizer = state.engine.tokenizer
    if tokenizer is None:
        raise APIError(
            "text input needs the tokenizer, which is not loaded (--skip-tokenizer-init): "
            "send token ids"
        )
    return tokenizer


async def tokenize_texts(
    state: ServerState,
    texts: Sequence[str],
    add_special_tokens: bool = True,
    max_length: int | None = None,
) -> list[list[int]]:
    """The token ids of `texts`, tokenized together on the text thread; with `max_length`,
    cut by the tokenizer (from the right, its special tokens kept)."""
    if not texts:
        return []
    tokenizer = tokenizer_of(state)
    kwargs: dict[str, Any] = {"add_special_tokens": add_special_tokens}
    if max_length is not None and getattr(tokenizer, "truncation_side", "right") == "right":
        kwargs.update(truncation=True, max_length=max_length)
    encoded = await state.off_loop(tokenizer, list(texts), **kwargs)
    return [list(ids) for ids in encoded.input_ids]


def checked_prompts(
    engine: AsyncEngine,
    prompts: list[Prompt],
    truncation: PromptTruncation | None,
    params: PoolingParams,
) -> list[Prompt]:
    """The prompts truncated as asked, each checked against the engine (a 400 naming the
    field at fault: "input_tokens" for a prompt too long, "dimensions", ...)."""
    if truncation is not None:
        prompts = [
            Prompt(
                p.text,
                truncation.apply(p.token_ids),
                None if p.token_type_ids is None else truncation.apply(p.token_type_ids),
                p.cut,
            )
            for p in prompts
        ]
    vocab_size = engine.hf_config.vocab_size
    for prompt in prompts:
        try:
            check_pooling_request(
                engine.settings, vocab_size, prompt.token_ids, params, cut_at_limit=prompt.cut
            )
        except InvalidRequest as error:
            raise bad_parameter(error.param, shown_value(error.value), str(error)) from None
    return prompts


def engine_prompt(prompt: Prompt, cache_salt: str | None) -> dict[str, Any]:
    """A prompt as the engine takes it (already tokenized; a pair with its token types),
    with the request's salt."""
    as_dict: dict[str, Any] = {"prompt": prompt.text, "prompt_token_ids": prompt.token_ids}
    if prompt.token_type_ids is not None:
        as_dict["token_type_ids"] = prompt.token_type_ids
    if cache_salt is not None:
        as_dict["cache_salt"] = cache_salt
    return as_dict


async def encode_all(
    engine: AsyncEngine,
    prompts: list[Prompt],
    params: PoolingParams,
    response_id: str,
    request: PoolingRequest,
    reservation: Reservation | None = None,
) -> list[PoolingRequestOutput]:
    """Every prompt's vector, the prompts run at once as requests "<response_id>-<i>".

    The first failure ends the others (they are aborted), as does the handler's
    cancellation (a client gone)."""
    tasks = [
        asyncio.ensure_future(
            _encode_one(
                engine,
                engine_prompt(prompt, request.cache_salt),
                params,
                f"{response_id}-{i}",
                request.priority,
                reservation,
                request.trace,
            )
        )
        for i, prompt in enumerate(prompts)
    ]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _encode_one(
    engine: AsyncEngine,
    prompt: dict[str, Any],
    params: PoolingParams,
    request_id: str,
    priority: int,
    reservation: Reservation | None,
    trace: RequestTrace | None,
) -> PoolingRequestOutput:
    """`engine.encode`, its errors as APIError (400 refused, 500 failed, 503 shed); its
    span sent with a `trace`."""
    pending = engine.encode(prompt, params, request_id, priority=priority)
    if reservation is not None:
        # Released just before `encode` registers the request, with no await in between.
        reservation.release(1)
    try:
        output = await pending
    except QueueFullError as error:
        raise overloaded(error) from None
    except InvalidRequest as error:
        raise bad_parameter(error.param, shown_value(error.value), str(error)) from None
    except ValueError as error:
        raise APIError(str(error)) from None
    except RuntimeError as error:  # the model step or the engine failed
        raise APIError(str(error), HTTPStatus.INTERNAL_SERVER_ERROR) from None
    if trace is not None:
        trace.pooling_finished(request_id, output)
    return output


def pooling_usage(num_prompt_tokens: int) -> dict[str, Any]:
    """vLLM's usage block of a pooling response: prompt tokens only, null details."""
    return full_usage(num_prompt_tokens, 0)
