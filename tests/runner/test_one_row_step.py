"""The step of one decoding row, compiled whole, gives the layer graphs' tokens.

A bfloat16 runner (the pool read in place) and a float32 runner with bfloat16 row weights,
as `--dtype auto` serves on a CPU without bfloat16 arithmetic (the pool read in place, or
its blocks gathered as on a CPU with AVX-512), compile the one-row step at warm-up; a lone sequence's decodes then run it, across block
boundaries, and its greedy tokens and top logprobs must be those of the same runner with
the one-row step off (the layer graphs). The graph computes the decodes' logits too. Both
fuse differently (bfloat16 rounds too), so the logprobs agree closely, not bit for bit, and
two near-tied tokens below the first may swap places. Steps of more rows and prefills take
the layer graphs; pools the graph cannot trace (fp8, float16) never build it.
Only the first step and steps after a change of the settings a trace reads check the
graph's guards; a step they refuse turns it off for good, with a warning, and still gives
the right tokens. A graph is filed on disk (runner/graph_archive.py) for the next runner of
the same model, which reads it back; one filed for another model is compiled anew.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from aioserve.kernels import dispatch, kv_cache
from aioserve.kernels.kv_cache import empty_kv_cache, torch_path_layouts
from aioserve.models.linear import onednn_packs
from aioserve.runner import one_row_step
from aioserve.runner.one_row_step import attends_in_graph
from tests.runner.call_counts import count_calls
from tests.runner.plans import GREEDY, PlanMaker, run_step, tiny_runner

pytestmark = pytest.mark.slow

BLOCK_SIZE = 4
SCORED = dataclasses.replace(GREEDY, logprobs=3)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # dynamo keeps at most 8 graphs of a code object, and every compiled runner of this
    # process compiled DecoderLayer.forward at its own sizes: past that the layer graphs
    # this module compares with run eagerly (test_compiled_step.py). (The one-row step is
    # compiled ahead of time, into no code object's graphs: it has no such limit.)
    torch._dynamo.reset()


def _runner(
    *,
    one_row: bool,
    dtype: torch.dtype = torch.bfloat16,
    config: str = "llama-gqa4-llama3-rope",
    block_size: int = BLOCK_SIZE,
    packed: bool = False,
):
    # A float32 model keeps bfloat16 row weights, as `--dtype auto` serves it on a CPU
    # without bfloat16 arithmetic (models/linear.py keep_row_weights).
    row_weights = torch.bfloat16 if dtype == torch.float32 else None
    _, runner = tiny_runner(
        config,
        dtype=dtype,
        compile_model=True,
        block_size=block_size,
        row_weight_dtype=row_weights,
        packed_weights=packed,
    )
    if not one_row:
        runner.model_step._one_row = None
    runner.warm_up()
    return runner


def _calls(runner, monkeypatch) -> list[int]:
    """How many steps the one-row graph computes."""
    step = runner.model_step._one_row
    return count_calls(monkeypatch, step, "forward", lambda out: out is not None)


def _guarded_calls(runner, monkeypatch) -> list[int]:
    """How many steps check the graph's guards."""
    return count_calls(monkeypatch, runner.model_step._one_row, "_accepts")


def _lone_sequence(
    runner, decodes: int, maker: PlanMaker | None = None, seq_id: str = "s"
) -> list[tuple[int, list[int], list[float]]]:
    """A 6-token prompt, then `decodes` one-row steps: each step's token and top logprobs;
    the sequence then finished (the maker's next plan says so)."""
    maker = PlanMaker(BLOCK_SIZE, 64) if maker is None else maker
    maker.admit(seq_id, [3, 17, 200, 45, 9, 88], SCORED)
    out = []
    for steps in ([(seq_id, 6)], *[[(seq_id, 1)]] * decodes):
        result = run_step(runner, maker.plan(steps))
        (token,) = result.sampled[seq_id]
        (logprobs,) = result.logprobs[seq_id]
        out.append((token, logprobs.top_token_ids, logprobs.top_logprobs))
        maker.learn(result.sampled)
    maker.finish(seq_id)
    return out


