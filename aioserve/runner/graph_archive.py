"""Compiled graphs kept on disk between processes, so that a start need not trace again.

With inductor's cache warm, a start still traced the one-row step (one_row_step.py) with
dynamo, all ~30 layers of it, before the cache could answer: ~10 s of a 27 s start on a
2-core AVX2 EPYC. torch's ahead-of-time compile (`torch.compile(...).aot_compile`) returns
what that trace made, the function's bytecode, its guards and inductor's code, as one
object that can be written to a file and read back in ~1 s.

A graph is filed under a key that tells graphs apart: torch, Python and the vector
instructions inductor wrote for, and what the caller adds (the model's structure, the
pool's shapes, the settings). It is read back only if every function the trace went
through is still, letter for letter, in its module (a function that moved within its file
is fine, an edited one is not); the caller then checks the graph's own guards, the module
globals the trace read included, against its model and pool. Graphs live beside inductor's
cache (`TORCHINDUCTOR_CACHE_DIR`), whose compiled code they load, and go when it is
cleared; like that cache, the folder holds code that runs (pickles, libraries), so only
the serving user may write it.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import logging
import os
import platform
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._dynamo.guards import CheckFunctionManager

from aioserve.kernels import dispatch

logger = logging.getLogger("aioserve")

_FORMAT = 1  # of the files this module writes


def portable_guards(entries: list[Any]) -> list[bool]:
    """torch.compile's `guard_filter_fn`: keep every guard a graph read back can check,
    the module globals the trace read included (settings, constants, the step's tensors).
    Dropped: those torch cannot write (object identities), those on dynamo's own alias of
    the builtins, missing from the globals a loaded graph runs with, and those on oneDNN's
    packed weights (models/linear.py `pack_weights`): torch files each guarded tensor as an
    empty copy on the meta device, which their layout cannot have. A packed weight's dtype
    and shape are in the graph's key (module_structure), and a graph serves only the
    model it was compiled or read back for."""
    unwritable = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    return [
        entry.guard_type not in unwritable
        and not entry.name.startswith("G['__builtins_dict___")
        and not _is_packed(entry.value)
        for entry in entries
    ]


def _is_packed(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.layout == torch._mkldnn


def compile_ahead_of_time(compiled: Any, args: tuple) -> Any:
    """`compiled` (a torch.compile of a function) compiled for `args`, ready to file.

    torch refuses it where its caches are turned off (TORCHINDUCTOR_FORCE_DISABLE_CACHES):
    the compile still runs then, looking nothing up (its cache keys are drawn at random),
    and no graph is read or filed (`filing_graphs`)."""
    with torch._inductor.config.patch(force_disable_caches=False):
        return compiled.aot_compile((args, {}))


def filing_graphs() -> bool:
    """Whether graphs are read and filed: not where torch's caches are turned off."""
    return not torch._inductor.config.force_disable_caches


def archive_path(name: str, parts: dict[str, Any]) -> Path:
    """Where the graph `name` traced under `parts` (JSON-able values) is filed."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    key = {
        "format": _FORMAT,
        "torch": torch.__version__,
        "python": sys.version,
        "machine": platform.machine(),
        "vector_isa": str(pick_vec_isa()),
        **parts,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    return Path(cache_dir()) / "aioserve_graphs" / f"{name}-{digest[:32]}.bin"


def trace_settings() -> tuple:
    """The global settings a trace of a step reads, which its guards check: part of a
    graph's key, and what a caller that skips the guards watches for a change."""
    return (
        dispatch.kernel_backend(),
        dispatch.batch_invariant(),
        torch.is_inference_mode_enabled(),
        torch.is_grad_enabled(),
    )


def read_or_compile(
    path: Path,
    f_globals: dict[str, Any],
    accepts: Callable[[Any], bool],
    compile_graph: Callable[[], Any],
) -> tuple[Any, bool]:
    """The graph filed at `path` where `accepts` takes it, and True; else the graph
    `compile_graph()` returns (torch's ahead-of-time compile), filed at `path`, and False.
    `f_globals` are the traced function's globals (see load_graph)."""
    graph = load_graph(path, f_globals)
    if graph is not None and accepts(graph):
        return graph, True
    graph = compile_graph()
    save_graph(path, graph)
    return graph, False


def load_graph(path: Path, f_globals: dict[str, Any]) -> Any | None:
    """The graph filed at `path`, or None where there is none or its traced sources changed.

    Its guards are built as it loads, from the globals they read: call it where those
    exist (the step's context entered)."""
    if not filing_graphs():
        return None
    try:
        with open(path, "rb") as file:
            header = json.loads(file.readline())
            if header.get("format") != _FORMAT or not _sources_unchanged(header["sources"]):
                logger.info("the graph filed at %s was traced from other sources", path)
                return None
            return torch.compiler.load_compiled_function(file, f_globals=f_globals)
    except FileNotFoundError:
        return None
    except Exception as error:  # noqa: BLE001 - a file that cannot be read is compiled anew
        logger.warning(
            "reading the graph filed at %s failed: %s: %s", path, type(error).__name__, error
        )
        return None


def save_graph(path: Path, graph: Any) -> None:
    """File `graph` (what `aot_compile` returned) at `path`, with the source of every
    function its trace went through; a failure only warns."""
    if not filing_graphs():
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as folder:
            serialized = Path(folder) / "graph"
            graph.save_compiled_function(str(serialized))
            header = {"format": _FORMAT, "sources": _traced_sources(graph)}
            written = Path(folder) / "file"
            with open(written, "wb") as file:
                file.write(json.dumps(header).encode() + b"\n")
                file.write(serialized.read_bytes())
            os.replace(written, path)  # whole or not at all, for processes reading beside
    except Exception as error:  # noqa: BLE001 - the graph still serves this process
        logger.warning(
            "filing the compiled graph at %s failed: %s: %s", path, type(error).__name__, error
        )


def module_structure(model: nn.Module, leave_out: tuple[str, ...] = ()) -> str:
    """A digest of `model`'s modules, their plain attributes (but those named in
    `leave_out`), and its tensors' names, shapes, strides and dtypes: what sets one model's
    graph apart from another's."""
    lines = []
    for name, module in model.named_modules():
        lines.append(f"{name} {type(module).__module__}.{type(module).__qualname__}")
        for attribute, value in sorted(vars(module).items()):
            if attribute in leave_out:
                continue
            if isinstance(value, torch.Tensor):
                lines.append(f"  {attribute} {_tensor_form(value)}")
            elif _is_plain(value):
                lines.append(f"  {attribute} = {value!r}")
        for kind in ("_parameters", "_buffers"):
            for attribute, value in getattr(module, kind).items():
                if value is not None:
                    lines.append(f"  {attribute} {_tensor_form(value)}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _tensor_form(tensor: torch.Tensor) -> str:
    # oneDNN's packed weights (models/linear.py) have a layout of their own, and no strides
    strides = tensor.stride() if tensor.layout == torch.strided else ()
    return f"{tensor.dtype} {tensor.layout} {tuple(tensor.shape)} {strides} {tensor.device.type}"


def _is_plain(value: Any) -> bool:
    if isinstance(value, (bool, int, float, str, type(None), torch.dtype)):
        return True
    return isinstance(value, (tuple, list)) and all(_is_plain(item) for item in value)


def _traced_sources(graph: Any) -> list[tuple[str, str]]:
    """(module, source) of each function outside torch the trace went through."""
    sources = set()
    for inlined in graph.source_info().inlined_sources:
        if inlined.module.split(".")[0] == "torch":
            continue  # torch's version is in the key
        lines = inlined.content.splitlines(keepends=True)
        function = lines[inlined.firstlineno - 1 : inlined.lastlineno - 1]
        sources.add((inlined.module, "".join(function)))
    return sorted(sources)


def _sources_unchanged(sources: list[list[str]]) -> bool:
    for module_name, source in sources:
        try:
            current = inspect.getsource(importlib.import_module(module_name))
        except (ImportError, OSError, TypeError):
            return False
        if source not in current:
            return False
    return True
