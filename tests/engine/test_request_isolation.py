"""One request's odd settings or id must not end, stall or corrupt another request.

Each case here used to take the whole engine down or leave another request hanging: a
top_k too large for an int32, a seed that overflows when n > 1 adds the sample index, a
request id equal to another request's sibling name, an input-building error outside the
step's error handling.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from aioserve import RequestOutputKind, SamplingParams
from aioserve.engine.structured_outputs.params import StructuredOutputsParams
from tests.engine.smollm2 import collect, float32_engine

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def engine(smollm2_gguf):
    engine = float32_engine(smollm2_gguf, max_model_len=1024)
    yield engine
    asyncio.run(engine.shutdown())


def final_token_ids(engine, params, request_id) -> list[list[int]]:
    outputs = asyncio.run(collect(engine, PROMPT, params, request_id))
    return [sample.token_ids for sample in outputs[-1].outputs]


def yes_or_no(engine) -> tuple[int, int, dict[int, float]]:
    """The tokens " yes" and " no", and a logit_bias that gives " yes" the logit of " no" at
    PROMPT's first sample, so that a draw between the two comes up either way (temperature
    stops at vLLM's 2)."""
    word, stop = engine.tokenizer.encode(" yes")[0], engine.tokenizer.encode(" no")[0]

    def logprob(token: int) -> float:
        params = SamplingParams(
            temperature=0.0, max_tokens=1, logprobs=0, allowed_token_ids=[token]
        )
        (sample,) = asyncio.run(collect(engine, PROMPT, params, f"odds-{token}"))[-1].outputs
        return sample.logprobs[0][token].logprob

    return word, stop, {word: logprob(stop) - logprob(word)}


def assert_idle(engine) -> None:
    assert not engine.is_dead
    assert engine.num_unfinished_requests == 0
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_top_k_beyond_the_vocabulary_means_no_top_k(engine):
    sampled = dict(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    huge = final_token_ids(engine, SamplingParams(top_k=2**31, **sampled), "huge-top-k")
    unlimited = final_token_ids(engine, SamplingParams(top_k=-1, **sampled), "no-top-k")
    assert huge == unlimited
    assert_idle(engine)


def test_sibling_seeds_wrap_around_int64(engine):
    sampled = dict(temperature=1.0, max_tokens=8, ignore_eos=True)
    top = final_token_ids(engine, SamplingParams(n=2, seed=2**63 - 1, **sampled), "top-seed")
    # Sample 1 of seed 2**63 - 1 is seeded with 2**63, which wraps to -2**63.
    bottom = final_token_ids(engine, SamplingParams(seed=-(2**63), **sampled), "bottom-seed")
    assert top[1] == bottom[0]
    assert_idle(engine)


def test_a_request_id_cannot_take_a_running_siblings_name(engine):
    async def scenario():
        params = SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=8, ignore_eos=True)
        stream = engine.generate(PROMPT, params, "family")
        first = await anext(stream)
        with pytest.raises(ValueError, match="'family#1' is already running"):
            engine.add_request("family#1", PROMPT, SamplingParams(max_tokens=2))
        rest = [out async for out in stream]
        # The other way round: siblings may not take the name of a running request.
        single = engine.generate(PROMPT, SamplingParams(max_tokens=8), "solo#0")
        await anext(single)
        with pytest.raises(ValueError, match="'solo#0' is already running"):
            engine.add_request("solo", PROMPT, SamplingParams(n=2, max_tokens=2))
        await single.aclose()
        return [first, *rest]

    outputs = asyncio.run(asyncio.wait_for(scenario(), timeout=120))
    final = outputs[-1]
    assert final.finished
    assert [s.finish_reason for s in final.outputs] == ["length", "length"]
    assert all(len(s.token_ids) == 8 for s in final.outputs)
    assert_idle(engine)


def test_a_failure_while_building_inputs_fails_only_that_step(engine, monkeypatch):
    prepare = engine.runner.prepare
    calls = 0

    def fail_first(plan):
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("injected input failure")
        return prepare(plan)

    monkeypatch.setattr(engine.runner, "prepare", fail_first)
    with pytest.raises(RuntimeError, match="injected input failure"):
        final_token_ids(engine, SamplingParams(max_tokens=4), "fails")
    assert_idle(engine)
    assert len(final_token_ids(engine, SamplingParams(max_tokens=4), "after")[0]) == 4


def test_a_sibling_that_fails_to_register_leaves_no_sibling_behind(engine, monkeypatch):
    """All or nothing: the second of three siblings fails as its output is set up, after
    the first was registered and queued; none stays registered, queued or holding blocks,
    and the id is free again."""
    new_sample = engine.output_processor.new_sample

    def fail_second(index, request):
        if index == 1:
            raise RuntimeError("injected registration failure")
        return new_sample(index, request)

    params = SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=4, ignore_eos=True)
    with monkeypatch.context() as patch:
        patch.setattr(engine.output_processor, "new_sample", fail_second)
        with pytest.raises(RuntimeError, match="injected registration failure"):
            asyncio.run(collect(engine, PROMPT, params, "half-registered"))
    assert not engine.scheduler.has_unfinished()
    assert_idle(engine)
    tokens = final_token_ids(engine, params, "half-registered")
    assert [len(t) for t in tokens] == [4, 4, 4]