# avx512: whether the CPU is taken to have AVX-512, under which a float32 pool is gathered
# rather than weighed in place (kv_cache.decodes_weigh_in_place): each float32 case takes
# one of the two ways on any host. packed: the dense weights packed for oneDNN, as a CPU
# with bfloat16 arithmetic serves a bfloat16 model (engine/resolution.py).
@pytest.mark.parametrize(
    ("config", "dtype", "avx512", "packed"),
    [
        ("llama-gqa4-llama3-rope", torch.bfloat16, False, False),
        ("qwen2-tied", torch.bfloat16, False, False),
        ("qwen3", torch.bfloat16, False, False),
        pytest.param(
            "qwen2-tied",  # the tied head gets a packed copy
            torch.bfloat16,
            False,
            True,
            marks=pytest.mark.skipif(
                not onednn_packs(torch.bfloat16), reason="this CPU has no bfloat16 packing"
            ),
        ),
        ("llama-gqa4-llama3-rope", torch.float32, False, False),  # weighed in place
        ("qwen2-tied", torch.float32, True, False),  # gathered, over one kv head
    ],
)
def test_one_row_decodes_run_the_whole_graph_and_give_the_layer_graphs_tokens(
    config, dtype, avx512, packed, monkeypatch
):
    monkeypatch.setattr(kv_cache, "_has_avx512", lambda: avx512)
    whole = _runner(one_row=True, config=config, dtype=dtype, packed=packed)
    assert whole.model_step._one_row.ready
    layers = whole.model_step._layers  # compiled ahead of time too, not traced each start
    assert layers.graphs_read + layers.graphs_compiled > 0
    calls, guarded = _calls(whole, monkeypatch), _guarded_calls(whole, monkeypatch)
    head = count_calls(monkeypatch, whole.model_step, "logits")
    decodes = 5 * BLOCK_SIZE  # across five block boundaries
    got = _lone_sequence(whole, decodes)
    assert calls[0] == decodes  # every decode, not the prefill
    assert guarded[0] == 1  # the first; the others call the graph directly
    assert head[0] == 1  # the prefill's: the graph computes the decodes' logits itself
    assert whole.model_step._one_row.ready
    layer_graphs = _runner(one_row=False, config=config, dtype=dtype, packed=packed)
    expected = _lone_sequence(layer_graphs, decodes)
    for (token, ids, values), (token_0, ids_0, values_0) in zip(got, expected, strict=True):
        assert token == token_0
        # The top logprobs agree; below the first, two near-tied tokens may swap places.
        assert values == pytest.approx(values_0, abs=0.05)
        theirs = dict(zip(ids_0, values_0, strict=True))
        for token_id, value in zip(ids, values, strict=True):
            if token_id in theirs:
                assert value == pytest.approx(theirs[token_id], abs=0.05)


def test_a_later_runner_of_the_model_reads_the_graph_the_first_filed(monkeypatch, tmp_path, caplog):
    path = tmp_path / "graph.bin"
    monkeypatch.setattr(one_row_step, "archive_path", lambda name, parts: path)
    with caplog.at_level(logging.INFO, logger="aioserve"):
        _runner(one_row=True)
    assert "compiled the one-row step" in caplog.text
    assert path.stat().st_size > 0
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="aioserve"):
        second = _runner(one_row=True)
    assert "read the compiled graph of the one-row step" in caplog.text
    assert second.model_step._one_row.ready
    calls = _calls(second, monkeypatch)
    decodes = 2 * BLOCK_SIZE
    got = _lone_sequence(second, decodes)
    assert calls[0] == decodes
    expected = _lone_sequence(_runner(one_row=False), decodes)
    assert [token for token, _, _ in got] == [token for token, _, _ in expected]


def test_a_graph_filed_for_another_model_is_compiled_anew(monkeypatch, tmp_path, caplog):
    # Both models' graphs filed at one path: the guards of the graph read back (another
    # model's weights and sizes) refuse the second model, which compiles its own.
    path = tmp_path / "graph.bin"
    monkeypatch.setattr(one_row_step, "archive_path", lambda name, parts: path)
    _runner(one_row=True, config="llama-gqa4-llama3-rope")
    filed = path.read_bytes()
    with caplog.at_level(logging.INFO, logger="aioserve"):
        other = _runner(one_row=True, config="qwen3")
    assert "compiled the one-row step" in caplog.text
    assert path.read_bytes() != filed
    calls = _calls(other, monkeypatch)
    got = _lone_sequence(other, 4)
    assert calls[0] == 4
    expected = _lone_sequence(_runner(one_row=False, config="qwen3"), 4)
    assert [token for token, _, _ in got] == [token for token, _, _ in expected]


