"""Reading the bodies of /v1/completions and /v1/chat/completions into what the engine needs.

A body is a plain dict (decoded by orjson). Each field is read with the type its
declaration in request_schema.py gives (the same declarations make /openapi.json's request
schemas); a wrong type is a 400 naming the field and the value. Fields it knows
but cannot honour (`suffix`, beam search, ...) are
refused, so a request never silently means something else. Other fields are ignored, as
OpenAI and vLLM ignore them, and logged as vLLM logs them: once a body is accepted, its
keys outside the fields vLLM 0.32's request model for the route has (request_fields.py)
are logged at DEBUG, "The following fields were present in the request but ignored:
{'foo'}" (body_fields.log_ignored_fields).

Sampling fields become one `SamplingParams`; its own `ValueError`s become 400s naming the
field ("max_tokens must be at least 1, got -1. (parameter=max_tokens, value=-1)", vLLM's
wording). Defaults follow vLLM: a field the request leaves out takes the model's generation
config value (`engine.settings.default_sampling`), then SamplingParams' default; completions
default to `max_tokens=16` (OpenAI's; an explicit `"max_tokens": null` too, as vLLM resets
it), chat to the rest of the context. A max_tokens past the room the context leaves after
the prompt is cut to that room, as vLLM cuts it; one past the context itself is a 400.

What needs the prompt's tokens (its length and token ids, and with them the checks of the
sampling parameters against the engine: logprobs, token ids in logit_bias, ...) is
`check_prompt`, called by the handlers on every prompt once tokenized: the engine's own
check (engine/admission.py), so a request is validated by one piece of code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from aioserve.engine.admission import InvalidRequest
from aioserve.engine.async_engine import AsyncEngine
from aioserve.engine.beam_search import BeamSearchParams
from aioserve.engine.lora_requests import LoRARequest
from aioserve.engine.sampling_params import (
    SamplingParams,
)
from aioserve.server.beam_search_route import (
    beam_search_params,
    refuse_with_beam_search,
    sampling_body,
)
from aioserve.server.body_fields import (
    BodyFields,
    check_prompt_count,
    log_ignored_fields,
    optional_bool,
    shown_value,
)
from aioserve.server.chat_template import (
    BOTH_GENERATION_FLAGS,
    refuse_request_mm_kwargs,
    refuse_request_template,
)
from aioserve.server.chat_template import template_kwargs as template_kwargs_of
from aioserve.server.errors import APIError, bad_parameter, refusal
from aioserve.server.prompt_embeds_field import read_prompt_embeds
from aioserve.server.prompt_truncation import PromptTruncation, read_truncation
from aioserve.server.reasoning import reasoning_end_marker, thinks
from aioserve.server.request_fields import CHAT_COMPLETION_FIELDS, COMPLETION_FIELDS
from aioserve.server.request_schema import (
    CHAT_BODY,
    COMPLETION_BODY,
    REASONING_EFFORTS,
    STREAM_OPTIONS_BODY,
)
from aioserve.server.sampling_fields import sampling_params_of
from aioserve.server.state import ServerState
from aioserve.server.structured_output_fields import body_field, read_structured_outputs
from aioserve.server.tools import ToolUse, read_tool_use

if TYPE_CHECKING:
    import torch

PromptInput = str | list[int]

# Fields vLLM knows that aioserve cannot honour yet: refused when set to anything but "off".
_UNSUPPORTED: dict[str, str] = {
    "suffix": "suffix is not supported",
    "functions": "function calling is not supported by aioserve yet",
    "logits_processors": "logits processors are not supported by aioserve",
    # vLLM request fields that would change the prompt, the output or its isolation.
    "return_token_offsets": "return_token_offsets is not supported by aioserve yet",
    "watermarking": "watermarking is not supported by aioserve",
    "kv_transfer_params": "KV transfer is not supported by aioserve",
    "ec_transfer_params": "encoder cache transfer is not supported by aioserve",
    "mm_payload": "mm_payload is not supported by aioserve yet (images go as image_url parts)",
    "mm_processor_kwargs": "mm_processor_kwargs are not supported by aioserve yet",
    "media_io_kwargs": "media_io_kwargs are not supported by aioserve yet",
    "return_mm_kwargs": "return_mm_kwargs is not supported by aioserve yet",
}
# Fields aioserve does not honour yet whose value is refused unless it is vLLM's default
# for the route: (field, completions default, chat default; None: any value is honoured).
_DEFAULT_ONLY = (("add_special_tokens", True, None),)


# vLLM's limits on a cache salt (entrypoints/generate/base/protocol.py).
MAX_CACHE_SALT_LENGTH = 128
CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")

# vLLM's header for a request's priority (entrypoints/generate/base/serving.py).
PRIORITY_HEADER = "X-Vllm-Priority"


@dataclass
class GenerationRequest:
    """What both routes share: the sampling parameters and how to answer."""

    request_id: str
    """The caller's `request_id`, or a fresh hex id; response ids are built on it."""
    params: SamplingParams
    max_tokens_field: str
    """The field max_tokens came from (max_tokens or max_completion_tokens), for errors."""
    logprobs_field: str
    """The field the number of logprobs came from (logprobs, or chat's top_logprobs)."""
    stream: bool = False
    include_usage: bool = False
    continuous_usage_stats: bool = False
    priority: int = 0
    return_token_ids: bool = False
    tokens_as_token_ids: bool | None = None
    """`return_tokens_as_token_ids`: logprobs name tokens "token_id:<id>"; None: the
    server's --return-tokens-as-token-ids (vLLM's rule: the request's value wins)."""
    structured_output_field: str = "structured_outputs"
    """The field the structured output came from (response_format, guided_json, ...)."""
    truncation: PromptTruncation | None = None
    """`truncate_prompt_tokens` / `truncation_side`: how to cut the tokenized prompt."""
    cache_salt: str | None = None
    """Only requests with the same salt share prefix-cache blocks with this one."""
    beam_search: BeamSearchParams | None = None
    """`use_beam_search`: the search (beam_search_route.py); None: sampling."""

    def engine_prompt(
        self, text: str | None, token_ids: list[int], embeds: torch.Tensor | None = None
    ) -> dict[str, Any]:
        """The prompt as the engine takes it (its embeddings, if it was sent as such), with
        the request's cache salt."""
        prompt: dict[str, Any] = (
            {"prompt": text, "prompt_token_ids": token_ids}
            if embeds is None
            else {"prompt_embeds": embeds}
        )
        if self.cache_salt is not None:
            prompt["cache_salt"] = self.cache_salt
        return prompt

    def tokens_as_ids(self, server_default: bool) -> bool:
        """Whether logprobs name tokens "token_id:<id>": the request's choice, else the
        server's --return-tokens-as-token-ids."""
        return server_default if self.tokens_as_token_ids is None else self.tokens_as_token_ids


