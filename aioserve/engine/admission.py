"""What a request must pass before it enters the engine, and the limits it gets there."""

from __future__ import annotations

from aioserve.engine.build import EngineSettings
from aioserve.engine.sampling_params import SamplingParams


def validate_request(
    settings: EngineSettings,
    vocab_size: int,
    has_tokenizer: bool,
    prompt_ids: list[int],
    params: SamplingParams,
) -> None:
    """Raise ValueError (vLLM's messages where vLLM has one) for a request the engine refuses."""
    s = settings
    if not prompt_ids:
        raise ValueError("the prompt cannot be empty")
    if len(prompt_ids) >= s.max_model_len:
        raise ValueError(
            f"The decoder prompt (length {len(prompt_ids)}) is longer than the maximum model "
            f"length of {s.max_model_len}. Make sure that `max_model_len` is no smaller than "
            "the number of text tokens plus one output token."
        )
    vocab = vocab_size
    if any(t < 0 or t >= vocab for t in prompt_ids):
        raise ValueError(f"prompt token ids must be in [0, {vocab}), the model's vocabulary")
    if params.logprobs is not None and s.max_logprobs != -1 and params.logprobs > s.max_logprobs:
        raise ValueError(
            f"Requested sample logprobs of {params.logprobs}, which is greater than max allowed: {s.max_logprobs}"
        )
    if params.logprobs is not None and params.logprobs > vocab:
        # Reachable with --max-logprobs -1 (no limit); a top-n cannot exceed the vocabulary.
        raise ValueError(
            f"Requested sample logprobs of {params.logprobs}, which is greater than the "
            f"vocabulary size of {vocab}"
        )
    if params.stop and not has_tokenizer:
        raise ValueError(
            "stop strings need the tokenizer, which is not loaded (--skip-tokenizer-init)"
        )
    if params.prompt_logprobs is not None:
        raise ValueError("prompt_logprobs is not supported by aioserve yet")
    for field in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
        for token_id in getattr(params, field) or ():
            if not 0 <= token_id < vocab:
                raise ValueError(
                    f"token id {token_id} in {field} is outside the vocabulary of {vocab}"
                )


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
