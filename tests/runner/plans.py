"""Plain step plans for driving a ModelRunner without an engine: a few lines per step.

`PlanMaker` keeps what an engine would keep about each sequence (its known tokens, how far
it is computed, its blocks) and writes `StepPlan`s: `admit` a sequence, then `plan` a step
from (sequence, number of tokens) pairs, and `learn` the tokens a step sampled.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from aioserve.runner.model_runner import ModelRunner
from aioserve.runner.step_plan import NewSequence, SamplingSettings, SequenceChunk, StepPlan
from tests.models.tiny_models import hf_and_ours, tiny_configs

GREEDY = SamplingSettings(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, seed=0)


def tiny_runner(
    config_name: str = "llama-gqa4-llama3-rope",
    *,
    vocab_size: int | None = None,
    num_layers: int | None = None,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    compile_model: bool = False,
    row_weight_dtype: torch.dtype | None = None,
    packed_weights: bool = False,
    decode_graph_sizes: list[int] | None = None,
    max_seq_len_to_capture: int = 0,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
):
    """(transformers model, ModelRunner) on the same random weights, float32; the runner's
    model on `device`, in `dtype`."""
    config = tiny_configs()[config_name]
    if vocab_size is not None:
        config.vocab_size = vocab_size
    if num_layers is not None:
        config.num_hidden_layers = num_layers
    hf, ours = hf_and_ours(config, device=device)
    ours.to(dtype)
    runner = ModelRunner(
        ours,
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_model_len=config.max_position_embeddings,
        dtype=dtype,
        device=torch.device(device),
        compile_model=compile_model,
        row_weight_dtype=row_weight_dtype,
        packed_weights=packed_weights,
        decode_graph_sizes=decode_graph_sizes,
        max_seq_len_to_capture=max_seq_len_to_capture,
    )
    return hf, runner


@dataclass
class _Sequence:
    tokens: list[int]  # known to the "host"
    computed: int = 0
    pending: int = 0  # sampled by steps the host has not learned yet
    blocks: list[int] = field(default_factory=list)
    blocks_sent: int = 0


class PlanMaker:
    def __init__(self, block_size: int, num_blocks: int, seed: int = 0) -> None:
        self.block_size = block_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)  # physical blocks in no particular order
        self.seqs: dict[str, _Sequence] = {}
        self._new: list[NewSequence] = []
        self._left: list[str] = []

    def admit(
        self,
        seq_id: str,
        prompt: list[int],
        sampling: SamplingSettings = GREEDY,
        output: list[int] = (),
    ) -> None:
        self.seqs[seq_id] = _Sequence(tokens=list(prompt) + list(output))
        self._new.append(NewSequence(seq_id, list(prompt), list(output), sampling))

    def finish(self, seq_id: str) -> None:
        seq = self.seqs.pop(seq_id)
        self.free.extend(seq.blocks)
        self._left.append(seq_id)

    def plan(self, steps: list[tuple[str, int]], *, known: bool = True) -> StepPlan:
        """A step computing `n` more tokens of each named sequence.

        A sequence with a pending token decodes it as "the token sampled last step" unless
        `known`, in which case the caller must have `learn`ed it first.
        """
        chunks = []
        for seq_id, n in steps:
            seq = self.seqs[seq_id]
            start = seq.computed
            end = start + n
            while len(seq.blocks) * self.block_size < end:
                seq.blocks.append(self.free.pop())
            if end <= len(seq.tokens):
                token_ids = seq.tokens[start:end]
            else:
                assert not known and n == 1 and seq.pending, "that token is not known"
                token_ids = None
            samples = end == len(seq.tokens) + seq.pending
            chunks.append(
                SequenceChunk(seq_id, start, n, token_ids, seq.blocks[seq.blocks_sent :], samples)
            )
            seq.blocks_sent = len(seq.blocks)
            seq.computed = end
            seq.pending += samples
        plan = StepPlan(self._new, chunks, self._left)
        self._new, self._left = [], []
        return plan

    def learn(self, sampled: dict[str, list[int]]) -> None:
        for seq_id, tokens in sampled.items():
            if seq_id in self.seqs:
                self.seqs[seq_id].tokens += tokens
                self.seqs[seq_id].pending -= len(tokens)


def run_step(runner: ModelRunner, plan: StepPlan):
    """prepare, execute and collect one step (the CPU finishes a step in execute)."""
    output = runner.execute(runner.prepare(plan))
    if runner.device.type == "cpu":
        assert output.is_ready()
    output.wait()
    return runner.collect(output)


def record_padded_sizes(runner: ModelRunner) -> list[int]:
    """The batch size each padded decode step of `runner` runs at, appended as it runs."""
    sizes: list[int] = []
    run = runner.decode_graphs.run

    def recording_run(inputs, last_sampled):
        sizes.append(inputs.graph_size)
        return run(inputs, last_sampled)

    runner.decode_graphs.run = recording_run
    return sizes
