"""The model step compiled by torch.compile gives the greedy tokens of the eager step.

Each tiny architecture runs the same chunked, mixed prefill/decode schedule on a compiled
and an eager runner with the same weights (float32); the greedy tokens must be equal. With
bfloat16 row weights (dtype auto on a float32 CPU) a lone decode reads the bfloat16 copies:
its logits must be those of the eager step on the rounded weights. Warm-up's graphs
(compiled ahead of time, and read back by a later runner) serve steps of any size, one
graph for every layer, their guards checked once a step. A compile failure must leave a
working eager step and a warning naming the cause.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from torch._dynamo.utils import counters

from aioserve.kernels import dispatch
from aioserve.models.linear import SMALL_BATCH_ROWS, keep_row_weights, onednn_packs
from aioserve.runner import ahead_graphs, compiled_step, layer_dispatch
from aioserve.runner.ahead_graphs import AheadGraph
from aioserve.runner.graph_archive import archive_path
from tests.runner.call_counts import count_calls
from tests.runner.plans import GREEDY, PlanMaker, run_step, tiny_runner
from tests.runner.test_model_runner import greedy_run

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "config_name", ["llama-gqa4-llama3-rope", "mistral", "qwen2-tied", "qwen3"]
)
def test_compiled_greedy_tokens_equal_eager(config_name):
    _, eager = tiny_runner(config_name)
    _, compiled = tiny_runner(config_name, compile_model=True)
    compiled.warm_up()
    assert compiled.model_step.compiled
    assert greedy_run(compiled, 4, 8, known=False) == greedy_run(eager, 4, 8, known=False)


@pytest.mark.skipif(
    not onednn_packs(torch.bfloat16), reason="this CPU's oneDNN has no bfloat16 packed products"
)
@pytest.mark.parametrize("config_name", ["llama-gqa4-llama3-rope", "qwen2-tied"])
def test_compiled_steps_on_packed_weights_give_the_eager_steps_tokens(config_name):
    # bfloat16 with the weights packed for oneDNN, the products an opaque op in the graph;
    # one graph still serves every layer (no compile after warm-up), and the eager step on
    # the same packed weights gives the same greedy tokens.
    _, eager = tiny_runner(config_name, dtype=torch.bfloat16, packed_weights=True)
    _, compiled = tiny_runner(
        config_name, dtype=torch.bfloat16, packed_weights=True, compile_model=True
    )
    compiled.warm_up()
    assert compiled.model_step.compiled
    assert compiled.model.layers[0].mlp.down_proj.packed_weight is not None
    counters.clear()
    tokens = greedy_run(compiled, 4, 8, known=False)
    assert not counters["stats"]["unique_graphs"], dict(counters["stats"])
    assert tokens == greedy_run(eager, 4, 8, known=False)


@pytest.mark.parametrize("config_name", ["llama-gqa4-llama3-rope", "qwen2-tied"])
def test_a_lone_decode_on_bfloat16_row_weights_equals_eager_on_the_rounded_weights(config_name):
    _, eager = tiny_runner(config_name)
    keep_row_weights(eager.model, torch.bfloat16)  # eagerly only the rounding matters
    _, compiled = tiny_runner(config_name, compile_model=True, row_weight_dtype=torch.bfloat16)
    compiled.warm_up()
    assert compiled.model.layers[0].mlp.down_proj.row_weight.dtype == torch.bfloat16
    top = {}
    for name, runner in (("eager", eager), ("compiled", compiled)):
        maker = PlanMaker(4, 64)
        maker.admit("s", [3, 17, 200, 45, 9, 88], dataclasses.replace(GREEDY, logprobs=5))
        top[name] = []
        for steps in ([("s", 6)], [("s", 1)], [("s", 1)], [("s", 1)]):
            result = run_step(runner, maker.plan(steps))
            (logprobs,) = result.logprobs["s"]
            top[name].append((logprobs.top_token_ids, logprobs.top_logprobs))
            maker.learn(result.sampled)
    for (eager_ids, eager_values), (ids, values) in zip(top["eager"], top["compiled"], strict=True):
        assert ids == eager_ids
        # Float32 arithmetic on both sides, summed in another order.
        assert values == pytest.approx(eager_values, abs=1e-4)


def test_after_warm_up_no_step_compiles_again():
    """Warm-up compiles every graph a step can need: whatever its token count (one, a few,
    either side of SMALL_BATCH_ROWS, a long prefill) and its sampled rows."""
    _, runner = tiny_runner(compile_model=True, num_blocks=128)
    runner.warm_up()
    graphs = counters["stats"]["unique_graphs"]
    maker = PlanMaker(4, 128)
    maker.admit("a", [3 + i % 40 for i in range(SMALL_BATCH_ROWS + 24)])
    for size in (SMALL_BATCH_ROWS + 1, 22, 1):
        run_step(runner, maker.plan([("a", size)]))
    maker.admit("b", [7] * SMALL_BATCH_ROWS)
    maker.learn(run_step(runner, maker.plan([("b", SMALL_BATCH_ROWS)])).sampled)
    names = [f"s{i}" for i in range(6)]
    for i, name in enumerate(names):
        maker.admit(name, [5 + i] * (2 + i))
    maker.learn(run_step(runner, maker.plan([(n, 2 + i) for i, n in enumerate(names)])).sampled)
    for batch in (names, names[:2], names[:1], ["b", *names]):
        maker.learn(run_step(runner, maker.plan([(n, 1) for n in batch])).sampled)
    # Prompt logprobs put a whole chunk's rows through the head, in slices.
    maker.finish("a")
    maker.finish("b")
    scored = dataclasses.replace(GREEDY, prompt_logprobs=2)
    maker.admit("p", [9 + i % 30 for i in range(SMALL_BATCH_ROWS + 100)], scored)
    assert run_step(runner, maker.plan([("p", SMALL_BATCH_ROWS + 100)])).prompt_logprobs["p"]
    assert counters["stats"]["unique_graphs"] == graphs


def test_one_graph_of_a_decoder_layer_serves_every_layer():
    """A layer's index is data to the graph, not a constant: each step of warm-up runs all
    six layers through one graph. (The attention op's schema once took the index as a
    plain int; dynamo then guarded on it, compiled a graph per layer, and past its limit of
    8 graphs ran SmolLM2's other layers eagerly.)"""
    _, runner = tiny_runner(num_layers=6, compile_model=True)
    runner.model_step._one_row = None
    runner.warm_up()
    layers = runner.model_step._layers
    assert runner.model_step.compiled and len(layers._graphs) == 3
    for graphs in layers._graphs.values():
        assert len(graphs) == 6
        assert len({id(graph) for graph in graphs}) == 1
    assert len(layers._ahead) <= 3


def test_a_later_runner_reads_the_layer_and_head_graphs_back(monkeypatch, tmp_path):
    # Filed in this test's folder: the first runner compiles every graph, the second
    # reads each back and gives the eager step's tokens.
    def path_in_tmp(name, parts):
        return tmp_path / archive_path(name, parts).name

    monkeypatch.setattr(ahead_graphs, "archive_path", path_in_tmp)
    counts = []
    for _ in range(2):
        _, runner = tiny_runner(compile_model=True)
        runner.model_step._one_row = None
        runner.warm_up()
        step = runner.model_step
        counts.append(
            [(part.graphs_read, part.graphs_compiled) for part in (step._layers, step._head)]
        )
    (_, layers), (_, head) = counts[0]
    assert counts == [[(0, layers), (0, head)], [(layers, 0), (head, 0)]]
    assert layers > 0 and head > 0
    _, eager = tiny_runner()
    assert _greedy_tokens(runner, PlanMaker(4, 64), "r") == _greedy_tokens(
        eager, PlanMaker(4, 64), "e"
    )


def _count_compiled_calls(runner, monkeypatch) -> list[int]:
    """How often the layers enter torch.compile's own wrapper (checking its guards)."""
    return count_calls(monkeypatch, runner.model_step._layers, "_compiled")


def _greedy_tokens(runner, maker, prefix: str, calls: list[int] | None = None):
    """Two prompts (8 tokens in one step), then four decode steps; the sequences finished
    (the next plan says so). With `calls`: also how many layers entered torch.compile in
    each step."""
    ids = [f"{prefix}a", f"{prefix}b"]
    maker.admit(ids[0], [3, 17, 200, 45, 9])
    maker.admit(ids[1], [8, 1, 44])
    tokens, entered = [], []
    for steps in ([(ids[0], 5), (ids[1], 3)], *[[(ids[0], 1), (ids[1], 1)]] * 4):
        before = calls[0] if calls else 0
        sampled = run_step(runner, maker.plan(steps)).sampled
        entered.append((calls[0] if calls else 0) - before)
        tokens.append([sampled[seq_id][0] for seq_id in ids])
        maker.learn(sampled)
    for seq_id in ids:
        maker.finish(seq_id)
    return tokens if calls is None else (tokens, entered)


def test_steps_of_any_size_run_warm_ups_graphs_checking_their_guards_once_a_step(
    monkeypatch,
):
    torch._dynamo.reset()  # as below: a clean record of what torch.compile compiled
    _, eager = tiny_runner()
    _, runner = tiny_runner(compile_model=True)
    runner.warm_up()
    calls = _count_compiled_calls(runner, monkeypatch)
    checks = count_calls(monkeypatch, AheadGraph, "accepts")
    maker = PlanMaker(4, 64)
    # 8 tokens, a size warm-up did not run, then 2 (warm-up's): neither enters torch.compile.
    first, entered = _greedy_tokens(runner, maker, "first", calls)
    assert entered == [0, 0, 0, 0, 0]
    before = checks[0]
    again, entered = _greedy_tokens(runner, maker, "again", calls)
    assert entered == [0, 0, 0, 0, 0]
    # Sizes seen before: the layers' guards checked once a step, the head's once a step.
    assert checks[0] - before == 2 * 5
    assert first == again == _greedy_tokens(eager, PlanMaker(4, 64), "eager")


def test_a_change_the_guards_see_sends_the_step_back_through_torch_compile(monkeypatch):
    torch._dynamo.reset()  # as above
    _, eager = tiny_runner()
    _, runner = tiny_runner(compile_model=True)
    runner.warm_up()
    expected = _greedy_tokens(eager, PlanMaker(4, 64), "eager")
    maker = PlanMaker(4, 64)
    assert _greedy_tokens(runner, maker, "before") == expected
    calls = _count_compiled_calls(runner, monkeypatch)
    # The compiled layer guards on the kernel backend's setting: "torch" is another value
    # with the same kernels on the CPU, so the graph is compiled again, and gives the same
    # tokens.
    monkeypatch.setattr(dispatch, "_backend", "torch")
    tokens, entered = _greedy_tokens(runner, maker, "after", calls)
    assert tokens == expected
    assert entered[0] == len(runner.model.layers)


def test_a_failed_compile_leaves_an_eager_step_and_says_why(monkeypatch, caplog):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    def broken(fn):
        return no_compiler

    # Both ways of compiling fail, as they would with no compiler and no graph filed.
    monkeypatch.setattr(layer_dispatch, "ahead_graph", no_compiler)
    monkeypatch.setattr(compiled_step, "_compile", broken)
    _, runner = tiny_runner(compile_model=True)
    with caplog.at_level(logging.INFO, logger="aioserve"):
        runner.warm_up()
    assert not runner.model_step.compiled
    assert (
        "compiling the model step failed, running it eagerly: RuntimeError: no C++ compiler found"
        in caplog.text
    )
    assert "is not compiled ahead of time" in caplog.text
    maker = PlanMaker(4, 64)
    maker.admit("s", [5, 6, 7, 8])
    assert len(run_step(runner, maker.plan([("s", 4)])).sampled["s"]) == 1


def test_trusting_the_cpu_flags_picks_the_vector_set_inductor_proves(monkeypatch):
    # The shortcut must not change what inductor compiles for: the set it picks from the
    # CPU's flags alone is the one its own build-and-load proof picks on this host.
    from torch._inductor import config as inductor_config
    from torch._inductor import cpu_vec_isa

    monkeypatch.delenv("TORCHINDUCTOR_VEC_ISA_OK", raising=False)
    monkeypatch.setattr(inductor_config.cpp, "vec_isa_ok", None)
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    proved = cpu_vec_isa.pick_vec_isa()
    compiled_step.trust_cpu_flags_for_vector_code()
    assert inductor_config.cpp.vec_isa_ok is True
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    assert str(cpu_vec_isa.pick_vec_isa()) == str(proved)
    cpu_vec_isa.valid_vec_isa_list.cache_clear()


def test_the_compilers_are_hashed_in_the_background_to_inductors_own_keys(monkeypatch):
    # Both keys of inductor's cache start on a thread, and what that thread computes is
    # the key inductor computes itself: a different key would miss the cache on disk.
    from torch._inductor import codecache

    names = ("torch_key", "triton_key")
    expected = {name: getattr(codecache, name)() for name in names}
    started = []
    for name in names:
        key = getattr(codecache, name)
        key.clear()
        prefetch = key.prefetch
        monkeypatch.setattr(
            key, "prefetch", lambda name=name, run=prefetch: (started.append(name), run())
        )
    compiled_step.hash_compiler_versions_in_the_background()
    assert started == list(names)
    assert {name: getattr(codecache, name)() for name in names} == expected
