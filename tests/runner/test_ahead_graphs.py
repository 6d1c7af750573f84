"""A layer's graph compiled ahead of time: one graph for every layer index, the token
count static at one and symbolic otherwise, filed and read back by a later compile; what
cannot be compiled whole falls back to torch.compile in the dispatch."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from aioserve.runner import ahead_graphs
from aioserve.runner.ahead_graphs import ahead_graph
from aioserve.runner.compiled_step import _compile
from aioserve.runner.graph_archive import archive_path
from aioserve.runner.layer_dispatch import LayerDispatch

pytestmark = pytest.mark.slow

WIDTH = 8


class ToyLayer(nn.Module):
    """A layer whose graph branches on the row count, as linear.SMALL_BATCH_ROWS does."""

    def __init__(self, layer_index: int, width: int = WIDTH) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.weight = nn.Parameter(torch.randn(width), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.shape[0] > 4:
            return x * self.weight + self.layer_index, residual + x
        return x - self.weight * self.layer_index, residual - x


class BrokenLayer(ToyLayer):
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        torch._dynamo.graph_break()
        return super().forward(x, residual)


@pytest.fixture(autouse=True)
def _graphs_in(monkeypatch, tmp_path):
    # Filed in this test's folder, under the key the real path names.
    def path_in_tmp(name, parts):
        return tmp_path / archive_path(name, parts).name

    monkeypatch.setattr(ahead_graphs, "archive_path", path_in_tmp)


def _args(layer: nn.Module, rows: int) -> tuple:
    return (layer, torch.randn(rows, WIDTH), torch.randn(rows, WIDTH))


def test_one_graph_serves_every_layer_index_and_a_later_compile_reads_it_back(tmp_path):
    layers = [ToyLayer(index) for index in range(4)]
    args = _args(layers[0], 6)
    graph, read = ahead_graph(ToyLayer.forward, args)
    assert not read
    assert len(list(tmp_path.iterdir())) == 1
    for layer in layers:
        call = (layer, *args[1:])
        assert graph.accepts(call)
        torch.testing.assert_close(graph.call(*call), ToyLayer.forward(*call))
    # Another layer at the same count: the same key (the index is not part of it).
    again, read = ahead_graph(ToyLayer.forward, _args(layers[2], 6))
    assert read
    call = _args(layers[3], 7)
    torch.testing.assert_close(again.call(*call), ToyLayer.forward(*call))


def test_the_token_count_is_static_at_one_and_symbolic_on_each_side_of_a_branch():
    layer = ToyLayer(1)
    one, _ = ahead_graph(ToyLayer.forward, _args(layer, 1))
    many, _ = ahead_graph(ToyLayer.forward, _args(layer, 6))
    few, _ = ahead_graph(ToyLayer.forward, _args(layer, 2))
    for rows, expected in [(1, one), (2, few), (4, few), (5, many), (300, many)]:
        args = _args(layer, rows)
        assert [graph.accepts(args) for graph in (one, few, many)] == [
            graph is expected for graph in (one, few, many)
        ], rows
        torch.testing.assert_close(expected.call(*args), ToyLayer.forward(*args))


def test_the_callers_tensors_keep_no_mark_of_the_symbolic_count():
    args = _args(ToyLayer(0), 6)
    ahead_graph(ToyLayer.forward, args)
    assert not any(hasattr(tensor, "_dynamo_dynamic_indices") for tensor in args[1:])


def test_another_structure_is_compiled_anew_under_another_key(tmp_path):
    ahead_graph(ToyLayer.forward, _args(ToyLayer(0), 6))
    wider = ToyLayer(0, width=2 * WIDTH)
    args = (wider, torch.randn(6, 2 * WIDTH), torch.randn(6, 2 * WIDTH))
    graph, read = ahead_graph(ToyLayer.forward, args)
    assert not read
    assert len(list(tmp_path.iterdir())) == 2
    torch.testing.assert_close(graph.call(*args), ToyLayer.forward(*args))


def test_a_layer_not_compiled_whole_goes_through_torch_compile(caplog):
    torch._dynamo.reset()
    layers = [BrokenLayer(index) for index in range(3)]
    dispatch = LayerDispatch(layers, BrokenLayer.forward, _compile(BrokenLayer.forward))
    x, residual = torch.randn(6, WIDTH), torch.randn(6, WIDTH)
    with caplog.at_level(logging.INFO, logger="aioserve"), dispatch.compiling_ahead():
        out = [dispatch.call(index, x, residual) for index in range(3)]
    assert "BrokenLayer.forward is not compiled ahead of time" in caplog.text
    assert dispatch.graphs_compiled == dispatch.graphs_read == 0
    for index, layer in enumerate(layers):
        torch.testing.assert_close(out[index], BrokenLayer.forward(layer, x, residual))
