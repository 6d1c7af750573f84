"""The sampler's race compiled for the CPU: the draw of random rows as one C++ loop a row.

On the CPU the sampler runs its torch path, whose eager race over a whole vocabulary is a
score of ops a chunk of rows (kernels/sampling/race.py). `compile_race` compiles
`race_winners` instead, once with the masks' keep tensor and once without, for any row
count (the rows an unbacked size, so that one row does not take a graph of its own), by
torch's ahead-of-time compile, filed beside the other graphs (graph_archive.py) so that
a later start reads them back. The runner hands the result to `sample`. It is compiled
at warm-up, never while serving: a call its guards refuse runs the eager race.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import Tensor

from aioserve.kernels.sampling.race import race_reference, race_winners
from aioserve.kernels.sampling.uniform import _row_key_reference
from aioserve.runner.graph_archive import (
    archive_path,
    compile_ahead_of_time,
    portable_guards,
    read_or_compile,
    trace_settings,
)

logger = logging.getLogger("aioserve")


class CompiledRace:
    """race_winners(s, row_max, keep, keys) by its compiled graphs: one for keep None,
    one for a keep tensor. They were compiled under inference mode, as the runner samples:
    a call their guards refuse (another dtype or layout, grad mode) runs the eager race,
    with a warning the first time."""

    def __init__(self, graphs: dict[bool, Any]) -> None:
        self.graphs = graphs  # by whether the call has a keep tensor
        self._warned = False

    def __call__(self, s: Tensor, row_max: Tensor, keep: Tensor | None, keys: Tensor) -> Tensor:
        graph = self.graphs[keep is not None]
        if graph.guard_check(s, row_max, keep, keys):
            return graph.fn(s, row_max, keep, keys)
        if not self._warned:
            self._warned = True
            logger.warning(
                "the compiled race refuses %s scaled logits %s (inference mode %s): "
                "such rows take the eager race",
                s.dtype,
                tuple(s.shape),
                torch.is_inference_mode_enabled(),
            )
        return race_reference(s, row_max, keep, keys, None)


@torch.inference_mode()
def compile_race(vocab_size: int) -> CompiledRace | None:
    """The race compiled for rows of `vocab_size` float32 scaled logits on the CPU, under
    inference mode, its graphs read back where filed; None, with a warning, where
    compiling fails."""
    started = time.monotonic()
    graphs, read_back = {}, 0
    try:
        for masked in (False, True):
            graphs[masked], read = _read_or_compile(vocab_size, masked)
            read_back += read
    except Exception as error:  # noqa: BLE001 - the eager race still draws every row
        logger.warning(
            "compiling the sampler's race failed, random rows take the eager race: %s: %s",
            type(error).__name__,
            error,
        )
        return None
    logger.info(
        "%s the sampler's race in %.1f s",
        "read the compiled graphs of" if read_back == len(graphs) else "compiled",
        time.monotonic() - started,
    )
    return CompiledRace(graphs)


def _read_or_compile(vocab_size: int, masked: bool) -> tuple[Any, bool]:
    args = _example_args(vocab_size, masked)
    path = archive_path(
        "sampling.race_winners",
        {"vocab_size": vocab_size, "masked": masked, "settings": trace_settings()},
    )

    def compile_graph() -> Any:
        marked = [None if arg is None else arg.detach() for arg in args]
        for tensor in marked:
            if tensor is not None:
                torch._dynamo.decorators.mark_unbacked(tensor, 0)
        compiled = torch.compile(
            race_winners,
            fullgraph=True,
            dynamic=False,
            options={"guard_filter_fn": portable_guards},
        )
        return compile_ahead_of_time(compiled, tuple(marked))

    graph, read = read_or_compile(
        path, race_winners.__globals__, lambda graph: graph.guard_check(*args), compile_graph
    )
    if not graph.guard_check(*args):
        raise RuntimeError("the compiled race refuses the rows it was compiled for")
    # One row, which an unbacked size must take as any other count.
    one_row = [None if arg is None else arg[:1] for arg in args]
    if not graph.guard_check(*one_row):
        raise RuntimeError("the compiled race refuses a single row")
    if not torch.equal(graph.fn(*args), race_reference(*args, None)):
        raise RuntimeError("the compiled race draws other tokens than the eager one")
    return graph, read


def _example_args(vocab_size: int, masked: bool) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """A race's arguments for two rows, of the dtypes and layouts the sampler passes."""
    s = torch.randn(2, vocab_size)
    keep = torch.rand(2, vocab_size) < 0.5 if masked else None
    keys = _row_key_reference(torch.arange(2), torch.zeros(2, dtype=torch.int64))
    return s, s.amax(-1, keepdim=True), keep, keys
