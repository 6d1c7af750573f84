"""An engine's parts around a runner built elsewhere: the stand-in runner of the tests and
of bench/host_overhead.py, with vLLM's default settings for what they do not set."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from aioserve.engine.settings import EngineParts, EngineSettings


def engine_parts_around(
    runner,
    *,
    vocab_size: int,
    num_blocks: int,
    max_model_len: int,
    tokenizer: PreTrainedTokenizerBase | None = None,
    block_size: int = 16,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 4096,
    async_scheduling: bool = True,
    enable_prefix_caching: bool = True,
    eos_token_ids: frozenset[int] = frozenset(),
    max_num_queued_reqs: int | None = None,
    max_num_queued_tokens: int | None = None,
) -> EngineParts:
    """An engine's parts around a runner built elsewhere (a stand-in runner in tests and in
    the host-overhead benchmark), with these settings and vLLM's defaults for the rest."""
    settings = EngineSettings(
        model_name="stand-in",
        served_model_names=["stand-in"],
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_model_len=max_model_len,
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=True,
        enable_prefix_caching=enable_prefix_caching,
        scheduling_policy="fcfs",
        async_scheduling=async_scheduling,
        max_logprobs=20,
        seed=0,
        eos_token_ids=eos_token_ids,
        tokenizer_eos_token_id=None if tokenizer is None else tokenizer.eos_token_id,
        default_sampling={},
        max_new_tokens_cap=None,
        max_num_queued_reqs=max_num_queued_reqs,
        max_num_queued_tokens=max_num_queued_tokens,
    )
    hf_config = PretrainedConfig(vocab_size=vocab_size, max_position_embeddings=max_model_len)
    return EngineParts(settings=settings, tokenizer=tokenizer, runner=runner, hf_config=hf_config)
