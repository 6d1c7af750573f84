"""Decode steps padded to the graph sizes, from static buffers (runner/decode_graphs.py), on
the CPU: which steps are padded and how (and what --cudagraph-metrics reports of them),
and that padding changes no token or logprob."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aioserve.config.compilation import CompilationSettings
from aioserve.runner.cudagraph_stats import CUDAGraphSettings, CUDAGraphStat
from aioserve.runner.decode_graphs import capture_sizes
from aioserve.runner.step_plan import SamplingSettings
from tests.runner.plans import PlanMaker, record_padded_sizes, run_step, tiny_runner
from tests.runner.test_model_runner import PROMPTS, greedy_run, hf_greedy


@pytest.mark.parametrize(
    "requested, max_num_seqs, expected",
    [
        ([], 8, [1, 2, 4, 8]),  # N = 2 * max_num_seqs = 16, cut at max_num_seqs
        ([], 256, [1, 2, 4, *range(8, 257, 8)]),
        ([], 1024, [1, 2, 4, *range(8, 513, 8)]),  # N = 512 at most
        ([20], 256, [1, 2, 4, 8, 16]),
        ([3], 256, [1, 2]),
        ([64, 1, 2, 64], 256, [1, 2, 64]),  # a list is taken as given, sorted
        ([1, 300], 256, [1]),
    ],
)
def test_capture_sizes_follow_vllms_pattern(requested, max_num_seqs, expected):
    assert capture_sizes(requested, max_num_seqs) == expected


def _prepared(runner, maker, steps, known=True):
    return runner.prepare(maker.plan(steps, known=known)).inputs


def test_a_decode_step_is_padded_to_the_next_size_with_rows_that_write_nothing():
    _, runner = tiny_runner(decode_graph_sizes=[1, 2, 4], block_size=4)
    maker = PlanMaker(4, 64)
    for seq_id in PROMPTS:
        maker.admit(seq_id, PROMPTS[seq_id])
    prefill = _prepared(runner, maker, [(s, len(p)) for s, p in PROMPTS.items()])
    assert prefill.graph_size == 0, "a prefill step runs as it is"
    for seq_id in PROMPTS:
        maker.seqs[seq_id].tokens.append(1)  # as if sampled and learned
        maker.seqs[seq_id].pending = 0
    step = _prepared(runner, maker, [(s, 1) for s in PROMPTS])
    assert step.graph_size == 4
    assert step.input_ids.shape == step.positions.shape == (4,)
    assert step.slot_mapping[3] == -1 and step.positions[3] == 0 and step.input_ids[3] == 0
    assert step.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert step.seq_lens.tolist() == [len(p) + 1 for p in PROMPTS.values()] + [1]
    graphs = runner.decode_graphs
    assert step.block_tables.shape == (4, graphs.max_blocks)
    assert not step.block_tables[3].any()
    assert step.logits_indices.tolist() == [0, 1, 2], "padding rows are never sampled"


def test_cudagraph_metrics_see_the_padding_and_a_replay_only_where_a_graph_was_captured():
    _, runner = tiny_runner(decode_graph_sizes=[1, 2, 4], block_size=4)
    assert runner.graph_settings == CUDAGraphSettings("NONE", (1, 2, 4)), "the CPU captures none"
    maker = PlanMaker(4, 64)
    for seq_id in PROMPTS:
        maker.admit(seq_id, PROMPTS[seq_id], output=[5])
    prefill = runner.prepare(maker.plan([(s, len(p)) for s, p in PROMPTS.items()]))
    num_prompt_tokens = sum(len(p) for p in PROMPTS.values())
    assert runner.graph_stat(prefill) == CUDAGraphStat(
        num_prompt_tokens, num_prompt_tokens, 0, "NONE"
    )
    decode = runner.prepare(maker.plan([(s, 1) for s in PROMPTS], known=False))
    assert runner.graph_stat(decode) == CUDAGraphStat(3, 4, 1, "NONE")
    runner.decode_graphs.graphs[4] = object()  # as `capture` files size 4's graph on a GPU
    assert runner.graph_stat(decode) == CUDAGraphStat(3, 4, 1, "FULL")


def test_steps_past_the_largest_size_or_the_capture_length_run_as_they_are():
    _, runner = tiny_runner(decode_graph_sizes=[1, 2], block_size=4, max_seq_len_to_capture=12)
    assert runner.decode_graphs.max_blocks == 3
    maker = PlanMaker(4, 64)
    for seq_id in PROMPTS:
        maker.admit(seq_id, PROMPTS[seq_id], output=[5])
    run_step(runner, maker.plan([(s, len(p)) for s, p in PROMPTS.items()]))
    assert _prepared(runner, maker, [(s, 1) for s in PROMPTS]).graph_size == 0, "3 > 2 rows"
    # "a" reaches 12 tokens of context, "b" stays under: only "b" fits the capture length.
    assert _prepared(runner, maker, [("b", 1)], known=False).graph_size == 1
    assert _prepared(runner, maker, [("a", 1)], known=False).graph_size == 0


@pytest.mark.parametrize("known", [True, False])
def test_padded_steps_give_the_same_greedy_tokens_as_unpadded_ones(known):
    hf, plain = tiny_runner()
    _, padded = tiny_runner(decode_graph_sizes=[2, 8])
    padded_steps = record_padded_sizes(padded)
    out = greedy_run(padded, 4, 8, known=known)
    assert out == greedy_run(plain, 4, 8, known=known)
    assert out["a"] == hf_greedy(hf, PROMPTS["a"], 8)
    # Three decodes a step, padded to 8; two once "b", a step ahead, is done.
    assert padded_steps and set(padded_steps) == {2, 8}


@pytest.mark.gpu
@pytest.mark.parametrize("known", [True, False])
def test_replayed_graphs_give_the_eager_steps_tokens_on_a_gpu(known, triton_backend):
    _, eager = tiny_runner(device="cuda")
    _, graphed = tiny_runner(decode_graph_sizes=[1, 2, 4, 8], device="cuda")
    graphed.warm_up()
    assert sorted(graphed.decode_graphs.graphs) == [1, 2, 4, 8]
    replays = record_padded_sizes(graphed)
    out = greedy_run(graphed, 4, 8, known=known)
    assert out == greedy_run(eager, 4, 8, known=known)
    assert set(replays) == {2, 4}


def test_padded_steps_keep_seeded_samples_and_logprobs():
    settings = SamplingSettings(temperature=0.9, top_k=50, top_p=0.9, min_p=0.0, seed=7, logprobs=3)
    results = []
    for sizes in (None, [4]):
        _, runner = tiny_runner(decode_graph_sizes=sizes)
        assert (runner.decode_graphs is None) == (sizes is None)
        maker = PlanMaker(4, 64)
        maker.admit("s", PROMPTS["a"], settings)
        maker.admit("t", PROMPTS["b"], settings)
        steps = [run_step(runner, maker.plan([("s", len(PROMPTS["a"])), ("t", 4)]))]
        maker.learn(steps[-1].sampled)
        for _ in range(5):
            steps.append(run_step(runner, maker.plan([("s", 1), ("t", 1)], known=False)))
            maker.learn(steps[-1].sampled)
        results.append(steps)
    plain, padded = results
    for a, b in zip(plain, padded, strict=True):
        assert a.sampled == b.sampled
        for seq_id, lps in a.logprobs.items():
            got, want = b.logprobs[seq_id][0], lps[0]
            assert got.top_token_ids == want.top_token_ids
            assert got.sampled_rank == want.sampled_rank
            np.testing.assert_allclose(got.top_logprobs, want.top_logprobs, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(got.sampled_logprob, want.sampled_logprob, rtol=1e-5)


def test_padding_rows_write_no_kv_slot():
    _, runner = tiny_runner(decode_graph_sizes=[8], num_blocks=16)
    runner.warm_up()  # the pool is zeroed on a thread: the snapshot must come after it
    before = [cache.clone() for pair in runner.kv_caches for cache in pair]
    maker = PlanMaker(4, 16)
    maker.admit("b", PROMPTS["b"], output=[7])
    run_step(runner, maker.plan([("b", 4)]))
    written = [cache.clone() for pair in runner.kv_caches for cache in pair]
    run_step(runner, maker.plan([("b", 1)]))  # one real row, seven padding rows
    slot = maker.seqs["b"].blocks[1] * 4  # the decode's position 4: block 1, offset 0
    for old, new in zip(written, (c for pair in runner.kv_caches for c in pair), strict=True):
        changed = (old != new).flatten(1).any(1)
        changed[slot // 4] = False  # the real row's block
        assert not changed.any(), "a padding row wrote into the KV cache"
    assert any((a != b).any() for a, b in zip(before, written, strict=True))
    torch.testing.assert_close(runner.kv_caches[0][0][0], before[0][0])


@pytest.mark.parametrize(
    "platform, requested, enforce_eager, expected",
    [
        ("cpu", [], False, []),  # nothing to capture on the CPU unless asked
        ("cpu", [4], False, [1, 2, 4]),
        ("cuda", [], False, [1, 2, 4, 8]),  # N = min(2 * 8, 512) = 16, cut at max_num_seqs 8
        ("rocm", [2, 8], False, [2, 8]),
        ("cuda", [], True, []),
        ("cpu", [4], True, []),
    ],
)
def test_the_engine_pads_where_graphs_are_captured_or_sizes_given(
    monkeypatch, platform, requested, enforce_eager, expected
):
    from aioserve.engine import resolution

    monkeypatch.setattr(resolution, "current_platform", lambda: platform)
    sizes = resolution.resolve_decode_graph_sizes(
        requested, 8, enforce_eager, CompilationSettings()
    )
    assert sizes == expected
