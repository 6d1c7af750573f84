"""The model's decoder layers and output head, compiled for the CPU by torch's compiler.

Inductor turns a decoder layer into generated C++ loops with the token count dynamic: the
attention stays an opaque custom op (models/paged_attention_op.py), everything else
(RMSNorm with its residual add, the dense layers, rotary, the SiLU gate) is fused where
inductor can. For a single-token step, dense layers become multiply-reduce loops that read
each weight once at close to memory speed (models/linear.py); the output head too. Given a
`row_weight_dtype` (bfloat16, chosen by dtype auto on a float32 CPU), those loops read
copies of the weights in that dtype: half the bytes. Given `packed_weights` (a bfloat16
model on a CPU with bfloat16 arithmetic), every dense product is instead oneDNN's matmul on
weights packed once (models/linear.py `pack_weights`), an opaque op in the graph; a MoE
model's experts are packed too (models/moe.py).

Every layer runs the same code with its own weights as inputs and its index as a
symbolic integer, so one compiled graph serves all of them: compiling costs one layer,
not the whole model. A step checks that graph's guards once, not once a layer
(layer_dispatch.py). Token counts: one graph for 1 (decode at one stream), and one for the
other counts on each side of linear.SMALL_BATCH_ROWS, the count symbolic; the head
likewise for 1 row and for more. `warm_up` compiles all of them when the engine starts, so
no request waits for a compile, by torch's ahead-of-time compile, and files them beside
inductor's cache (TORCHINDUCTOR_CACHE_DIR, by default /tmp/torchinductor_<user>): a later
start reads them back (ahead_graphs.py). If compiling fails (no C++ compiler, an
unsupported model), the step runs eagerly and a warning names the cause. A step of one
decoding row in a bfloat16 pool runs instead one graph of the whole forward and the head,
its wrapper C++ (one_row_step.py), compiled after the others. `--enforce-eager` skips
compiling altogether. GPUs run the step eagerly, their decode steps replayed from CUDA/HIP
graphs (decode_graphs.py).
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch
from torch import Tensor, nn

from aioserve.models.attention_metadata import AttentionMetadata
from aioserve.models.linear import SMALL_BATCH_ROWS, keep_row_weights, pack_weights
from aioserve.models.moe import pack_expert_weights
from aioserve.models.prompt_embeds import PromptEmbeds
from aioserve.models.step_context import KVCache, current_step, step_context
from aioserve.platform import current_platform
from aioserve.runner.layer_dispatch import LayerDispatch
from aioserve.runner.one_row_step import OneRowStep
from aioserve.runner.step_plan import StepPlan

logger = logging.getLogger("aioserve")


class ModelStep:
    """`forward(input_ids, positions)` and `logits(hidden_rows)`, compiled or eager."""

    def __init__(
        self,
        model: nn.Module,
        *,
        compiled: bool,
        dtype: torch.dtype,
        row_weight_dtype: torch.dtype | None = None,
        packed_weights: bool = False,
    ) -> None:
        self.model = model
        self.compiled = compiled
        self._logits = model.compute_logits
        if packed_weights:
            added = pack_weights(model)
            pack_expert_weights(model)
            logger.info(
                "dense products run oneDNN on its packed layout of the weights "
                "(%.0f MiB more memory, the output head's copy)",
                added / 2**20,
            )
        # The dtype of the row copies given to the model (None: none), for `derive_weights`.
        self.row_weight_dtype = row_weight_dtype if compiled else None
        if self.row_weight_dtype is not None:
            added = keep_row_weights(model, self.row_weight_dtype)
            logger.info(
                "single-row products read %s copies of the weights (%.0f MiB more memory)",
                str(row_weight_dtype).removeprefix("torch."),
                added / 2**20,
            )
        if compiled:
            hash_compiler_versions_in_the_background()
            trust_cpu_flags_for_vector_code()
            layer_forward = type(model.layers[0]).forward
            self._layers = LayerDispatch(model.layers, layer_forward, _compile(layer_forward))
            self._layers.install()
            head = type(model).compute_logits
            self._head = LayerDispatch([model], head, _compile(head))
            self._logits = functools.partial(self._head.call, 0)
        self._one_row = OneRowStep(model, dtype, self._layers.uninstalled) if compiled else None

    def derive_weights(self, model: nn.Module) -> nn.Module:
        """`model`, the served model loaded again, given the row copies this step gave its
        own (a level-2 wake copies them back: runner/sleep_memory.py)."""
        if self.row_weight_dtype is not None:
            keep_row_weights(model, self.row_weight_dtype)
        return model

    def forward(
        self, input_ids: Tensor, positions: Tensor, embeds: PromptEmbeds | None = None
    ) -> Tensor:
        """The step's hidden rows; rows given as `embeds` take those in place of their
        tokens' embeddings."""
        with _one_graph_for_every_layer():
            return self.model(input_ids, positions, embeds)

    def may_run_whole(self, plan: StepPlan) -> bool:
        """Whether the step of `plan` will likely run the graph of a one-row step: the
        graph is ready, and the step is one token (not an embedding) of one sequence that
        samples."""
        chunks = plan.chunks
        return (
            self._one_row is not None
            and self._one_row.ready
            and len(chunks) == 1
            and chunks[0].num_tokens == 1
            and chunks[0].samples
            and chunks[0].embeds is None
        )

    def forward_and_logits(
        self,
        input_ids: Tensor,
        positions: Tensor,
        logits_indices: Tensor,
        embeds: PromptEmbeds | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """The step's hidden rows and the logits of its rows `logits_indices` (None where
        there are none)."""
        if self._one_row is not None and embeds is None:
            step = current_step()
            if self._one_row.serves(step, input_ids.shape[0], logits_indices.shape[0]):
                out = self._one_row.forward(step, input_ids, positions)
                if out is not None:
                    return out
        hidden = self.forward(input_ids, positions, embeds)
        if not logits_indices.shape[0]:
            return hidden, None
        return hidden, self.logits(hidden[logits_indices])

    def logits(self, hidden: Tensor) -> Tensor:
        with _one_graph_for_every_layer():
            return self._logits(hidden)

    def run_eagerly(self) -> None:
        self.compiled = False
        self._logits = self.model.compute_logits
        self._layers.uninstall()
        self._one_row = None

    @torch.inference_mode()
    def warm_up(self, kv_caches: list[KVCache], max_model_len: int) -> None:
        """Compile every graph a step can need, for sequences of up to `max_model_len`
        tokens; on failure, fall back to eager with a warning."""
        if not self.compiled:
            return
        started = time.monotonic()
        device = kv_caches[0][0].device
        # The kernels read the platform from a module global that is set on first use: set
        # before the first trace, or the graph guards on its unset value and compiles again.
        current_platform()
        try:
            # The count that first makes a graph's token count symbolic is its size hint,
            # from which inductor decides which loops run on both cores: compiled at 2
            # tokens, the rotary and norm loops of 64- and 2,048-token steps ran on one
            # (a 64-row step's rotary took 48 us a layer against 20 compiled at 129).
            with self._layers.compiling_ahead(), self._head.compiling_ahead():
                for num_tokens in (1, SMALL_BATCH_ROWS + 1, 2):
                    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
                    positions = torch.zeros_like(ids)  # not `ids`: dynamo would guard on that
                    with step_context(
                        AttentionMetadata.without_kv_writes(num_tokens, device), kv_caches
                    ):
                        hidden = self.forward(ids, positions)
                    self.logits(hidden[:1])
                    self.logits(hidden[:2])
        except Exception as error:  # noqa: BLE001 - any compile failure means: run eagerly
            logger.warning(
                "compiling the model step failed, running it eagerly: %s: %s",
                type(error).__name__,
                error,
            )
            self.run_eagerly()
            return
        dispatches = (self._layers, self._head)
        logger.info(
            "compiled the model step in %.1f s (graphs: %d read back, %d compiled)",
            time.monotonic() - started,
            sum(dispatch.graphs_read for dispatch in dispatches),
            sum(dispatch.graphs_compiled for dispatch in dispatches),
        )
        if self._one_row is not None:
            self._one_row.warm_up(kv_caches, max_model_len)


def trust_cpu_flags_for_vector_code() -> None:
    """Let inductor take the vector instruction sets the CPU's flags list (AVX-512, AMX,
    ...) without proving each one by building and loading a test library.

    Unless told otherwise (TORCHINDUCTOR_VEC_ISA_OK), inductor proves each candidate set
    once a process: six builds, each loaded by a child Python, 1.3–2 s of every start
    even with its code cache warm. The flags come from the kernel, which lists only what it
    has enabled, so the proof adds nothing here; a compiler that cannot build a set still
    fails the compile, and the step then runs eagerly (warm_up)."""
    from torch._inductor import config as inductor_config

    if os.environ.get("TORCHINDUCTOR_VEC_ISA_OK") is None:
        inductor_config.cpp.vec_isa_ok = True


def hash_compiler_versions_in_the_background() -> None:
    """Start hashing the compilers' own files, which keys inductor's cache, on a thread.

    Before its first lookup in the cache on disk, inductor hashes torch's Python sources
    and, where Triton is installed, Triton's (its 500 MB libtriton.so included): 0.5 s of
    every start on a 2-core EPYC, on the thread that compiles. torch keeps those two keys
    in caches that can start computing early (`prefetch`): most of the hashing is reading
    files and sha256, which release the GIL, so it runs beside the step's setup and its
    first trace. Where a torch lacks them, the keys are computed at the first lookup."""
    from torch._inductor import codecache

    for key in (getattr(codecache, "torch_key", None), getattr(codecache, "triton_key", None)):
        if key is not None and hasattr(key, "prefetch"):
            key.prefetch()


def _compile(fn):
    """torch.compile, for the calls no graph compiled ahead of time accepts
    (layer_dispatch.py), a size symbolic only where it changed between calls; call it under
    _one_graph_for_every_layer().

    Only the sizes that changed become symbolic: the hidden size, the head counts and the
    weights' shapes stay constants. With every size symbolic (`dynamic=True`), tracing
    spent most of its time in sympy reasoning about them: compiling the default model took
    22.7 s against 5.0 s, inductor's cache warm in both."""
    return torch.compile(fn, dynamic=None)


@functools.cache
def _one_graph_for_every_layer():
    """Integer module attributes (a layer's index) left unspecialized, so that one graph
    serves every layer. Entered once a step, not once a layer: it costs ~10 us.

    One patch object, entered again at every step: torch gives each `config.patch(...)` a
    ContextVar of its own, which its first entry adds to the thread's context for good (a
    context never drops a variable), so a new patch per call kept ~235 bytes per call in the
    model thread, two calls a step, without end."""
    return torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True)