@dataclass
class CompletionRequest(GenerationRequest):
    prompts: list[PromptInput] = field(default_factory=list)
    prompt_embeds: list[str] = field(default_factory=list)
    """Prompts sent as embeddings, base64 (prompt_embeds_field.py); they come first."""
    echo: bool = False
    echo_only: bool = False
    """echo with max_tokens 0: the answer is the prompt alone (one token is generated and
    not shown, as in vLLM: what log-likelihood harnesses send)."""


@dataclass
class ChatRequest(GenerationRequest):
    messages: list[dict[str, Any]] = field(default_factory=list)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    """The template's variables as vLLM merges them (chat_template.template_kwargs): the
    server's defaults, the request's chat_template_kwargs, documents, reasoning_effort."""
    chat_template: str | None = None
    """The request's own chat template (with --trust-request-chat-template), or None."""
    add_special_tokens: bool = False
    """Tokenize the rendered prompt adding the tokenizer's special tokens (BOS...) too."""
    tool_use: ToolUse = field(default_factory=lambda: ToolUse(None))
    """What the chat template gets as `tools`, and how the output becomes calls (tools.py)."""
    include_reasoning: bool = True
    """With --reasoning-parser: send the reasoning (reasoning.py), or drop it."""
    echo: bool = False
    """Start the reply with the last message's content when the reply continues its role."""
    return_prompt_text: bool = False
    """Send the prompt as the engine got it (the rendered template) as `prompt_text`."""
    images: list[Any] = field(default_factory=list)
    """The messages' images (chat_images.py), read by chat_prompt."""

    def engine_prompt(
        self, text: str | None, token_ids: list[int], embeds: torch.Tensor | None = None
    ) -> dict[str, Any]:
        prompt = super().engine_prompt(text, token_ids, embeds)
        if self.images:
            prompt["multi_modal_data"] = {"image": self.images}
        return prompt


