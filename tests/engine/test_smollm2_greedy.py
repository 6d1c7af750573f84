"""The default model, end to end: greedy token ids equal transformers' on the same GGUF.

The same prompts run one at a time, all in one batch, with chunked prefill (64-token
budget), with a KV pool small enough to force preemption, and with prefix caching over
prompts that share a long prefix. Each configuration must reproduce transformers exactly.
The first two run the model step compiled (the default on the CPU), the others eagerly
(--enforce-eager), so both give transformers' tokens. On the compiled engine, seeded random
requests also draw the same tokens by the sampler's compiled race as by its eager one.
"""

from __future__ import annotations

import pytest

from aioserve import LLM, SamplingParams
from tests.engine.smollm2 import NEW_TOKENS, hf_greedy, prompts, shared_prefix_prompts
from tests.runner.plans import record_padded_sizes

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(smollm2_gguf):
    with LLM(model=str(smollm2_gguf), dtype="float32") as engine:
        assert engine.engine.runner.model_step.compiled
        yield engine


@pytest.fixture(scope="module")
def cases(llm, smollm2_gguf):
    ids = prompts(llm.get_tokenizer())
    assert len(ids) >= 8
    assert max(len(p) for p in ids.values()) > 500, "one prompt must be over 500 tokens"
    return {name: (p, hf_greedy(str(smollm2_gguf), p)) for name, p in ids.items()}


def generate_ids(engine: LLM, prompt_ids: list[list[int]]) -> list[list[int]]:
    outputs = engine.generate([{"prompt_token_ids": p} for p in prompt_ids], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def assert_all_match(names, got, cases):
    for name, tokens in zip(names, got, strict=True):
        assert tokens == cases[name][1], f"prompt {name!r} diverges from transformers"


def test_one_at_a_time(llm, cases):
    for name, (prompt_ids, expected) in cases.items():
        assert generate_ids(llm, [prompt_ids]) == [expected], (
            f"prompt {name!r} diverges from transformers"
        )


def test_all_in_one_batch(llm, cases):
    names = list(cases)
    assert_all_match(names, generate_ids(llm, [cases[n][0] for n in names]), cases)


def test_the_compiled_race_draws_the_eager_samplers_tokens(llm, cases):
    runner = llm.engine.runner
    race = runner.race
    assert race is not None, "a compiled CPU engine draws random rows by the compiled race"
    requests = [{"prompt_token_ids": prompt} for prompt, _ in list(cases.values())[:3]]
    # Rows with no mask, then rows whose min-p keeps nearly every token (the masked graph).
    settings = [{"temperature": 1.0}, {"temperature": 1.5, "min_p": 1e-9}]

    def draws() -> list[list[int]]:
        tokens = []
        for extra in settings:
            params = [
                SamplingParams(seed=seed, max_tokens=16, ignore_eos=True, **extra)
                for seed in range(len(requests))
            ]
            outputs = llm.generate(requests, params, use_tqdm=False)
            tokens += [output.outputs[0].token_ids for output in outputs]
        return tokens

    taken = []  # for each call, whether it had a keep mask and the compiled graph took it

    def recording(s, row_max, keep, keys):
        graph = race.graphs[keep is not None]
        taken.append((keep is not None, graph.guard_check(s, row_max, keep, keys)))
        return race(s, row_max, keep, keys)

    runner.race = recording
    try:
        compiled = draws()
        runner.race = None
        eager = draws()
    finally:
        runner.race = race
    assert set(taken) == {(False, True), (True, True)}
    assert compiled == eager


def test_chunked_prefill_with_a_64_token_budget(smollm2_gguf, cases):
    with LLM(
        model=str(smollm2_gguf),
        dtype="float32",
        max_num_batched_tokens=64,
        enable_chunked_prefill=True,
        enforce_eager=True,
    ) as engine:
        assert not engine.engine.runner.model_step.compiled
        names = list(cases)
        assert_all_match(names, generate_ids(engine, [cases[n][0] for n in names]), cases)


def test_preemption_by_recompute(smollm2_gguf, cases):
    # 72 blocks of 16 tokens: room for the longest request, far from room for all of them.
    with LLM(
        model=str(smollm2_gguf),
        dtype="float32",
        max_model_len=1024,
        num_gpu_blocks_override=72,
        block_size=16,
        enable_prefix_caching=False,
        enforce_eager=True,
    ) as engine:
        names = list(cases)
        got = generate_ids(engine, [cases[n][0] for n in names])
        assert engine.engine.scheduler.stats.num_preemptions > 0, (
            "the pool was meant to force preemption"
        )
        assert engine.engine.kv_cache.num_free_blocks == 72, "blocks leaked"
        assert_all_match(names, got, cases)


def test_prefix_caching_hits_and_keeps_outputs_exact(smollm2_gguf):
    with LLM(
        model=str(smollm2_gguf), dtype="float32", enable_prefix_caching=True, enforce_eager=True
    ) as engine:
        shared = shared_prefix_prompts(engine.get_tokenizer())
        expected = [hf_greedy(str(smollm2_gguf), p) for p in shared]
        first = generate_ids(engine, shared[:1])
        stats = engine.engine.kv_cache.stats
        hits_before = stats.hits
        rest = generate_ids(engine, shared[1:])
        assert stats.hits - hits_before >= 16 * 10, "the shared prefix should come from the cache"
        assert first + rest == expected


def test_decode_steps_padded_to_graph_sizes_from_static_buffers(smollm2_gguf, cases):
    # The CPU captures no graph, but given --cuda-graph-sizes it pads decode steps to them
    # and runs them from the static buffers a GPU's graphs read (runner/decode_graphs.py).
    with LLM(model=str(smollm2_gguf), dtype="float32", cuda_graph_sizes=[1, 2, 4, 16]) as engine:
        graphs = engine.engine.runner.decode_graphs
        assert graphs is not None and not graphs.graphs
        padded = record_padded_sizes(engine.engine.runner)
        names = list(cases)
        assert_all_match(names, generate_ids(engine, [cases[n][0] for n in names]), cases)
        assert 16 in padded, "the batch's decode steps should be padded to 16"
        assert_all_match(names[:1], generate_ids(engine, [cases[names[0]][0]]), cases)
        assert padded[-1] == 1