class _RefusingMatcher:
    """A structured-output matcher that fills its mask as the real one does and then
    refuses every token: the constraint's own failure, which ends only its sequence."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def fill_bitmask(self, words) -> None:
        self.matcher.fill_bitmask(words)

    def accept(self, token_id: int) -> bool:
        raise RuntimeError("injected matcher failure")


def test_a_broken_constraint_beside_a_sibling_that_stopped_ends_only_that_request(
    engine, monkeypatch
):
    """n=2 with a structured output: in one step, one sibling samples its stop token (which
    also completes its stop string) while the other's matcher fails. Ending the failed one
    ended the request and forgot both siblings before the stopped one was recorded, and the
    lookup of it killed the engine."""
    word, stop, odds = yes_or_no(engine)
    new_matcher = engine.structured_outputs.new_matcher
    monkeypatch.setattr(
        engine.structured_outputs, "new_matcher", lambda spec: _RefusingMatcher(new_matcher(spec))
    )
    seen = set()
    for seed in range(12):
        params = SamplingParams(
            n=2,
            temperature=1.0,
            logit_bias=odds,
            seed=seed,
            max_tokens=8,
            allowed_token_ids=[word, stop],
            stop_token_ids=[stop],
            stop=[" no"],
            include_stop_str_in_output=True,
            structured_outputs=StructuredOutputsParams(regex="( yes| no)+"),
        )
        outputs = asyncio.run(collect(engine, PROMPT, params, f"broken-{seed}"))
        reasons = sorted(sample.finish_reason for sample in outputs[-1].outputs)
        seen.add(tuple(reasons))
        assert_idle(engine)
    assert ("error", "stop") in seen  # the case arose


def test_logprobs_beyond_the_vocabulary_are_refused_without_a_limit(engine, monkeypatch):
    monkeypatch.setattr(engine, "settings", dataclasses.replace(engine.settings, max_logprobs=-1))
    vocab = engine.hf_config.vocab_size
    with pytest.raises(ValueError, match=f"greater than the vocabulary size of {vocab}"):
        engine.add_request("greedy-logprobs", PROMPT, SamplingParams(logprobs=vocab + 1))
    assert_idle(engine)


def test_an_abort_does_not_end_a_finished_sibling_twice(engine):
    """n=2 in DELTA mode: a sibling that stopped says so once, the abort ends only the other."""
    word, stop, odds = yes_or_no(engine)

    async def one_sibling_stops_then_abort(seed: int) -> list | None:
        params = SamplingParams(
            n=2,
            temperature=1.0,
            logit_bias=odds,
            seed=seed,
            max_tokens=64,
            allowed_token_ids=[word, stop],
            stop_token_ids=[stop],
            output_kind=RequestOutputKind.DELTA,
        )
        request_id = f"abort-after-stop-{seed}"
        queue = engine.add_request(request_id, PROMPT, params)
        outputs, ended = [], set()
        while True:
            output = await asyncio.wait_for(queue.get(), timeout=60)
            outputs.append(output)
            ended |= {s.index for s in output.outputs if s.finish_reason is not None}
            if output.finished:
                return None  # both siblings ended in the same step: no case to test
            if ended:
                engine.abort(request_id)
                while not queue.empty():
                    outputs.append(queue.get_nowait())
                return outputs

    for seed in range(20):
        outputs = asyncio.run(one_sibling_stops_then_abort(seed))
        if outputs is not None:
            break
    else:
        pytest.fail("no seed made one sibling stop before the other")
    assert outputs[-1].finished
    reasons = [(s.index, s.finish_reason) for o in outputs for s in o.outputs if s.finish_reason]
    assert sorted(reasons) in ([(0, "stop"), (1, "abort")], [(0, "abort"), (1, "stop")])
    assert_idle(engine)


def test_an_id_reused_while_its_aborted_request_is_in_a_step_gets_only_its_own_tokens(engine):
    greedy = SamplingParams(temperature=0, max_tokens=6)
    other_prompt = "Water boils at a temperature of"
    expected = asyncio.run(collect(engine, other_prompt, greedy, "reference"))[-1].outputs[0]

    async def scenario():
        first = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=50), "reused")
        await anext(first)  # the engine loop has already started the next step with it
        engine.abort("reused")
        second = engine.generate(other_prompt, greedy, "reused")
        outputs = [await anext(second)]
        await first.aclose()  # the old consumer leaving must not abort the new request
        outputs += [out async for out in second]
        return outputs[-1].outputs[0]

    again = asyncio.run(asyncio.wait_for(scenario(), timeout=120))
    assert again.token_ids == expected.token_ids
    assert again.text == expected.text
    assert_idle(engine)
