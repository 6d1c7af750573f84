"""A step's decoder layers run their compiled graph with the guards checked once a step.

torch.compile checks a compiled function's guards on every call: for a decoder layer ~220
checks (its modules' dicts, each global function its code reached, the inputs' and the
weights' tensor properties), then evaluates the frame and enters AOT's runtime wrapper. One
compiled graph serves every layer (compiled_step.py), so a SmolLM2 step pays that 30
times: with py-spy on 16-row decode steps the guards took 7.5% of the model's forward, and
the frame evaluation with AOT's wrapper 6.4%. For every graph it compiles from a function's
code, dynamo keeps the bytecode that calls the graph (the function's code transformed, with
the function's own arguments); called as a plain function, that bytecode runs the graph
with no check, as vLLM does once it has compiled. In one engine, the two ways alternated
step by step (bench/layer_dispatch.py): a 16-row decode step 53.6 → 47.6 ms, a one-row
step 20.7 → 18.1 ms, a 64-row step 2–5 ms less (bench/RESULTS.md).

So a step checks the guards once, on its first layer, against the graph that accepted
that layer the last time a step had as many tokens; the other layers call the bytecode of
the graph that accepted each of them then. What a guard could see change from one step to
the next is global (grad mode, a kernel backend's setting) or the inputs' shapes, and the
first layer's check covers both: the layers' inputs are each other's outputs, of one
graph. A layer's own structure is fixed once loaded (a checkpoint may keep some layers'
weights quantized and not others, so each layer keeps its own graph). A token count seen
for the first time, or a first layer the graph refuses, goes through torch.compile, which
compiles again if it must, and the graphs that accepted each layer are noted for the next
step of that size. Where a layer then has no graph (dynamo gave up compiling its code: it
keeps at most 8 graphs of one code object, and runs it eagerly past that), steps of that
size stay with torch.compile and are not searched again.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch import Tensor, nn

try:  # dynamo's record of what it compiled from a code object
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
except ImportError:  # another torch: every call goes through torch.compile
    _debug_get_cache_entry_list = None

LayerCall = Callable[[nn.Module, Tensor, Tensor, Tensor], Any]


class CompiledGraph:
    """One graph torch.compile made of a function: its guards and its transformed bytecode,
    which `call` runs with the function's own arguments and no check."""

    def __init__(self, entry: Any, function: types.FunctionType) -> None:
        self._guards = entry.guard_manager
        self.call = types.FunctionType(
            entry.code,
            function.__globals__,
            function.__name__,
            function.__defaults__,
            function.__closure__,
        )
        self._names = function.__code__.co_varnames[: function.__code__.co_argcount]

    def accepts(self, args: Sequence[Any]) -> bool:
        return bool(self._guards.check(dict(zip(self._names, args, strict=True))))


class LayerDispatch:
    """Runs `layers` through `compiled` (torch.compile of their class's forward), checking
    its guards once a step: install() makes it each layer's forward."""

    def __init__(self, layers: nn.ModuleList, compiled: LayerCall) -> None:
        self._layers = list(layers)
        self._compiled = compiled
        self._function = type(self._layers[0]).forward
        self._graphs: dict[int, list[CompiledGraph]] = {}  # by token count, one per layer
        self._known: dict[types.CodeType, CompiledGraph] = {}  # by transformed bytecode
        self._uncompiled: set[int] = set()  # token counts some layer ran eagerly at
        self._step: list[CompiledGraph] | None = None
        self._noted: list[CompiledGraph] = []

    def install(self) -> None:
        for index, layer in enumerate(self._layers):
            layer.forward = functools.partial(self.call, index)

    def uninstall(self) -> None:
        for layer in self._layers:
            layer.__dict__.pop("forward", None)

    @contextlib.contextmanager
    def uninstalled(self) -> Iterator[None]:
        """The layers' own forward, for a trace of the whole step (one_row_step.py) and a
        check of its guards, then this one again."""
        self.uninstall()
        try:
            yield
        finally:
            self.install()

    def call(self, index: int, positions: Tensor, hidden: Tensor, residual: Tensor) -> Any:
        args = (self._layers[index], positions, hidden, residual)
        if index == 0:
            self._step = self._graphs.get(hidden.shape[0])
            if self._step is not None and not self._step[0].accepts(args):
                self._step = None
            self._noted = []
        if self._step is not None:
            return self._step[index].call(*args)
        out = self._compiled(*args)
        count = hidden.shape[0]
        if count in self._uncompiled:
            return out
        # After the call: a graph it had to compile is in dynamo's record now.
        graph = self._graph_accepting(args)
        if graph is None:
            self._uncompiled.add(count)
        else:
            self._noted.append(graph)
            if index == len(self._layers) - 1:
                self._graphs[count] = self._noted
        return out

    def _graph_accepting(self, args: Sequence[Any]) -> CompiledGraph | None:
        return graph_accepting(self._function, args, self._known)


def graph_accepting(
    function: types.FunctionType,
    args: Sequence[Any],
    known: dict[types.CodeType, CompiledGraph] | None = None,
) -> CompiledGraph | None:
    """The graph compiled from `function` whose guards accept `args`, if any; `known`
    keeps the graphs made before, by their bytecode."""
    if _debug_get_cache_entry_list is None:
        return None
    known = {} if known is None else known
    for entry in _debug_get_cache_entry_list(function.__code__):
        graph = known.get(entry.code)
        if graph is None:
            graph = known[entry.code] = CompiledGraph(entry, function)
        if graph.accepts(args):
            return graph
    return None