def check_serving(state: ServerState, body: dict[str, Any]) -> LoRARequest | None:
    """503 while the server drains; 404 when `model` names no served model nor adapter.
    The LoRA adapter `model` names, if it names one."""
    if state.draining:
        raise APIError(
            "the server is shutting down and takes no new requests",
            HTTPStatus.SERVICE_UNAVAILABLE,
        )
    model = body.get("model")
    if model is None:
        return None
    if not isinstance(model, str):
        raise bad_parameter("model", shown_value(model), "model must be a string")
    if model in state.served_model_names:
        return None
    lora = state.loras.lora_request(model)
    if lora is None:
        raise APIError(
            f"The model `{model}` does not exist. Served models: "
            f"{', '.join(state.served_model_names)}.",
            HTTPStatus.NOT_FOUND,
            param="model",
        )
    return lora


def parse_completion_request(
    state: ServerState, body: dict[str, Any], headers: Mapping[str, str] | None = None
) -> CompletionRequest:
    """Validate a /v1/completions body."""
    _refuse_unsupported(body, chat=False)
    refuse_with_beam_search(body, chat=False)
    fields = BodyFields(sampling_body(body), COMPLETION_BODY)
    max_tokens = fields.get("max_tokens", 16)  # OpenAI's default, for null too (as vLLM)
    logprobs = fields.get("logprobs")
    echo = fields.get("echo", False)
    echo_only = echo and max_tokens == 0
    if fields.get("logprob_token_ids"):
        if echo_only:
            raise refusal(
                "`logprob_token_ids` is not supported when `echo=True` and `max_tokens=0` "
                "because no output tokens are generated.",
                "logprob_token_ids",
            )
        if logprobs is None:
            raise refusal(
                "when using `logprob_token_ids`, `logprobs` must be set.", "logprob_token_ids"
            )
    structured_outputs, structured_output_field = read_structured_outputs(fields)
    params = sampling_params_of(
        state,
        fields,
        1 if echo_only else max_tokens,
        "max_tokens",
        # vLLM's: the chosen tokens replace the top ones (an echoed prompt keeps its top).
        None if fields.get("logprob_token_ids") else logprobs,
        "logprobs",
        _prompt_logprobs(fields, logprobs if echo else None),
        structured_outputs,
    )
    prompt_embeds = read_prompt_embeds(body.get("prompt_embeds"))
    if prompt_embeds:
        _refuse_with_prompt_embeds(echo, fields.get("prompt_logprobs"))
    prompt = body.get("prompt")
    if prompt is None or prompt == "":  # vLLM's "empty"
        if not prompt_embeds:
            raise refusal(
                "Either prompt or prompt_embeds must be provided and non-empty.", "prompt"
            )
        prompts = []
    else:
        prompts = _prompts(prompt)
    request = CompletionRequest(
        prompts=prompts,
        prompt_embeds=prompt_embeds,
        echo=echo,
        echo_only=echo_only,
        structured_output_field=structured_output_field,
        **_generation_fields(state, fields, headers or {}, params, "max_tokens", "logprobs"),
    )
    request.beam_search = beam_search_params(body, params, structured_output_field, max_tokens)
    log_ignored_fields(body, COMPLETION_FIELDS)
    return request