def test_sequences_shorter_than_the_warm_up_lengths_still_get_the_graph(monkeypatch):
    # The CPU's 128-slot blocks where sequences end at 256 tokens (the tiny model's rotary
    # table): a warm-up decode three blocks long would read past it.
    whole = _runner(one_row=True, block_size=128)
    assert whole.max_model_len < 3 * 128
    assert whole.model_step._one_row.ready
    calls = _calls(whole, monkeypatch)
    got = _lone_sequence(whole, 4, PlanMaker(128, 64))
    assert calls[0] == 4
    layer_graphs = _runner(one_row=False, block_size=128)
    expected = _lone_sequence(layer_graphs, 4, PlanMaker(128, 64))
    assert [token for token, _, _ in got] == [token for token, _, _ in expected]


def test_steps_of_more_rows_take_the_layer_graphs(monkeypatch):
    runner = _runner(one_row=True)
    calls = _calls(runner, monkeypatch)
    maker = PlanMaker(BLOCK_SIZE, 64)
    maker.admit("a", [3, 17, 200])
    maker.admit("b", [8, 1])
    maker.learn(run_step(runner, maker.plan([("a", 3), ("b", 2)])).sampled)
    maker.learn(run_step(runner, maker.plan([("a", 1), ("b", 1)])).sampled)
    assert calls[0] == 0
    maker.finish("b")
    run_step(runner, maker.plan([("a", 1)]))
    assert calls[0] == 1


@pytest.mark.parametrize(
    ("cache_dtype", "compute_dtype", "avx512", "traced"),
    [
        (torch.bfloat16, torch.bfloat16, True, True),  # weighed in place
        (torch.float32, torch.float32, False, True),  # weighed in place
        (torch.float32, torch.float32, True, True),  # gathered
        (torch.float16, torch.float16, False, False),
        (torch.float8_e4m3fn, torch.bfloat16, False, False),  # its scales: the layer graphs
        (torch.bfloat16, torch.float32, False, False),
    ],
)
def test_which_pools_the_graph_attends_over(
    monkeypatch, cache_dtype, compute_dtype, avx512, traced
):
    monkeypatch.setattr(kv_cache, "_has_avx512", lambda: avx512)
    keys, values = (
        empty_kv_cache(8, BLOCK_SIZE, 2, 16, cache_dtype, torch.device("cpu"), layout)
        for layout in torch_path_layouts(cache_dtype)
    )
    assert attends_in_graph(keys, values, compute_dtype) is traced


def test_a_step_the_graph_would_compile_again_for_turns_it_off(monkeypatch, caplog):
    expected = _lone_sequence(_runner(one_row=False), 3)
    runner = _runner(one_row=True)
    step = runner.model_step._one_row
    forward = step.forward

    def int32_positions(context, input_ids, positions):
        # The graph's guards expect int64 positions, so it would compile again.
        return forward(context, input_ids, positions.int())

    monkeypatch.setattr(step, "forward", int32_positions)
    with caplog.at_level(logging.WARNING, logger="aioserve"):
        got = _lone_sequence(runner, 3)
    assert not runner.model_step._one_row.ready
    assert "no longer fits" in caplog.text
    assert [token for token, _, _ in got] == [token for token, _, _ in expected]


def test_a_setting_the_trace_read_changing_sends_the_step_through_the_guards(monkeypatch):
    expected = [token for token, _, _ in _lone_sequence(_runner(one_row=False), 3)]
    runner = _runner(one_row=True)
    guarded = _guarded_calls(runner, monkeypatch)
    maker = PlanMaker(BLOCK_SIZE, 64)
    assert [token for token, _, _ in _lone_sequence(runner, 3, maker)] == expected
    assert guarded[0] == 1
    # "torch" runs the same kernels on the CPU as "auto", but the graph guards on the
    # value: checked again, it would compile again, so the step turns it off.
    monkeypatch.setattr(dispatch, "_backend", "torch")
    assert [token for token, _, _ in _lone_sequence(runner, 3, maker, "t")] == expected
    assert guarded[0] == 2
    assert not runner.model_step._one_row.ready
