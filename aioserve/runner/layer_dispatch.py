"""A step's decoder layers, and its head, run their compiled graphs with the guards
checked once a step.

torch.compile checks a compiled function's guards on every call: for a decoder layer ~220
checks (its modules' dicts, each global function its code reached, the inputs' and the
weights' tensor properties), then evaluates the frame and enters AOT's runtime wrapper. One
compiled graph serves every layer (compiled_step.py), so a SmolLM2 step pays that 30
times: with py-spy on 16-row decode steps the guards took 7.5% of the model's forward, and
the frame evaluation with AOT's wrapper 6.4%. Each graph comes with the bytecode that calls
it (the function's code transformed, with the function's own arguments); called as a plain
function, that bytecode runs the graph with no check, as vLLM does once it has compiled.
In one engine, the two ways alternated step by step (bench/layer_dispatch.py): a 16-row
decode step 53.6 → 47.6 ms, a one-row step 20.7 → 18.1 ms, a 64-row step 2–5 ms less
(bench/RESULTS.md).

So a step checks the guards once, on its first layer, against the graph that accepted
that layer the last time a step had as many tokens; the other layers call the bytecode of
the graph that accepted each of them then. What a guard could see change from one step to
the next is global (grad mode, a kernel backend's setting) or the inputs' shapes, and the
first layer's check covers both: the layers' inputs are each other's outputs, of one
graph. A layer's own structure is fixed once loaded (a checkpoint may keep some layers'
weights quantized and not others, so each layer keeps its own graph).

The graphs are compiled at warm-up by torch's ahead-of-time compile and filed on disk, or
read back (ahead_graphs.py): a layer no graph accepts then gets its own. A token count
seen for the first time looks among them; a call none accepts later (a setting changed)
goes through torch.compile, which compiles again if it must, and its graphs serve as
well. Where a layer then has no graph (dynamo gave up compiling its code: it keeps at most
8 graphs of one code object, and runs it eagerly past that), steps of that size stay with
torch.compile and are not searched again.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from torch import Tensor, nn

from aioserve.runner.ahead_graphs import AheadGraph, ahead_graph

try:  # dynamo's record of what it compiled from a code object
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
except ImportError:  # another torch: every call goes through torch.compile
    _debug_get_cache_entry_list = None

logger = logging.getLogger("aioserve")


class Graph(Protocol):
    """A compiled graph: its guards' check, and a call that skips it."""

    call: Callable[..., Any]

    def accepts(self, args: Sequence[Any]) -> bool: ...


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
    """Runs `modules` (a step's decoder layers, or the model alone for its head) through
    graphs of `function` (their class's forward, or the head's), checking guards once a
    step: `call(index, *tensors)` runs module `index` on tensors whose first dimension is
    the step's token count; install() makes it each layer's forward.

    Inside `compiling_ahead()` (warm-up), a call no graph accepts gets one compiled
    ahead of time, or read back from disk (ahead_graphs.py); outside it, such a call goes
    through `compiled` (torch.compile of `function`), whose own graphs then serve too."""

    def __init__(
        self, modules: Sequence[nn.Module], function: types.FunctionType, compiled: Callable
    ) -> None:
        self._modules = list(modules)
        self._function = function
        self._compiled = compiled
        self._ahead: list[AheadGraph] = []  # compiled ahead of time, or read back
        self._compiling_ahead = False
        self._installed = False
        self.graphs_read = self.graphs_compiled = 0  # ahead of time, for warm-up's log
        self._graphs: dict[int, list[Graph]] = {}  # by token count, one per module
        self._known: dict[types.CodeType, CompiledGraph] = {}  # by transformed bytecode
        self._uncompiled: set[int] = set()  # token counts some module ran eagerly at
        self._step: list[Graph] | None = None
        self._noted: list[Graph] = []

    def install(self) -> None:
        for index, layer in enumerate(self._modules):
            layer.forward = functools.partial(self.call, index)
        self._installed = True

    def uninstall(self) -> None:
        for layer in self._modules:
            layer.__dict__.pop("forward", None)
        self._installed = False

    @contextlib.contextmanager
    def uninstalled(self) -> Iterator[None]:
        """The layers' own forward, for a trace (this dispatch's partials reach dynamo's
        guard managers, which torch cannot write into a filed graph) and a check of its
        guards; then this dispatch again, where it was installed."""
        installed = self._installed
        self.uninstall()
        try:
            yield
        finally:
            if installed:
                self.install()

    @contextlib.contextmanager
    def compiling_ahead(self) -> Iterator[None]:
        """Calls no graph accepts get one compiled ahead of time and filed, or read back."""
        self._compiling_ahead = True
        try:
            yield
        finally:
            self._compiling_ahead = False

    def call(self, index: int, *tensors: Tensor) -> Any:
        args = (self._modules[index], *tensors)
        count = tensors[0].shape[0]
        if index == 0:
            self._step = self._graphs.get(count)
            if self._step is not None and not self._step[0].accepts(args):
                self._step = None
            self._noted = []
        if self._step is not None:
            return self._step[index].call(*args)
        graph = self._ahead_graph_accepting(args)
        if graph is not None:
            out = graph.call(*args)
        else:
            out = self._compiled(*args)
            if count in self._uncompiled:
                return out
            # After the call: a graph it had to compile is in dynamo's record now.
            graph = graph_accepting(self._function, args, self._known)
            if graph is None:
                self._uncompiled.add(count)
                return out
        self._noted.append(graph)
        if index == len(self._modules) - 1:
            self._graphs[count] = self._noted
        return out

    def _ahead_graph_accepting(self, args: Sequence[Any]) -> AheadGraph | None:
        """A graph compiled ahead of time that accepts `args`: one made before, else (while
        compiling ahead) a new one; None where none does, or compiling it failed (then
        no other is tried: what broke one trace breaks the others)."""
        for graph in self._ahead:
            if graph.accepts(args):
                return graph
        if not self._compiling_ahead:
            return None
        try:
            with self.uninstalled():
                graph, read = ahead_graph(self._function, args)
        except Exception as error:  # noqa: BLE001 - torch.compile's own graphs still serve
            logger.info(
                "%s is not compiled ahead of time, torch.compile traces it at every start: %s: %s",
                self._function.__qualname__,
                type(error).__name__,
                error,
            )
            self._compiling_ahead = False
            return None
        self._ahead.append(graph)
        if read:
            self.graphs_read += 1
        else:
            self.graphs_compiled += 1
        return graph


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
