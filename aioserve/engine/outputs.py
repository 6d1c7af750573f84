"""What the engine returns, in vLLM's shapes: RequestOutput, CompletionOutput, Logprob, and
PoolingRequestOutput for pooling (embedding) requests."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token: None for the first (nothing predicts it), then the token's
# own logprob and the top-n, as in SampleLogprobs.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One of a request's `n` samples."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic) of a request's life, for latency metrics."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # --collect-detailed-traces (step_timing.py): seconds in the model's forward passes and
    # in the model steps' execution, summed over the request's steps; None: not collected.
    model_forward_time: float | None = None
    model_execute_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None, repr=False)


@dataclass
class PoolingOutput:
    """vLLM's PoolingOutput: a pooling request's vector (an embedding, or a classifier's
    scores)."""

    data: torch.Tensor  # float32, 1-D, on the CPU

    @property
    def embedding(self) -> list[float]:
        """The vector as floats (vLLM's EmbeddingOutput.embedding)."""
        return self.data.tolist()

    @property
    def probs(self) -> list[float]:
        """A classifier's scores as floats (vLLM's ClassificationOutput.probs)."""
        return self.data.tolist()


@dataclass
class PoolingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    data: torch.Tensor  # float32, 1-D, on the CPU
    finished: bool = True
    metrics: RequestMetrics | None = field(default=None, repr=False)

    @property
    def outputs(self) -> PoolingOutput:
        """vLLM's spelling: `output.outputs.data`, `output.outputs.embedding`."""
        return PoolingOutput(self.data)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """vLLM's ScoringRequestOutput: one pair's score (`output.outputs.score`)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]  # the two texts' tokens, one after the other
    finished: bool = True
