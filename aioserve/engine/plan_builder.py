"""From the scheduler's decisions about live requests to the runner's plain `StepPlan`.

The runner never sees a `Request`: a sequence entering it gets a `NewSequence` (its prompt,
the tokens it already produced, its sampling settings) and every scheduled chunk becomes a
`SequenceChunk` naming its tokens and the KV blocks its table gained since the last plan.
"""

from __future__ import annotations

import numpy as np
import torch

from aioserve.engine.kv_cache_manager import KVCacheManager
from aioserve.engine.multimodal import ImageRows
from aioserve.engine.request import Request
from aioserve.runner.step_plan import NewSequence, SamplingSettings, SequenceChunk


def sampling_settings(request: Request) -> SamplingSettings:
    params = request.sampling_params
    banned = set(params.stop_token_ids or ())
    if not params.ignore_eos:
        banned |= request.eos_token_ids
    return SamplingSettings(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        seed=request.seed,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias=dict(params.logit_bias or {}),
        allowed_token_ids=tuple(params.allowed_token_ids) if params.allowed_token_ids else None,
        min_tokens=params.min_tokens,
        # vLLM's min_tokens: no stop token (nor EOS, unless ignored) before the minimum.
        min_tokens_banned_ids=tuple(sorted(banned)) if params.min_tokens else (),
        # With chosen tokens: the sampled token's logprob and rank, then theirs.
        logprobs=0 if params.logprob_token_ids else params.logprobs,
        logprob_token_ids=tuple(params.logprob_token_ids or ()) or None,
        prompt_logprobs=params.prompt_logprobs,
        thinking_token_budget=params.thinking_token_budget,
    )


def new_sequence(request: Request) -> NewSequence:
    return NewSequence(
        seq_id=request.request_id,
        # The placeholders of a prompt of embeddings are no tokens for penalties to count.
        prompt_token_ids=request.prompt_token_ids if request.prompt_embeds is None else [],
        output_token_ids=list(request.output_token_ids),
        sampling=sampling_settings(request),
        token_type_ids=request.token_type_ids,
        lora_id=request.lora_id,
        lora_adapter=request.lora_adapter,
        params=request.sampling_params,
    )


def sequence_chunk(
    request: Request,
    start: int,
    num_tokens: int,
    samples: bool,
    kv_cache: KVCacheManager,
    drafts: list[int] | None = None,
) -> SequenceChunk:
    """The chunk start..start+num_tokens of `request`, its last tokens its `drafts` if it
    has some; marks its new blocks as sent."""
    table = kv_cache.block_table(request.request_id)
    new_block_ids = table[request.num_blocks_sent :]
    request.num_blocks_sent = len(table)
    end = start + num_tokens
    num_known = len(request.prompt_token_ids) + len(request.output_token_ids)  # num_tokens
    if drafts:
        token_ids = request.token_ids_range(start, end - len(drafts)) + drafts
        return SequenceChunk(
            request.request_id, start, num_tokens, token_ids, new_block_ids, samples, len(drafts)
        )
    if end <= num_known:
        token_ids = request.token_ids_range(start, end)
    elif num_tokens == 1 and start == num_known:
        token_ids = None  # sampled by the step still running: the runner has it
    else:
        raise AssertionError(
            f"chunk {start}..{end} of {request.request_id!r} reaches past its known tokens "
            f"({num_known}) by more than one pending token"
        )
    if request.prompt_embeds is not None and start < len(request.prompt_token_ids):
        return SequenceChunk(
            request.request_id, start, num_tokens, token_ids, new_block_ids, samples,
            embeds=request.prompt_embeds[start:end],
        )  # fmt: skip
    if request.images and start < len(request.prompt_token_ids):
        rows = image_rows_in(request.images, start, end)
        if rows is not None:
            return SequenceChunk(
                request.request_id, start, num_tokens, token_ids, new_block_ids, samples,
                embeds=rows[1], embed_rows=rows[0],
            )  # fmt: skip
    # Positional: keyword arguments cost a third of a microsecond more, for every chunk.
    return SequenceChunk(request.request_id, start, num_tokens, token_ids, new_block_ids, samples)


def image_rows_in(
    images: tuple[ImageRows, ...], start: int, end: int
) -> tuple[np.ndarray, torch.Tensor] | None:
    """The rows of prompt positions start..end that images fill: their offsets from
    `start` and their values; None when no image reaches into the chunk."""
    offsets, values = [], []
    for image in images:
        first, last = max(start, image.offset), min(end, image.offset + len(image.values))
        if first < last:
            offsets.append(np.arange(first - start, last - start, dtype=np.int64))
            values.append(image.values[first - image.offset : last - image.offset])
    if not offsets:
        return None
    return np.concatenate(offsets), torch.cat(values)
