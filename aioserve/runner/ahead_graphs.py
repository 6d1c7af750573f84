"""A decoder layer's or the output head's graph, compiled ahead of time and filed on disk.

torch.compile traces a function again in every process: with inductor's cache warm, a
start still spent ~3 s on a 2-core AVX2 EPYC tracing the default model's layer and head
graphs (four traces of a layer, two of the head) before the cache answered. Compiled by
torch's ahead-of-time compile instead, each graph is filed (graph_archive.py) and a later
start reads it back in ~0.05 s, once the first read has loaded inductor's runtime.

A graph is compiled for one call: a module (the layer, or the model for the head) and
tensors whose first dimension is the step's token count. At one token every size is
static; otherwise the count is symbolic, and the guards say which counts the graph takes
(the trace's branches on linear.SMALL_BATCH_ROWS put one side in each graph). A layer's
index, an integer attribute `layer_index` of its attention, is a symbolic input rather
than a constant, so one graph serves every layer of a structure.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import torch

from aioserve.runner.graph_archive import (
    archive_path,
    compile_ahead_of_time,
    module_structure,
    portable_guards,
    read_or_compile,
    trace_settings,
)

# The integer attribute dynamo takes as a symbolic input: left out of the graph's key too.
_SYMBOLIC_ATTRIBUTE = "layer_index"


class AheadGraph:
    """A graph torch's ahead-of-time compile made of a function, or read back: `accepts`
    checks its guards against a call's arguments, `call` runs it without checking."""

    def __init__(self, compiled: Any) -> None:
        self._compiled = compiled
        self.call = compiled.fn

    def accepts(self, args: Sequence[Any]) -> bool:
        return bool(self._compiled.guard_check(*args))


def ahead_graph(function: types.FunctionType, args: Sequence[Any]) -> tuple[AheadGraph, bool]:
    """The graph of `function` for calls like `args` (a module, then tensors), read back
    from the file for this call's form (the module's structure, the token count, the
    settings), else compiled and filed there; and whether it was read back.

    RuntimeError where the compiled graph's guards refuse `args` themselves; whatever
    torch raises where it cannot compile `function` whole (a graph break)."""
    module, tensors = args[0], args[1:]
    count = tensors[0].shape[0]
    path = archive_path(
        f"{function.__module__}.{function.__qualname__}",
        {
            "module": module_structure(module, leave_out=(_SYMBOLIC_ATTRIBUTE,)),
            "count": count,
            "settings": trace_settings(),
        },
    )

    def compile_graph() -> Any:
        # The marks go on aliases: the caller's tensors carry none into later calls.
        marked = [tensor.detach() for tensor in tensors]
        if count > 1:
            for tensor in marked:
                torch._dynamo.mark_dynamic(tensor, 0)
        compiled = torch.compile(
            function,
            fullgraph=True,
            dynamic=False,
            options={"guard_filter_fn": portable_guards},
        )
        # dynamo's source names, as `L['self']._modules['self_attn'].layer_index`
        symbolic = rf".*\.{_SYMBOLIC_ATTRIBUTE}$"
        with torch.compiler.config.patch(dynamic_sources=symbolic):
            return compile_ahead_of_time(compiled, (module, *marked))

    compiled, read = read_or_compile(
        path, function.__globals__, lambda graph: graph.guard_check(*args), compile_graph
    )
    graph = AheadGraph(compiled)
    if not graph.accepts(args):
        raise RuntimeError(f"the graph compiled for {count} tokens refuses them")
    return graph, read
