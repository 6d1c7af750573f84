"""The runner of a pooling (encoder-only) model: each step a batch of whole prompts, each
result their pooled hidden states.

It keeps the ModelRunner's contract (prepare on the event loop, execute on the model
thread, collect once the output is ready) and takes the same `StepPlan`, but an encoder
keeps nothing from one step to the next: no KV cache, no sampling state. The engine
schedules a pooling request's prompt whole (chunked prefill is off for a pooling model),
so every chunk of a step is a prompt from its first token; the step packs them one after
another (with their token types, a BERT pair's segments, when a prompt has them), runs
the model with their boundaries (`cu_seqlens`), and pools each prompt's hidden states as
the model's pooler says (models/pooler.py); a sequence classifier's head then turns each
pooled row into logits. The vectors go back as float32 on the CPU; cutting, normalizing
or activating them per request is the engine's business.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from aioserve.models.pooler import pool
from aioserve.runner.cudagraph_stats import CUDAGraphSettings, CUDAGraphStat
from aioserve.runner.step_plan import StepPlan, StepResult


@dataclass
class PreparedPooling:
    """A pooling step's inputs, built on the host."""

    seq_ids: list[str]  # in batch order
    input_ids: torch.Tensor  # int64 [tokens]: the prompts packed one after another
    positions: torch.Tensor  # int64 [tokens]: each token's place in its prompt
    token_type_ids: torch.Tensor | None  # int64 [tokens], when a prompt has segments
    cu_seqlens: torch.Tensor  # int32 [prompts + 1]: where each prompt starts, then the end
    max_seqlen: int


@dataclass
class PooledStep:
    """A pooling step's vectors, on their way to the host."""

    seq_ids: list[str]
    pooled: torch.Tensor  # float32 [prompts, hidden]
    done: torch.cuda.Event | None = None  # recorded after the copy to the host (GPU)

    def is_ready(self) -> bool:
        return self.done is None or self.done.query()

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()


class PoolingRunner:
    kv_caches: list = []  # an encoder keeps no KV cache (the load report reads this)
    graph_settings = CUDAGraphSettings()  # no graphs: every step runs eagerly

    def __init__(
        self,
        model: nn.Module,
        *,
        pooling_type: str,
        classify: bool,
        max_num_batched_tokens: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.pooling_type = pooling_type
        self.classify = classify  # a sequence classifier: its head turns the pooled rows to logits
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.device = device

    def warm_up(self) -> None:
        """Run one step of the most tokens a step may hold, in prompts of the longest
        length, so that the first request meets no first-call costs (and a step the device
        cannot hold fails at start)."""
        length = min(self.max_model_len, self.max_num_batched_tokens)
        count = max(1, self.max_num_batched_tokens // length)
        lengths = [length] * count
        self.execute(self._pack([f"warm-up-{i}" for i in range(count)], [[0] * n for n in lengths]))
        if self.device.type != "cpu":
            torch.cuda.synchronize(self.device)

    # -- host, while earlier steps may still run -----------------------------------------------

    def prepare(self, plan: StepPlan) -> PreparedPooling:
        # A prompt's segments come with its sequence, which enters in the step that runs it.
        entering = {s.seq_id: s.token_type_ids for s in plan.new_sequences}
        for chunk in plan.chunks:
            if chunk.start != 0 or not chunk.samples or chunk.token_ids is None:
                raise RuntimeError(
                    f"a pooling step runs whole prompts; sequence {chunk.seq_id!r} came as "
                    f"tokens {chunk.start}..{chunk.start + chunk.num_tokens}"
                )
            if chunk.seq_id not in entering:
                raise RuntimeError(
                    f"a pooling prompt runs in the step it enters; {chunk.seq_id!r} entered before"
                )
        segments = {seq_id: types for seq_id, types in entering.items() if types}
        return self._pack(
            [c.seq_id for c in plan.chunks],
            [c.token_ids for c in plan.chunks],
            [segments.get(c.seq_id) for c in plan.chunks] if segments else None,
        )

    @staticmethod
    def _pack(
        seq_ids: list[str],
        prompts: list[list[int]],
        token_types: list[list[int] | None] | None = None,
    ) -> PreparedPooling:
        lengths = [len(p) for p in prompts]
        types = None
        if token_types is not None:
            rows = [
                t if t is not None else [0] * n for t, n in zip(token_types, lengths, strict=True)
            ]
            types = torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=torch.int64)
        return PreparedPooling(
            seq_ids=seq_ids,
            input_ids=torch.tensor(list(itertools.chain.from_iterable(prompts)), dtype=torch.int64),
            positions=torch.cat([torch.arange(n, dtype=torch.int64) for n in lengths]),
            token_type_ids=types,
            cu_seqlens=torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32),
            max_seqlen=max(lengths),
        )

    @staticmethod
    def graph_stat(step: PreparedPooling) -> CUDAGraphStat:
        """--cudagraph-metrics: the step's tokens, unpadded (runner/cudagraph_stats.py)."""
        return CUDAGraphStat.eager(step.input_ids.numel())

    # -- the model thread ---------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, step: PreparedPooling) -> PooledStep:
        device = self.device
        cu_seqlens = step.cu_seqlens.to(device, non_blocking=True)
        types = step.token_type_ids
        hidden = self.model(
            step.input_ids.to(device, non_blocking=True),
            step.positions.to(device, non_blocking=True),
            cu_seqlens,
            step.max_seqlen,
            None if types is None else types.to(device, non_blocking=True),
        )
        pooled = pool(hidden, cu_seqlens, self.pooling_type)
        pooled = self.model.classify(pooled) if self.classify else pooled.float()
        output = PooledStep(step.seq_ids, pooled)
        if device.type != "cpu":
            output.pooled = pooled.to("cpu", non_blocking=True)
            output.done = torch.cuda.Event()
            output.done.record()
        return output

    # -- host, once the step's vectors are ready ------------------------------------------------

    def collect(self, output: PooledStep) -> StepResult:
        pooled = dict(zip(output.seq_ids, output.pooled.unbind(0), strict=True))
        return StepResult({}, {}, pooled=pooled)
