"""Gather the sampling settings of a step's sampled sequences into device tensors.

Everything per-row is built on the host in one pass and copied once. Work that only some
requests need (penalties, logit bias, banned tokens, logprobs) is left out of the batch
entirely when no row in it asks for it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aioserve.engine.request import Request
from aioserve.kernels.sampling import SamplingBatch


def _banned_tokens(request: Request, vocab_size: int) -> dict[int, float]:
    """Token biases a request needs beyond its logit_bias: -inf bans."""
    params = request.sampling_params
    bias: dict[int, float] = {}
    if params.allowed_token_ids:
        banned = torch.ones(vocab_size, dtype=torch.bool)
        banned[torch.tensor(params.allowed_token_ids, dtype=torch.int64)] = False
        bias.update(dict.fromkeys(banned.nonzero().flatten().tolist(), float("-inf")))
    if request.num_output_tokens < params.min_tokens:
        # vLLM's min_tokens: no stop token (nor EOS, unless ignored) before the minimum.
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= request.eos_token_ids
        bias.update((t, float("-inf")) for t in stop_ids if t < vocab_size)
    return bias


def build_sampling_batch(
    requests: Sequence[Request], vocab_size: int, device: torch.device
) -> SamplingBatch:
    params = [r.sampling_params for r in requests]
    num_rows = len(requests)

    def row_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    temperature = [0.0 if p.temperature < 1e-5 else p.temperature for p in params]
    all_greedy = all(t == 0.0 for t in temperature)

    uses_penalties = any(
        p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0
        for p in params
    )
    output_counts = prompt_mask = None
    if uses_penalties:
        output_counts = torch.zeros(num_rows, vocab_size, dtype=torch.int32)
        prompt_mask = torch.zeros(num_rows, vocab_size, dtype=torch.bool)
        for row, request in enumerate(requests):
            if request.output_token_ids:
                ids = torch.tensor(request.output_token_ids, dtype=torch.int64)
                output_counts[row].scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
            prompt_mask[row, torch.tensor(request.prompt_token_ids, dtype=torch.int64)] = True
        output_counts = output_counts.to(device)
        prompt_mask = prompt_mask.to(device)

    biases = []
    for request in requests:
        bias = dict(request.sampling_params.logit_bias or {})
        for token_id, value in _banned_tokens(request, vocab_size).items():
            bias[token_id] = value
        biases.append(bias)
    bias_ids = bias_values = None
    width = max((len(b) for b in biases), default=0)
    if width:
        bias_ids = torch.full((num_rows, width), -1, dtype=torch.int64)
        bias_values = torch.zeros((num_rows, width), dtype=torch.float32)
        for row, bias in enumerate(biases):
            if bias:
                bias_ids[row, : len(bias)] = torch.tensor(list(bias.keys()), dtype=torch.int64)
                bias_values[row, : len(bias)] = torch.tensor(
                    list(bias.values()), dtype=torch.float32
                )
        bias_ids = bias_ids.to(device)
        bias_values = bias_values.to(device)

    requested = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingBatch(
        temperature=row_tensor(temperature, torch.float32),
        # A top_k of the vocabulary or more keeps every token: the same as no top_k, and
        # an int32 cannot hold every top_k a request may ask for.
        top_k=row_tensor([p.top_k if p.top_k < vocab_size else -1 for p in params], torch.int32),
        top_p=row_tensor([p.top_p for p in params], torch.float32),
        min_p=row_tensor([p.min_p for p in params], torch.float32),
        seeds=row_tensor([r.seed for r in requests], torch.int64),
        steps=row_tensor([r.num_output_tokens for r in requests], torch.int64),
        presence_penalty=row_tensor([p.presence_penalty for p in params], torch.float32),
        frequency_penalty=row_tensor([p.frequency_penalty for p in params], torch.float32),
        repetition_penalty=row_tensor([p.repetition_penalty for p in params], torch.float32),
        output_token_counts=output_counts,
        prompt_token_mask=prompt_mask,
        bias_token_ids=bias_ids,
        bias_values=bias_values,
        num_logprobs=max(requested) if requested else -1,
        all_greedy=all_greedy,
        all_random=all(t > 0.0 for t in temperature),
    )
