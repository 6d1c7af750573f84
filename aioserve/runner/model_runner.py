"""Runs model steps: owns the model, the KV-cache memory, and sampling.

`prepare` is host work done on the event loop; `execute` runs on the engine's executor
thread (torch releases the GIL while it computes) and returns plain Python results, so
it is the one place where the host waits for the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from aioserve.engine.scheduler import SchedulerOutput
from aioserve.kernels.sampling import SamplingBatch, sample
from aioserve.runner.sampling_inputs import build_sampling_batch
from aioserve.runner.step_inputs import StepInputs, build_step_inputs


@dataclass
class TokenLogprobs:
    """Raw logprobs around one sampled token: its own, its rank, and the top-n."""

    sampled_logprob: float
    sampled_rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class PreparedStep:
    inputs: StepInputs
    sampling: SamplingBatch | None
    logprobs_wanted: list[int | None]  # per sampled row: the request's `logprobs` setting


@dataclass
class StepResult:
    sampled: dict[str, list[int]]  # request id -> tokens sampled this step
    logprobs: dict[str, list[TokenLogprobs]]  # only for requests that asked


def kv_cache_shape(config, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return (num_blocks, block_size, num_kv_heads, head_dim)


def kv_cache_bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
    _, _, num_kv_heads, head_dim = kv_cache_shape(config, 1, block_size)
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * num_kv_heads * head_dim * element_size


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.vocab_size = model.config.vocab_size
        shape = kv_cache_shape(model.config, num_blocks, block_size)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(model.config.num_hidden_layers)
        ]

    def prepare(self, output: SchedulerOutput, block_table_of) -> PreparedStep:
        inputs = build_step_inputs(output, block_table_of, self.block_size, self.device)
        # Same order as the logits rows: the chunks that sample, in batch order.
        sampled_requests = [c.request for c in output.chunks if c.samples]
        sampling = (
            build_sampling_batch(sampled_requests, self.vocab_size, self.device)
            if sampled_requests
            else None
        )
        return PreparedStep(
            inputs=inputs,
            sampling=sampling,
            logprobs_wanted=[r.sampling_params.logprobs for r in sampled_requests],
        )

    @torch.inference_mode()
    def execute(self, step: PreparedStep) -> StepResult:
        inputs = step.inputs
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attention)
        if step.sampling is None:
            return StepResult({}, {})
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        out = sample(logits, step.sampling)
        token_ids = out.token_ids.tolist()
        ids = inputs.sampling_request_ids
        sampled = {request_id: [token] for request_id, token in zip(ids, token_ids, strict=True)}
        logprobs: dict[str, list[TokenLogprobs]] = {}
        if out.logprobs is not None:
            lp = out.logprobs
            sampled_logprob = lp.sampled_logprob.tolist()
            sampled_rank = lp.sampled_rank.tolist()
            top_ids = lp.top_token_ids.tolist()
            top_values = lp.top_logprobs.tolist()
            for row, (request_id, wanted) in enumerate(zip(ids, step.logprobs_wanted, strict=True)):
                if wanted is None:
                    continue
                logprobs[request_id] = [
                    TokenLogprobs(
                        sampled_logprob[row],
                        sampled_rank[row],
                        top_ids[row][:wanted],
                        top_values[row][:wanted],
                    )
                ]
        return StepResult(sampled, logprobs)
