"""What a request must pass before it enters the engine, the limits it gets there, and
the sequences it becomes (one, or n siblings, each with its seed)."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from aioserve.engine.request import Request
from aioserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from aioserve.engine.settings import EngineSettings

PromptType = str | dict[str, Any] | list[int]


class InvalidRequest(ValueError):
    """A request the engine refuses: the message, the request field at fault and its value.

    `param` names the field as the engine knows it ("prompt", "logprobs", "input_tokens"
    for the prompt's length, a SamplingParams field); the server names it as the route's
    body does."""

    def __init__(self, message: str, param: str, value: Any) -> None:
        super().__init__(message)
        self.param = param
        self.value = value


def cache_salt_of(prompt: PromptType) -> str | None:
    """A prompt dict's "cache_salt" (vLLM's prompt field), a non-empty string, or None."""
    if not isinstance(prompt, dict) or prompt.get("cache_salt") is None:
        return None
    salt = prompt["cache_salt"]
    if not isinstance(salt, str) or not salt:
        raise InvalidRequest("cache_salt must be a non-empty string", "cache_salt", salt)
    return salt


def tokenize_prompt(
    tokenizer: PreTrainedTokenizerBase | None, prompt: PromptType
) -> tuple[str | None, list[int]]:
    """(prompt text, prompt token ids) of a string, {"prompt": ...} or {"prompt_token_ids": ...}."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if "prompt" not in prompt:
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        prompt = prompt["prompt"]
    if isinstance(prompt, list):
        return None, [int(t) for t in prompt]
    if not isinstance(prompt, str):
        raise TypeError(
            f"a prompt must be a string, a token id list or a dict, got {type(prompt).__name__}"
        )
    if tokenizer is None:
        raise ValueError(
            "the tokenizer is not loaded (--skip-tokenizer-init): send prompt_token_ids"
        )
    return prompt, tokenizer(prompt).input_ids


def validate_request(
    settings: EngineSettings,
    vocab_size: int,
    has_tokenizer: bool,
    prompt_ids: list[int],
    params: SamplingParams,
) -> None:
    """Raise InvalidRequest for a request the engine refuses, with vLLM's server's messages.

    The one check of a prompt and its sampling parameters against the engine: the server
    runs it on every prompt of a request before it admits any (AsyncEngine.check_request),
    and add_request runs it again for callers that come straight to the engine."""
    s = settings
    vocab = vocab_size
    if not prompt_ids:
        raise InvalidRequest("the prompt cannot be empty", "prompt", "[]")
    # The length first: a prompt too long for the context is refused without a scan.
    if len(prompt_ids) >= s.max_model_len:
        excess = (
            "which exceeds this limit even without any output tokens"
            if len(prompt_ids) > s.max_model_len
            else "which leaves no room for any output token"
        )
        raise InvalidRequest(
            f"This model's maximum context length is {s.max_model_len} tokens. However, your "
            f"prompt contains {len(prompt_ids)} input tokens, {excess}. Please reduce the "
            "length of the input prompt.",
            "input_tokens",
            len(prompt_ids),
        )
    for token_id in prompt_ids:
        if not 0 <= token_id < vocab:
            raise InvalidRequest(_out_of_vocabulary(token_id, vocab), "prompt", token_id)
    _check_num_logprobs("sample", "logprobs", params.logprobs, s.max_logprobs, vocab)
    outside = [t for t in params.logprob_token_ids or () if not 0 <= t < vocab]
    if outside:
        raise InvalidRequest(
            f"token_id(s) {outside} in logprob_token_ids contain out-of-vocab token ids. "
            f"Vocabulary size: {vocab}",
            "logprob_token_ids",
            str(outside),  # as vLLM shows it
        )
    if params.bad_words and not has_tokenizer:
        raise InvalidRequest(
            "bad_words need the tokenizer, which is not loaded (--skip-tokenizer-init)",
            "bad_words",
            params.bad_words,
        )
    if params.stop and not has_tokenizer:
        raise InvalidRequest(
            "stop strings need the tokenizer, which is not loaded (--skip-tokenizer-init)",
            "stop",
            params.stop,
        )
    _check_num_logprobs("prompt", "prompt_logprobs", params.prompt_logprobs, s.max_logprobs, vocab)
    for field in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
        for token_id in getattr(params, field) or ():
            if not 0 <= token_id < vocab:
                raise InvalidRequest(_out_of_vocabulary(token_id, vocab), field, token_id)
    if params.thinking_token_budget is not None and not s.thinking_budgets:
        raise InvalidRequest(
            "thinking_token_budget is set but reasoning_config is not configured. Please set "
            "--reasoning-parser and/or --reasoning-config to use thinking_token_budget.",
            "thinking_token_budget",
            params.thinking_token_budget,
        )
    for processor in s.logits_processor_classes:  # --logits-processors
        try:
            processor.validate_params(params)
        except ValueError as error:
            raise InvalidRequest(str(error), "extra_args", params.extra_args) from error


def _check_num_logprobs(kind: str, field: str, wanted: int | None, cap: int, vocab: int) -> None:
    """`wanted` top logprobs (of sampled or prompt tokens) within --max-logprobs (-1: no
    cap) and within the vocabulary, which a top-n cannot exceed."""
    if wanted is None:
        return
    if cap != -1 and wanted > cap:
        limit = f"max allowed: {cap}"
    elif wanted > vocab:
        limit = f"the vocabulary size of {vocab}"
    else:
        return
    raise InvalidRequest(
        f"Requested {kind} logprobs of {wanted}, which is greater than {limit}", field, wanted
    )


def _out_of_vocabulary(token_id: int, vocab_size: int) -> str:
    return f"token id {token_id} is out of vocabulary (the model has {vocab_size} tokens)"


def max_new_tokens(settings: EngineSettings, prompt_len: int, params: SamplingParams) -> int:
    """Output tokens a request may produce: its max_tokens, capped by the context left."""
    room = settings.max_model_len - prompt_len
    limit = room if params.max_tokens is None else min(params.max_tokens, room)
    if settings.max_new_tokens_cap is not None:
        limit = min(limit, settings.max_new_tokens_cap)
    return limit


def sibling_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a seeded request: seed + index, kept in int64."""
    return (seed + index + 2**63) % 2**64 - 2**63


def sequence_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request's sequences: its own for n = 1, else "<id>#<index>" each."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


def new_sequences(
    settings: EngineSettings,
    ids: list[str],
    prompt_ids: list[int],
    params: SamplingParams,
    seed_rng: random.Random,
    *,
    priority: int,
    arrival_time: float,
    arrival_index: int,
    cache_salt: str | None = None,
    prompt_embeds: torch.Tensor | None = None,
    images: tuple = (),
) -> list[Request]:
    """One Request per sequence id, with its seed (the request's seed + index, else one
    drawn from `seed_rng`), its output-token limit, the request's place in the queue, its
    prefix-cache salt, its prompt's embeddings and images (the siblings share them)."""
    max_tokens = max_new_tokens(settings, len(prompt_ids), params)
    return [
        Request(
            request_id=sequence_id,
            prompt_token_ids=prompt_ids,
            sampling_params=params,
            seed=seed_rng.getrandbits(63) if params.seed is None else sibling_seed(params.seed, i),
            eos_token_ids=settings.eos_token_ids,
            eos_token_id=settings.tokenizer_eos_token_id,
            max_tokens=max_tokens,
            priority=priority,
            arrival_time=arrival_time,
            arrival_index=arrival_index,
            cache_salt=cache_salt,
            prompt_embeds=prompt_embeds,
            images=images,
        )
        for i, sequence_id in enumerate(ids)
    ]
