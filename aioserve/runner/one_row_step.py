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
at warm-up (on a Zen 5 EPYC ~36 s with inductor's cache cold, ~4.5 s warm; in float32 on an
AVX2 Zen 3 with one thread 61 s and 10 s) and never at serve time: a step
that would compile it again (a guard failing) turns it off with a warning, and that step
and every later one take the other graphs.
"""

from __future__ import annotations

import logging
import time
import types

import torch
from torch import Tensor, nn

from aioserve.kernels import decode_in_pool, dispatch
from aioserve.kernels.decode_gathered_traced import gathered_blocks
from aioserve.kernels.decode_in_pool_traced import rows_in_pool
from aioserve.models.attention_metadata import AttentionMetadata
from aioserve.models.step_context import KVCache, StepContext, current_step, step_context
from aioserve.runner.layer_dispatch import CompiledGraph, graph_accepting

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
    """`forward(step, input_ids, positions)` for the steps `serves(step)` accepts."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self._model = model
        self._dtype = dtype
        self._num_q_heads = model.config.num_attention_heads
        self._in_pool = True  # the attention's form (forward_and_logits), set at warm-up
        self._function = _copy_of(forward_and_logits)
        # Every size static but the block count (marked at warm-up): with dynamo's automatic
        # dynamic shapes, an engine built after one of another block size in this process
        # took the pool's block size as symbolic, and compiling the graph failed.
        self._compiled = torch.compile(
            self._function, fullgraph=True, dynamic=False, options=COMPILE_OPTIONS
        )
        self.ready = False
        self._graph: CompiledGraph | None = None  # the graph the guards last accepted
        self._settings: tuple = ()  # _settings() when they did

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
        """The step's hidden row and its logits; None when the graph would have to compile
        again, after which this step (and every later one) takes the other graphs.

        The graph's guards (every layer's modules and weights, ~1 ms on a Zen 5 EPYC, an
        eighth of the token) are checked on the first step and whenever the settings a
        trace reads change (`_settings`); other steps call the graph's bytecode directly,
        as layer_dispatch.py does. Its inputs are `step`'s tensors (the current step's),
        with fixed dtypes and shapes but for the block count, which the graph takes as
        dynamic."""
        # forward_and_logits's arguments
        args = (self._model, input_ids, positions, self._num_q_heads, self._in_pool)
        if self._graph is not None and self._settings == _settings():
            return self._graph.call(*args)
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                out = self._compiled(*args)
        except RuntimeError as error:
            if "Detected recompile" not in str(error):  # torch's is a plain RuntimeError
                raise
            logger.warning("the one-row step's graph no longer fits, not used again: %s", error)
            self.ready = False
            return None
        self._graph = graph_accepting(self._function, args)
        self._settings = _settings()
        return out

    @torch.inference_mode()
    def warm_up(self, kv_caches: list[KVCache], max_model_len: int) -> None:
        """Compile the graph on a decode of a sequence two blocks long, check that one of
        three blocks runs it without compiling, and make it ready; leave it unused where
        the pool is neither read in place nor gathered in the graph (`attends_in_graph`)
        or compiling fails (with a warning). Where sequences (`max_model_len`, the pool)
        are shorter, the lengths are cut to fit: the rotary table and the pool end there."""
        key_cache, value_cache = kv_caches[0]
        if not attends_in_graph(key_cache, value_cache, self._dtype):
            return
        self._in_pool = decode_in_pool.reads_in_place(key_cache, value_cache, self._dtype)
        started = time.monotonic()
        block_size = key_cache.shape[1]
        longest = min(max_model_len, key_cache.shape[0] * block_size)
        lengths = (min(block_size + 2, longest - 1), min(3 * block_size, longest))
        try:
            for length, first in zip(lengths, (True, False), strict=True):
                meta = _decode_at(length, block_size, key_cache.device)
                if first:
                    torch._dynamo.decorators.mark_unbacked(meta.block_tables, 1)
                stance = "default" if first else "fail_on_recompile"
                ids = torch.zeros(1, dtype=torch.int64, device=key_cache.device)
                positions = torch.full_like(ids, length - 1)
                with step_context(meta, kv_caches), torch.compiler.set_stance(stance):
                    self._compiled(self._model, ids, positions, self._num_q_heads, self._in_pool)
        except Exception as error:  # noqa: BLE001 - any failure leaves the other graphs
            logger.warning(
                "compiling the one-row step failed, its steps take the layer graphs: %s: %s",
                type(error).__name__,
                error,
            )
            return
        self.ready = True
        logger.info("compiled the one-row step in %.1f s", time.monotonic() - started)


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


def _copy_of(function: types.FunctionType) -> types.FunctionType:
    """`function` with a code object of its own.

    dynamo keeps the graphs it compiles from a function on the function's code object, up
    to 8 of them (its recompile limit), and this graph guards on the model's own objects:
    each engine built in one process compiled one more on the shared code object, whose
    old graphs stayed there. The ninth engine's one-row step failed to compile, and every
    closed engine's graph stayed in memory. Its own copy goes with the step."""
    return types.FunctionType(
        function.__code__.replace(),
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )


def _settings() -> tuple:
    """The global settings a trace of the step reads, which its guards check."""
    return (
        dispatch.kernel_backend(),
        dispatch.batch_invariant(),
        torch.is_inference_mode_enabled(),
        torch.is_grad_enabled(),
    )


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