def _refuse_with_prompt_embeds(echo: bool, prompt_logprobs: int | None) -> None:
    """What a request with prompt_embeds cannot ask for (vLLM's refusals)."""
    if echo:
        raise APIError("Echo is unsupported with prompt embeds.")
    if prompt_logprobs is not None:
        raise APIError("prompt_logprobs is not compatible with prompt embeds.")


def parse_chat_request(
    state: ServerState, body: dict[str, Any], headers: Mapping[str, str] | None = None
) -> ChatRequest:
    """Validate a /v1/chat/completions body (the messages themselves: see chat_template)."""
    kwargs = body.get("chat_template_kwargs")
    chat_template = body.get("chat_template")
    refuse_request_template(
        chat_template,
        kwargs if isinstance(kwargs, dict) else None,
        trusted=state.frontend.trust_request_chat_template,
    )
    refuse_request_mm_kwargs(body)
    if body.get("add_generation_prompt") is True and body.get("continue_final_message") is True:
        raise APIError(BOTH_GENERATION_FLAGS)
    _refuse_unsupported(body, chat=True)
    refuse_with_beam_search(body, chat=True)
    fields = BodyFields(sampling_body(body), CHAT_BODY)
    messages = body.get("messages")
    if messages is None:
        raise APIError("the field `messages` is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise bad_parameter("messages", shown_value(messages), "messages must be a non-empty array")
    # max_completion_tokens replaces the deprecated max_tokens; either may be sent.
    max_tokens_field = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    max_tokens = fields.get(max_tokens_field)
    wants_logprobs = fields.get("logprobs", False)
    if fields.get("logprob_token_ids") and not wants_logprobs:
        raise refusal(
            "when using `logprob_token_ids`, `logprobs` must be set to true.",
            "logprob_token_ids",
        )
    top_logprobs = fields.get("top_logprobs")
    if top_logprobs is not None:
        if top_logprobs < 0:
            raise bad_parameter("top_logprobs", top_logprobs, "top_logprobs must be non-negative")
        if top_logprobs > 0 and not wants_logprobs:
            raise bad_parameter(
                "top_logprobs", top_logprobs, "when using top_logprobs, logprobs must be true"
            )
    logprobs = (top_logprobs or 0) if wants_logprobs else None
    if fields.get("logprob_token_ids"):
        logprobs = None  # vLLM's: the chosen tokens replace the top ones
    echo = fields.get("echo", False)
    structured_outputs, structured_output_field = read_structured_outputs(fields)
    tool_use = read_tool_use(fields, state.frontend)
    if tool_use.constraint is not None:
        if structured_outputs is not None:
            raise bad_parameter(
                "tool_choice",
                shown_value(fields.get("tool_choice")),
                f"tool_choice {fields.get('tool_choice', 'required')} constrains the output, "
                f"and so does {structured_output_field}: give one",
            )
        # A structural tag that fails to compile fails on a tool's schema.
        forced_by = "tools" if tool_use.constraint.structural_tag is not None else "tool_choice"
        structured_outputs, structured_output_field = tool_use.constraint, forced_by
    elif tool_use.call_tag is not None and structured_outputs is None:
        structured_outputs, structured_output_field = tool_use.call_tag, "tools"
    params = sampling_params_of(
        state,
        fields,
        max_tokens,
        max_tokens_field,
        logprobs,
        "top_logprobs",
        # vLLM's top_logprobs defaults to 0, so echo alone asks for the prompt's logprobs.
        _prompt_logprobs(fields, (top_logprobs or 0) if echo else None),
        structured_outputs,
    )
    if tool_use.parser is not None and not tool_use.parser.skip_special_tokens:
        params.skip_special_tokens = False  # its markers are special tokens (vLLM does so too)
    template_kwargs = template_kwargs_of(
        state.frontend.default_chat_template_kwargs,
        fields.get("chat_template_kwargs"),
        documents=_documents(body.get("documents")),
        reasoning_effort=_reasoning_effort(body.get("reasoning_effort")),
    )
    in_reasoning = state.engine.settings.structured_outputs.enable_in_reasoning
    reasoning_parser = state.engine.settings.reasoning_parser
    if (
        params.structured_outputs is not None
        and not in_reasoning
        and thinks(reasoning_parser, template_kwargs)
    ):
        # The answer after the reasoning is constrained.
        params.reasoning_end = reasoning_end_marker(reasoning_parser)
    request = ChatRequest(
        messages=messages,
        add_generation_prompt=fields.get("add_generation_prompt", True),
        continue_final_message=fields.get("continue_final_message", False),
        chat_template_kwargs=template_kwargs,
        chat_template=chat_template,
        add_special_tokens=optional_bool(body, "add_special_tokens", False),
        tool_use=tool_use,
        echo=echo,
        include_reasoning=fields.get("include_reasoning", True),
        return_prompt_text=fields.get("return_prompt_text", False),
        structured_output_field=structured_output_field,
        **_generation_fields(
            state, fields, headers or {}, params, max_tokens_field, "top_logprobs"
        ),
    )
    request.beam_search = beam_search_params(body, params, structured_output_field, max_tokens)
    log_ignored_fields(body, CHAT_COMPLETION_FIELDS)
    return request


def _documents(value: Any) -> list[dict[str, str]] | None:
    """Chat `documents` for the template: objects of strings, as vLLM's field types them."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in value
    ):
        raise bad_parameter(
            "documents",
            shown_value(value),
            "documents must be an array of objects whose values are strings",
        )
    return value


def _reasoning_effort(value: Any) -> str | None:
    if value is not None and value not in REASONING_EFFORTS:
        raise bad_parameter(
            "reasoning_effort",
            shown_value(value),
            f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}",
        )
    return value


def check_prompt(
    engine: AsyncEngine, token_ids: list[int], request: GenerationRequest, prompt_field: str
) -> SamplingParams:
    """The request's sampling parameters for this tokenized prompt: max_tokens cut to the
    room the context leaves after it (vLLM's get_max_tokens). 400 for a prompt the engine
    refuses with them (engine/admission.py: its length, its token ids, the logprobs, ...),
    the field named as the route's body names it, or for a max_tokens past the context."""
    max_tokens, max_model_len = request.params.max_tokens, engine.settings.max_model_len
    if max_tokens is not None and max_tokens > max_model_len:
        field_name = request.max_tokens_field
        raise bad_parameter(
            field_name,
            max_tokens,
            f"{field_name}={max_tokens} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
        )
    try:
        engine.check_request(token_ids, request.params)
    except InvalidRequest as error:
        renamed = {
            "prompt": prompt_field,
            "logprobs": request.logprobs_field,
            "extra_args": "vllm_xargs",
        }
        param = renamed.get(error.param, error.param)
        if param.startswith("structured_outputs"):
            param = body_field(param, request.structured_output_field)
        raise bad_parameter(param, shown_value(error.value), str(error)) from None
    room = max_model_len - len(token_ids)
    if max_tokens is None or max_tokens <= room:
        return request.params
    try:  # shallow: the compiled structured output stays shared
        return dataclasses.replace(request.params, max_tokens=room)
    except ValueError as error:  # e.g. a min_tokens past the room
        raise APIError(str(error)) from None


def _refuse_unsupported(body: dict[str, Any], chat: bool) -> None:
    for name, reason in _UNSUPPORTED.items():
        if body.get(name) not in (None, False, [], {}, ""):
            raise bad_parameter(name, shown_value(body[name]), reason)
    for name, *defaults in _DEFAULT_ONLY:
        default = defaults[chat]
        if default is not None and body.get(name) not in (None, default):
            raise bad_parameter(
                name,
                shown_value(body[name]),
                f"only {name}={str(default).lower()} (vLLM's default here) is supported by "
                "aioserve yet",
            )


def _prompt_logprobs(fields: BodyFields, echoed: int | None) -> int | None:
    """The prompt logprobs wanted: the request's `prompt_logprobs` (vLLM's field), else with
    echo the number of logprobs wanted for the output (`echoed`), so that the echoed prompt
    has logprobs too. Not with stream=true, where vLLM has nowhere to put them."""
    wanted = fields.get("prompt_logprobs")
    if wanted is not None and wanted > 0 and fields.get("stream", False):
        raise bad_parameter(
            "prompt_logprobs", wanted, "`prompt_logprobs` are not available when `stream=True`."
        )
    return wanted if wanted is not None else echoed


def _generation_fields(
    state: ServerState,
    fields: BodyFields,
    headers: Mapping[str, str],
    params: SamplingParams,
    max_tokens_field: str,
    logprobs_field: str,
) -> dict[str, Any]:
    """The fields both routes share. As vLLM's, an X-Request-Id header names the request
    ahead of the body's request_id, and an integer X-Vllm-Priority header sets its
    priority ahead of the body's (which the fcfs policy, vLLM's default, ignores)."""
    stream = fields.get("stream", False)
    stream_options = fields.get("stream_options")
    if stream_options and not stream:  # vLLM lets an empty {} through
        raise bad_parameter(
            "stream_options", shown_value(stream_options), "stream_options needs stream=true"
        )
    options = BodyFields(stream_options or {}, STREAM_OPTIONS_BODY, "stream_options.")
    include_usage = options.get("include_usage", False)
    continuous_usage = options.get("continuous_usage_stats", False)
    if state.frontend.enable_force_include_usage:  # vLLM: both, whatever the request says
        include_usage = continuous_usage = True
    fields.get("user")  # OpenAI's end-user id: checked, otherwise unused
    priority = fields.get("priority", 0)
    with contextlib.suppress(ValueError):
        priority = int(headers.get(PRIORITY_HEADER, priority))
    return {
        "request_id": headers.get("X-Request-Id")
        or fields.get("request_id")
        or uuid.uuid4().hex[:16],
        "params": params,
        "max_tokens_field": max_tokens_field,
        "logprobs_field": logprobs_field,
        "stream": stream,
        "include_usage": include_usage,
        # Usage in every chunk only when usage is asked for at all (vLLM's rule).
        "continuous_usage_stats": include_usage and continuous_usage,
        "priority": priority,
        "return_token_ids": fields.get("return_token_ids", False),
        "tokens_as_token_ids": fields.get("return_tokens_as_token_ids"),
        "truncation": read_truncation(fields, state.engine.settings.max_model_len),
        "cache_salt": read_cache_salt(fields),
    }


def read_cache_salt(fields: BodyFields) -> str | None:
    """`cache_salt`, checked as vLLM 0.32 checks it (validate_cache_salt)."""
    salt = fields.get("cache_salt")
    if salt is None:
        return None
    if not salt:
        raise bad_parameter(
            "cache_salt", '""', "Parameter 'cache_salt' must be a non-empty string if provided."
        )
    if len(salt) > MAX_CACHE_SALT_LENGTH or any(c in CACHE_SALT_FORBIDDEN for c in salt):
        raise bad_parameter(
            "cache_salt",
            shown_value(salt),
            "Parameter 'cache_salt' must be at most 128 characters and must not contain "
            "'@', '/', '\\\\', or NUL.",
        )
    return salt


def _prompts(prompt: Any) -> list[PromptInput]:
    """A completions `prompt` as a list of prompts: strings or token id lists."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad_parameter(
            "prompt",
            shown_value(prompt),
            "prompt must be a string, an array of strings, an array of token ids or an array "
            "of token id arrays",
        )
    check_prompt_count(len(prompt), "prompt")
    for item in prompt:
        ok = isinstance(item, str) or (isinstance(item, list) and all(_is_int(t) for t in item))
        if not ok:
            raise bad_parameter(
                "prompt", shown_value(item), "each prompt must be a string or an array of token ids"
            )
        if not item:
            raise bad_parameter("prompt", shown_value(item), "the prompt cannot be empty")
    return prompt


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
