"""Decode steps from static buffers, padded to a set of batch sizes; on a GPU, replayed
from CUDA/HIP graphs captured at start-up.

At small batch a GPU decode step is paced by the host: each layer launches ~10 kernels
from Python, and Llama-3-8B's 32 layers cost more host time than device time. A graph
captured once per batch size replays the whole forward pass as one launch.

A graph reads its inputs from fixed addresses and launches fixed grids, so every step it
serves is laid out the same way:

- only decode steps: every sequence one token, none longer than
  `--max-seq-len-to-capture` (the attention kernel's grid is sized for that length);
- the batch is padded to the smallest captured size that holds it (`--cuda-graph-sizes`,
  vLLM's pattern 1, 2, 4, 8, 16, ... by default, up to --max-num-seqs). A padding row is a
  one-token sequence of length 1 that reads block 0 and writes no KV slot (slot -1); its
  output row is ignored;
- the step's arrays are copied into static device buffers of the largest size, the block
  table widened to the capture length.

Other steps (prefill chunks, larger batches, longer contexts) run as before. The padding
and the static buffers run on every platform; only CUDA and ROCm capture graphs (the CPU
runs the same padded step through the ordinary forward, which is how CI tests this
bookkeeping). `--enforce-eager` turns all of it off.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import replace

import numpy as np
import torch
from torch import Tensor

from aioserve.kernels.attention import plan_attention
from aioserve.models.attention_metadata import AttentionMetadata
from aioserve.models.step_context import KVCache, step_context
from aioserve.runner.compiled_step import ModelStep
from aioserve.runner.step_inputs import HostStepInputs, host_to_device

logger = logging.getLogger("aioserve")


def capture_sizes(
    requested: list[int], max_num_seqs: int, *, fine_grained: bool = False
) -> list[int]:
    """The batch sizes to pad decode steps to, as vLLM reads --cuda-graph-sizes.

    Nothing given: vLLM's default of one value, min(2 * max_num_seqs, 512). One value N:
    1, 2, 4, then every multiple of 8 up to N; `fine_grained` (vLLM 0.32's interactivity
    performance mode), every size from 1 to min(N, 32) instead of 1, 2, 4, so that small
    batches are barely padded. Several values: those. Sizes above max_num_seqs are dropped
    (no step is that large); sorted, without repeats.
    """
    if not requested:
        requested = [min(2 * max_num_seqs, 512)]
    if len(requested) == 1:
        largest = requested[0]
        small = range(1, min(largest, 32) + 1) if fine_grained else (1, 2, 4)
        sizes = [size for size in small if size <= largest]
        sizes += range(8, largest + 1, 8)
    else:
        sizes = requested
    return sorted({size for size in sizes if size <= max_num_seqs})


class DecodeGraphs:
    """Pads decode steps to the captured sizes (`pad`, host) and runs them (`run`, model
    thread); `capture` records a graph per size where the device has graphs."""

    def __init__(
        self,
        model_step: ModelStep,
        kv_caches: list[KVCache],
        *,
        sizes: list[int],
        max_seq_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        if not sizes:
            raise ValueError("decode graphs need at least one batch size")
        self.model_step = model_step
        self.kv_caches = kv_caches
        self.sizes = sizes
        self.max_seq_len = max_seq_len
        self.block_size = block_size
        self.device = device
        largest = sizes[-1]
        self.max_blocks = -(-max_seq_len // block_size)
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(
            (largest, self.max_blocks), dtype=torch.int32, device=device
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Tensor] = {}  # each graph's hidden states [size, hidden]

    # -- host, while the step is prepared ------------------------------------------------------

    def pad(self, inputs: HostStepInputs) -> HostStepInputs:
        """`inputs` padded to a captured size when this path serves the step, else as is."""
        num_seqs = inputs.seq_lens.size
        if (
            inputs.max_query_len != 1
            or inputs.embeds is not None  # the graphs take tokens only
            or inputs.input_ids.size != num_seqs
            or inputs.max_seq_len > self.max_seq_len
            or num_seqs > self.sizes[-1]
        ):
            return inputs
        size = self.sizes[bisect.bisect_left(self.sizes, num_seqs)]
        extra = size - num_seqs
        query_start_loc = np.arange(size + 1, dtype=np.int32)
        seq_lens = np.concatenate([inputs.seq_lens, np.ones(extra, dtype=np.int32)])
        block_tables = np.zeros((size, self.max_blocks), dtype=np.int32)
        block_tables[:num_seqs, : inputs.block_tables.shape[1]] = inputs.block_tables
        zeros = np.zeros(extra, dtype=np.int64)
        return replace(
            inputs,
            input_ids=np.concatenate([inputs.input_ids, zeros]),
            positions=np.concatenate([inputs.positions, zeros]),
            slot_mapping=np.concatenate([inputs.slot_mapping, zeros - 1]),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            attention_plan=plan_attention(
                query_start_loc, seq_lens, block_tables, self.block_size, self.device
            ),
            graph_size=size,
        )

    # -- the model thread ----------------------------------------------------------------------

    def run(self, inputs: HostStepInputs, last_sampled: Tensor) -> tuple[Tensor, Tensor]:
        """The padded step's hidden states [size, hidden] and its logits rows."""
        size = inputs.graph_size
        _copy_in(self.input_ids[:size], inputs.input_ids)
        inputs.fill_placeholders(self.input_ids, last_sampled)
        _copy_in(self.positions[:size], inputs.positions)
        _copy_in(self.slot_mapping[:size], inputs.slot_mapping)
        _copy_in(self.seq_lens[:size], inputs.seq_lens)
        _copy_in(self.block_tables[:size], inputs.block_tables)
        logits_indices = host_to_device(inputs.logits_indices, self.device)
        graph = self.graphs.get(size)
        if graph is not None:
            graph.replay()
            return self.outputs[size], logits_indices
        return self._forward(size, inputs.attention_plan), logits_indices

    def _forward(self, size: int, plan: object | None = None) -> Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            max_query_len=1,
            max_seq_len=self.max_seq_len,
            plan=plan,
            skips_kv_writes=True,
        )
        with step_context(meta, self.kv_caches):
            return self.model_step.forward(self.input_ids[:size], self.positions[:size])

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per size, largest first, all sharing one memory pool (a smaller
        graph reuses the larger's activations). The buffers hold padding while capturing,
        so the runs that record the graphs write no KV slot."""
        if self.device.type != "cuda":
            return
        started = time.monotonic()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._forward(size)  # compiles the Triton kernels for this size, outside the graph
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured decode graphs for %d batch sizes (%s) up to %d tokens of context in %.1f s",
            len(self.sizes),
            _size_list(self.sizes),
            self.max_seq_len,
            time.monotonic() - started,
        )

    def recapture(self) -> None:
        """Capture the graphs again: the memory they read has moved (a wake from sleep)."""
        self.graphs.clear()
        self.outputs.clear()
        self.capture()


def _copy_in(target: Tensor, array: np.ndarray) -> None:
    """`array` into the static buffer `target`; from pinned memory, asynchronously, on a GPU."""
    source = torch.from_numpy(array)
    if target.device.type == "cpu":
        target.copy_(source)
    else:
        target.copy_(source.pin_memory(), non_blocking=True)


def _size_list(sizes: list[int]) -> str:
    if len(sizes) <= 6:
        return ", ".join(map(str, sizes))
    return f"{', '.join(map(str, sizes[:4]))}, ..., {sizes[-1]}"
