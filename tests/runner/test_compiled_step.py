"""The model step compiled by torch.compile gives the greedy tokens of the eager step.

Each tiny architecture runs the same chunked, mixed prefill/decode schedule on a compiled
and an eager runner with the same weights (float32); the greedy tokens must be equal. With
bfloat16 row weights (dtype auto on a float32 CPU) a lone decode reads the bfloat16 copies:
its logits must be those of the eager step on the rounded weights. A compile failure must
leave a working eager step and a warning naming the cause.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from torch._dynamo.utils import counters

from aioserve.kernels import dispatch
from aioserve.models.linear import SMALL_BATCH_ROWS, keep_row_weights, onednn_packs
from aioserve.runner import compiled_step
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
    """A layer's index is data to the graph, not a constant: warm-up compiles as many
    graphs for six layers as for two. (The attention op's schema once took the index as a
    plain int; dynamo then guarded on it, compiled a graph per layer, and past its limit of
    8 graphs ran SmolLM2's other layers eagerly.) The one-row step is left out: its graph,
    of the whole model, is read back from disk where an earlier run filed it."""
    graphs = {}
    for num_layers in (2, 6):
        torch._dynamo.reset()
        counters.clear()
        _, runner = tiny_runner(num_layers=num_layers, compile_model=True)
        runner.model_step._one_row = None
        runner.warm_up()
        assert runner.model_step.compiled
        graphs[num_layers] = counters["stats"]["unique_graphs"]
    assert graphs[6] == graphs[2], graphs


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


def test_a_step_of_a_size_seen_before_checks_the_guards_once_and_gives_the_same_tokens(
    monkeypatch,
):
    # dynamo keeps at most 8 graphs of a code object, and every runner of this process
    # compiled DecoderLayer.forward: past that limit it runs the layer eagerly, which
    # the dispatch then leaves to torch.compile.
    torch._dynamo.reset()
    _, eager = tiny_runner()
    _, runner = tiny_runner(compile_model=True)
    runner.warm_up()
    num_layers = len(runner.model.layers)
    calls = _count_compiled_calls(runner, monkeypatch)
    maker = PlanMaker(4, 64)
    first, entered = _greedy_tokens(runner, maker, "first", calls)
    # 8 tokens, a size warm-up did not run: through torch.compile; 2 tokens (warm-up's):
    # each layer's graph called directly.
    assert entered == [num_layers, 0, 0, 0, 0]
    again, entered = _greedy_tokens(runner, maker, "again", calls)
    assert entered == [0, 0, 0, 0, 0]
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
    def broken(fn):
        def run(*args, **kwargs):
            raise RuntimeError("no C++ compiler found")

        return run

    monkeypatch.setattr(compiled_step, "_compile", broken)
    _, runner = tiny_runner(compile_model=True)
    with caplog.at_level(logging.WARNING, logger="aioserve"):
        runner.warm_up()
    assert not runner.model_step.compiled
    assert (
        "compiling the model step failed, running it eagerly: RuntimeError: no C++ compiler found"
        in caplog.text
    )
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
