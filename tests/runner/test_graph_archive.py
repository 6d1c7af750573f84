"""Compiled graphs filed on disk: read back only while the sources they were traced from
are unchanged, their keys telling models apart, and the guards they keep checkable."""

from __future__ import annotations

import inspect
import json
import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from aioserve.runner import graph_archive
from aioserve.runner.graph_archive import (
    archive_path,
    compile_ahead_of_time,
    load_graph,
    module_structure,
    portable_guards,
    save_graph,
)


def scaled_sum(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x * scale).sum(dim=-1) + 1


def _filed_header(path) -> dict:
    with open(path, "rb") as file:
        return json.loads(file.readline())


def test_a_filed_graph_reads_back_and_computes_what_it_did(tmp_path):
    x = torch.randn(3, 8)
    compiled = torch.compile(scaled_sum, fullgraph=True, dynamic=False)
    graph = compile_ahead_of_time(compiled, (x, 2.0))
    path = tmp_path / "graphs" / "scaled_sum.bin"
    save_graph(path, graph)
    header = _filed_header(path)
    assert [__name__, inspect.getsource(scaled_sum)] in header["sources"]

    read = load_graph(path, globals())
    assert read is not None
    assert read.guard_check(x, 2.0)
    assert not read.guard_check(x, 3.0)  # the constant it was traced with
    assert not read.guard_check(x.double(), 2.0)
    torch.testing.assert_close(read.fn(x, 2.0), scaled_sum(x, 2.0))


class _PackedLinear(nn.Module):
    """A product on a weight oneDNN packed (models/linear.py), a layout of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.randn(4, 8)
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aioserve.packed_dense(x, self.packed_weight, None, None, None)


def call_module(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def test_a_graph_reading_a_packed_weight_is_filed_and_reads_back(tmp_path):
    import aioserve.models.linear  # noqa: F401 - registers aioserve::packed_dense

    module, x = _PackedLinear(), torch.randn(1, 8)
    assert module.packed_weight.layout == torch._mkldnn
    compiled = torch.compile(
        call_module, fullgraph=True, dynamic=False, options={"guard_filter_fn": portable_guards}
    )
    path = tmp_path / "packed.bin"
    save_graph(path, compile_ahead_of_time(compiled, (module, x)))
    read = load_graph(path, globals())
    assert read is not None and read.guard_check(module, x)
    assert not read.guard_check(module, x.double())
    torch.testing.assert_close(read.fn(module, x), x @ module.weight.t())


def test_with_torchs_caches_off_graphs_compile_and_are_neither_filed_nor_read(tmp_path):
    x = torch.randn(2, 4)
    compiled = torch.compile(scaled_sum, fullgraph=True, dynamic=False)
    filed = tmp_path / "filed.bin"
    save_graph(filed, compile_ahead_of_time(compiled, (x, 2.0)))
    with torch._inductor.config.patch(force_disable_caches=True):
        graph = compile_ahead_of_time(compiled, (x, 2.0))
        torch.testing.assert_close(graph.fn(x, 2.0), scaled_sum(x, 2.0))
        save_graph(tmp_path / "not_filed.bin", graph)
        assert load_graph(filed, globals()) is None
    assert not (tmp_path / "not_filed.bin").exists()
    assert load_graph(filed, globals()) is not None


def _file(path, sources: list[list[str]], payload: bytes = b"not a graph") -> None:
    header = {"format": graph_archive._FORMAT, "sources": sources}
    path.write_bytes(json.dumps(header).encode() + b"\n" + payload)


def test_a_graph_traced_from_an_edited_function_is_not_read(tmp_path, caplog):
    source = inspect.getsource(scaled_sum)
    path = tmp_path / "edited.bin"
    _file(path, [[__name__, source.replace("+ 1", "+ 2")]])
    with caplog.at_level(logging.INFO, logger="aioserve"):
        assert load_graph(path, globals()) is None
    assert "traced from other sources" in caplog.text  # the payload was never read


def test_a_function_that_moved_in_its_file_still_matches(tmp_path, caplog):
    # Its text is found anywhere in the module: the payload is then read (and is junk).
    path = tmp_path / "moved.bin"
    _file(path, [[__name__, "\n\n" + inspect.getsource(scaled_sum)]])
    with caplog.at_level(logging.INFO, logger="aioserve"):
        assert load_graph(path, globals()) is None
    assert "traced from other sources" not in caplog.text
    assert "reading the graph filed at" in caplog.text


def test_a_graph_of_a_module_that_is_gone_is_not_read(tmp_path):
    path = tmp_path / "gone.bin"
    _file(path, [["aioserve.no_such_module", "def f(): pass\n"]])
    assert load_graph(path, globals()) is None
    assert load_graph(tmp_path / "missing.bin", globals()) is None


def test_a_graph_that_cannot_be_filed_only_warns(tmp_path, caplog):
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    with caplog.at_level(logging.WARNING, logger="aioserve"):
        save_graph(blocked / "graph.bin", object())  # its folder is a file
    assert "filing the compiled graph" in caplog.text


class _Norm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps


def test_a_models_structure_tells_models_apart_and_not_their_weights():
    torch.manual_seed(0)
    first = module_structure(nn.Sequential(_Norm(8, 1e-5), nn.Linear(8, 4)))
    torch.manual_seed(1)
    assert module_structure(nn.Sequential(_Norm(8, 1e-5), nn.Linear(8, 4))) == first
    for other in (
        nn.Sequential(_Norm(8, 1e-6), nn.Linear(8, 4)),  # a plain attribute
        nn.Sequential(_Norm(8, 1e-5), nn.Linear(8, 5)),  # a shape
        nn.Sequential(_Norm(8, 1e-5, torch.bfloat16), nn.Linear(8, 4)),  # a dtype
        nn.Sequential(_Norm(8, 1e-5), nn.Linear(8, 4, bias=False)),  # a tensor fewer
        nn.Sequential(_Norm(8, 1e-5), nn.Linear(8, 4), nn.ReLU()),  # a module more
    ):
        assert module_structure(other) != first
    packed = nn.Sequential(_Norm(8, 1e-5), nn.Linear(8, 4))
    packed[1].packed_weight = packed[1].weight.detach().to_mkldnn()  # a layout of its own
    assert module_structure(packed) != first


def test_archive_paths_differ_by_their_parts_under_inductors_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    path = archive_path("one_row_step", {"model": "a", "pool": [1, 2]})
    assert path.parent == tmp_path / "aioserve_graphs"
    assert path == archive_path("one_row_step", {"pool": [1, 2], "model": "a"})
    assert path != archive_path("one_row_step", {"model": "b", "pool": [1, 2]})
    assert path != archive_path("another", {"model": "a", "pool": [1, 2]})


@pytest.mark.parametrize(
    ("guard_type", "name", "kept"),
    [
        ("TENSOR_MATCH", "G['__import_aioserve_dot_models_dot_step_context']._current", True),
        ("CONSTANT_MATCH", "G['__import_aioserve_dot_kernels_dot_dispatch']._backend", True),
        ("TYPE_MATCH", "model._modules['layers']", True),
        ("ID_MATCH", "model._modules['layers']", False),
        ("CLOSURE_MATCH", "G['__import_torch_dot_nn_dot_functional'].linear", False),
        ("BUILTIN_MATCH", "G['__builtins_dict___14']['isinstance']", False),
    ],
)
def test_guards_kept_with_a_filed_graph(guard_type, name, kept):
    entry = SimpleNamespace(guard_type=guard_type, name=name, value=None)
    assert portable_guards([entry]) == [kept]
