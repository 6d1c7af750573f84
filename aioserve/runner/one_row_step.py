"""The step of one decoding row, compiled whole into one C++ program.

At one stream a decode step is one row, and on a 2-core CPU its ~30 layers' Python cost as
much as a tenth of the token: each layer enters its compiled graph (compiled_step.py)
through Python, and the graph calls the attention and the int4 products as custom ops
whose bodies are Python. Here the whole forward (embedding, every layer, final norm) and
the output head are one graph: the attention traced as torch ops
(kernels/decode_in_pool_traced.py, the pool rows it reads worked out in the graph), the
int4 products as torch's op and a tied head as a multiply-reduce loop (models/linear.py),
and inductor's C++ wrapper calling them in turn, the graph's guards checked only when they
could have changed (`forward`). On a Zen 5 EPYC one stream went from 8.0-8.7 to 6.6-7.3 ms
a token in process, and to 6.2-6.3 ms with the head in the graph (bench/RESULTS.md).

It serves the steps it can: one row, one sequence, sampling, in a pool read in place
(bfloat16, or float32 on a CPU without AVX-512: kv_cache.decodes_weigh_in_place), or a
float32 pool whose blocks the graph gathers (kernels/decode_gathered_traced.py) under
float32 compute; others take the graphs of compiled_step.py. It is compiled
at warm-up by torch's ahead-of-time compile and filed on disk (graph_archive.py); a later
start with the same model and pool reads it back, in 1.3 s in float32 on a 2-core AVX2
Zen 3, where tracing it again before inductor's cache answered took ~10 s of every start
(4.5 s on a Zen 5). That compile does not read inductor's cache: a start that finds no
graph filed for its model compiles it in full (~50 s on the Zen 3; ~36 s on the Zen 5 with
the cache cold). It is never compiled at serve time: a step its guards refuse turns it off
with a warning, and that step and every later one take the other graphs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from aioserve.kernels import decode_in_pool
from aioserve.kernels.decode_gathered_traced import gathered_blocks
from aioserve.kernels.decode_in_pool_traced import rows_in_pool
from aioserve.models.attention_metadata import AttentionMetadata
from aioserve.models.step_context import KVCache, StepContext, current_step, step_context
from aioserve.runner.graph_archive import (
    archive_path,
    compile_ahead_of_time,
    module_structure,
    portable_guards,
    read_or_compile,
    trace_settings,
)

logger = logging.getLogger("aioserve")

# Inductor's options for this graph: its wrapper in C++, built apart from the kernels (a
# cold compile took 35 s so, 75 s built together).
COMPILE_OPTIONS = {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}


def forward_and_logits(
    model: nn.Module, input_ids: Tensor, positions: Tensor, num_q_heads: int, in_pool: bool
) -> tuple[Tensor, Tensor]:
    """The step's hidden rows and their logits: what the graph computes.

    What the attention reads is worked out first, once for every layer, into the step's
    context, where each layer's traced attention finds it (models/paged_attention_op.py
    `attend_layer`): the pool rows it weighs in place (`in_pool`), or the blocks it
    gathers."""
    step = current_step()
    key_cache, value_cache = step.kv_caches[0]
    meta = step.meta
    if in_pool:
        step.traced_decode = rows_in_pool(
            meta.block_tables, meta.seq_lens, key_cache, value_cache, num_q_heads
        )
    else:
        step.traced_decode = gathered_blocks(meta.block_tables, meta.seq_lens, key_cache.shape[1])
    hidden = model(input_ids, positions)
    return hidden, model.compute_logits(hidden)


class OneRowStep:
    """`forward(step, input_ids, positions)` for the steps `serves(step)` accepts.

    `own_layer_forward()` is a context in which the model's layers run their class's own
    forward, not the layer graphs' dispatch: the graph is traced, and its guards checked,
    in it."""

    def __init__(
        self,
        model: nn.Module,
        dtype: torch.dtype,
        own_layer_forward: Callable[[], AbstractContextManager],
    ) -> None:
        self._model = model
        self._dtype = dtype
        self._num_q_heads = model.config.num_attention_heads
        self._in_pool = True  # the attention's form (forward_and_logits), set at warm-up
        self._own_layer_forward = own_layer_forward
        self.ready = False
        self._graph: Any = None  # what torch's ahead-of-time compile made, or read back
        self._settings: tuple | None = None  # trace_settings() when the guards last accepted

    def serves(self, step: StepContext, num_rows: int, num_sampled: int) -> bool:
        """Whether the step is one row of one sequence writing its slot and sampling, its
        block table as wide as its blocks, and ready."""
        meta = step.meta
        block_size = step.kv_caches[0][0].shape[1]
        return (
            self.ready
            and num_rows == 1
            and num_sampled == 1
            and meta.seq_lens.shape[0] == 1
            and meta.block_tables.shape[1] == -(-meta.max_seq_len // block_size)
            and int(meta.slot_mapping[0]) >= 0
        )

    def forward(
        self, step: StepContext, input_ids: Tensor, positions: Tensor
    ) -> tuple[Tensor, Tensor] | None:
        """The step's hidden row and its logits; None when the graph's guards refuse the
        step, after which this step (and every later one) takes the other graphs.

        The guards (every layer's modules and weights, ~1 ms on a Zen 5 EPYC, an eighth of
        the token) are checked on the first step and whenever the settings a trace reads
        change (graph_archive.trace_settings); other steps call the graph's bytecode directly, as
        layer_dispatch.py does. Its inputs are `step`'s tensors (the current step's), with
        fixed dtypes and shapes but for the block count, which the graph takes as
        dynamic."""
        args = (self._model, input_ids, positions, self._num_q_heads, self._in_pool)
        if self._settings != trace_settings():
            if not self._accepts(args):
                logger.warning(
                    "the one-row step's graph no longer fits (its guards refuse the step), "
                    "not used again"
                )
                self.ready = False
                return None
            self._settings = trace_settings()
        return self._graph.fn(*args)

    def _accepts(self, args: tuple) -> bool:
        with self._own_layer_forward():
            return bool(self._graph.guard_check(*args))

    @torch.inference_mode()
    def warm_up(self, kv_caches: list[KVCache], max_model_len: int) -> None:
        """Read the graph filed for this model and pool (graph_archive.py), or compile it on
        a decode of a sequence two blocks long and file it; check that a decode of three
        blocks runs it, and make it ready. Leave it unused where the pool is neither read
        in place nor gathered in the graph (`attends_in_graph`) or compiling fails (with a
        warning). Where sequences (`max_model_len`, the pool) are shorter, the lengths are
        cut to fit: the rotary table and the pool end there."""
        key_cache, value_cache = kv_caches[0]
        if not attends_in_graph(key_cache, value_cache, self._dtype):
            return
        self._in_pool = decode_in_pool.reads_in_place(key_cache, value_cache, self._dtype)
        started = time.monotonic()
        block_size = key_cache.shape[1]
        longest = min(max_model_len, key_cache.shape[0] * block_size)
        first, second = min(block_size + 2, longest - 1), min(3 * block_size, longest)
        try:
            path = archive_path("one_row_step", self._archive_parts(kv_caches))
            with self._own_layer_forward():
                read = self._read_or_compile(path, kv_caches, first)
                with step_context(_decode_at(second, block_size, key_cache.device), kv_caches):
                    args = self._decode_args(second, key_cache.device)
                    if not self._graph.guard_check(*args):
                        raise RuntimeError(f"its guards refuse a decode {second} tokens long")
                    self._graph.fn(*args)
        except Exception as error:  # noqa: BLE001 - any failure leaves the other graphs
            logger.warning(
                "compiling the one-row step failed, its steps take the layer graphs: %s: %s",
                type(error).__name__,
                error,
            )
            self._graph = None
            return
        self.ready = True
        self._settings = None  # the first step checks the guards
        logger.info(
            "%s the one-row step in %.1f s",
            "read the compiled graph of" if read else "compiled",
            time.monotonic() - started,
        )

    def _read_or_compile(self, path: Path, kv_caches: list[KVCache], length: int) -> bool:
        """Set the graph: the one filed at `path` where its guards accept a decode `length`
        tokens long (True), else one compiled on that decode and filed there (False)."""
        block_size = kv_caches[0][0].shape[1]
        meta = _decode_at(length, block_size, kv_caches[0][0].device)
        args = self._decode_args(length, kv_caches[0][0].device)

        def compile_graph() -> Any:
            # Every size static but the block count: with dynamo's automatic dynamic
            # shapes, an engine built after one of another block size in this process took
            # the pool's block size as symbolic, and compiling the graph failed.
            torch._dynamo.decorators.mark_unbacked(meta.block_tables, 1)
            compiled = torch.compile(
                forward_and_logits,
                fullgraph=True,
                dynamic=False,
                options={**COMPILE_OPTIONS, "guard_filter_fn": portable_guards},
            )
            return compile_ahead_of_time(compiled, args)

        with step_context(meta, kv_caches):
            self._graph, read = read_or_compile(
                path,
                forward_and_logits.__globals__,
                lambda graph: graph.guard_check(*args),
                compile_graph,
            )
        return read

    def _decode_args(self, length: int, device: torch.device) -> tuple:
        """forward_and_logits's arguments for a decode at position `length - 1`."""
        ids = torch.zeros(1, dtype=torch.int64, device=device)
        positions = torch.full_like(ids, length - 1)
        return (self._model, ids, positions, self._num_q_heads, self._in_pool)

    def _archive_parts(self, kv_caches: list[KVCache]) -> dict[str, Any]:
        """What the graph's trace read that its guards cannot check once read back: the
        model's structure beside the pool's and the settings, to tell graphs apart."""
        return {
            "model": module_structure(self._model),
            "pool": [
                (str(cache.dtype), tuple(cache.shape), cache.stride()) for cache in kv_caches[0]
            ],
            "pool_layers": len(kv_caches),
            "in_pool": self._in_pool,
            "num_q_heads": self._num_q_heads,
            "settings": trace_settings(),
            "options": COMPILE_OPTIONS,
        }


def attends_in_graph(key_cache: Tensor, value_cache: Tensor, dtype: torch.dtype) -> bool:
    """Whether the graph can trace the attention of decodes computing in `dtype` over this
    pool: a CPU's pool read in place (decode_in_pool.reads_in_place), or a float32 one
    whose blocks it gathers (kernels/decode_gathered_traced.py). Other caches (fp8 with
    their scales, float16) take the layer graphs."""
    if key_cache.device.type != "cpu":
        return False
    if decode_in_pool.reads_in_place(key_cache, value_cache, dtype):
        return True
    return dtype == torch.float32 and key_cache.dtype == value_cache.dtype == dtype


def _decode_at(length: int, block_size: int, device: torch.device) -> AttentionMetadata:
    """A decode of one sequence `length` slots long over the pool's first blocks, writing
    its last slot: for warm-up, before any request holds a block (the pool's contents then
    are anybody's)."""
    blocks = -(-length // block_size)
    return AttentionMetadata(
        slot_mapping=torch.tensor([length - 1], dtype=torch.int64, device=device),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([length], dtype=torch.int32, device=device),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=device).unsqueeze(0),
        max_query_len=1,
        max_seq_len=length,
        skips_kv_writes=False,
    )
