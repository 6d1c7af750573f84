"""Speculative decoding's bookkeeping without a model: the n-gram proposer against vLLM's
own and a brute-force search, and the scheduler's drafts (how many, where they stop, what
a step's result does to the sequence's progress and KV blocks)."""

from __future__ import annotations

import itertools
import random

import pytest

from aioserve.config.speculative import NgramSpeculation
from aioserve.engine.kv_cache_manager import KVCacheManager
from aioserve.engine.request import Request
from aioserve.engine.sampling_params import SamplingParams
from aioserve.engine.scheduler import Scheduler
from aioserve.engine.speculation import propose_ngram_drafts

# (tokens, prompt_lookup_min, prompt_lookup_max, num_speculative_tokens, drafts): the drafts
# are vLLM 0.32's `_find_longest_matched_ngram_and_propose_tokens` on the same input (run
# from the peers' venv over random sequences, pasted here).
VLLM_CASES = [
    ([3, 2, 3, 2, 2, 1, 3, 0, 2, 2, 3, 2, 1, 1, 1, 1, 2, 3, 0, 3, 2, 1, 2], 2, 3, 2, [3, 0]),
    ([2, 0, 2, 2, 3, 2, 3, 3, 0, 0, 2, 1, 2, 2, 1, 0, 2, 1, 3, 0, 2, 2], 1, 1, 2, [0, 2]),
    ([4, 1, 2, 2, 4, 0, 3, 4, 4, 1, 0, 2, 0, 0, 0, 1, 4, 3, 3, 4, 2, 0, 0, 1], 3, 4, 2, [4, 3]),
    ([0, 1, 2, 2, 2, 3, 0], 1, 1, 3, [1, 2, 2]),
    ([1, 1, 1, 0, 1, 1, 1, 0, 0, 1, 0, 1, 1, 0, 1, 1], 2, 5, 4, [1, 0, 0, 1]),
    ([3, 1, 0, 1, 2, 2, 0, 2, 0, 2, 3, 0, 3, 0, 2, 2, 0, 3, 2, 1], 1, 1, 4, [0, 1, 2, 2]),
    ([0, 0, 1, 0, 0, 0, 1, 0, 1, 0, 0, 0], 2, 3, 3, [1, 0, 1]),
    ([3, 0, 0, 1, 0, 2, 2, 2, 3, 3, 3, 1, 2, 1, 1, 1, 2, 0, 0, 2, 2, 1, 1], 3, 3, 2, [1, 2]),
    ([3, 0, 0, 2, 1, 1, 3, 3, 3, 3, 0, 1, 2, 3, 1, 0, 2, 0, 3, 0, 0, 2, 0], 2, 6, 3, [3, 0, 0]),
    ([0, 1, 1, 0, 1, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 0, 0], 3, 4, 4, [1, 1, 0, 0]),
    ([2, 2, 2, 4, 4, 2, 0, 1, 4, 4, 4, 4, 0, 2, 0, 0, 1, 2, 2, 2, 4, 4, 0], 2, 5, 2, [2, 0]),
    ([0, 0, 2, 1, 1, 2, 0, 2, 0, 0, 2, 1, 3, 3, 3, 0, 2, 3, 0, 3], 1, 2, 3, [3, 3, 0]),
    ([2, 2, 0, 1, 1, 2, 1, 1, 0, 1, 0], 2, 6, 3, [1, 0]),
    ([0, 2, 2, 1, 2, 1, 2, 1, 2, 0, 2], 1, 3, 2, [2, 1]),
    ([1, 3, 4, 2, 1, 1, 2, 4], 1, 5, 3, [2, 1, 1]),
    ([2, 0, 2, 1, 1, 1, 1, 1, 0, 0, 2, 0, 2, 1], 1, 4, 2, [1, 1]),
    ([0, 0, 1, 0, 2, 2, 0, 1], 2, 5, 4, [0, 2, 2, 0]),
    ([1, 1, 1, 0, 0, 1, 1, 0, 1, 0, 2, 2, 2, 2, 1, 0, 0, 0, 0, 2], 1, 6, 3, [2, 2, 2]),
    ([1, 1, 2, 1, 0, 1, 2, 1, 0, 0, 0, 2, 2, 0, 2, 0, 1, 0, 1, 0, 0, 2], 3, 3, 5, [2, 0, 2, 0, 1]),
    ([0, 1, 1, 0, 0, 0, 1, 0, 1, 1, 1, 1, 0, 1, 0, 0, 1, 0, 1, 1, 1], 3, 5, 1, [1]),
    ([0, 0, 1, 1, 0, 0, 0, 0, 0, 1, 1, 0, 1, 1, 0, 1, 0, 0, 0, 0, 1, 0, 1], 3, 4, 3, [1, 0, 1]),
    ([0, 1, 1, 2, 1, 2, 1, 1, 0, 2, 1], 1, 2, 1, [2]),
    ([1, 0, 0, 1, 1], 1, 3, 1, [0]),
    ([2, 2, 0, 1, 1, 0, 0, 2, 1, 0, 0, 1, 0, 1, 2, 1], 2, 5, 1, [0]),
    ([1, 1, 1, 1, 0, 2, 2, 1, 1, 0, 1, 2, 2, 2, 0, 0], 3, 3, 1, []),
    ([1, 1, 3, 4, 4, 0], 3, 4, 4, []),
    ([3, 2, 1, 2, 1, 2, 0, 1, 0, 2], 3, 6, 4, []),
    ([1, 1, 1, 1, 0, 1, 0, 1, 0, 0], 2, 2, 2, []),
    ([2, 3, 0, 1, 2, 0, 0, 3, 1, 3, 1], 3, 3, 4, []),
    ([1, 0, 2, 4, 4, 2, 4, 4, 4, 0, 1, 4, 4, 0, 0, 3, 2], 3, 6, 4, []),
    ([1, 3, 3, 2, 2, 0, 0, 3, 2, 3, 1], 2, 2, 3, []),
    ([0, 1, 1, 2, 1, 2], 3, 4, 5, []),
]


@pytest.mark.parametrize(("tokens", "lookup_min", "lookup_max", "k", "expected"), VLLM_CASES)
def test_drafts_are_vllms(tokens, lookup_min, lookup_max, k, expected):
    settings = NgramSpeculation(k, lookup_min, lookup_max)
    assert propose_ngram_drafts(tokens, settings, k) == expected


def brute_force_drafts(tokens: list[int], settings: NgramSpeculation, k: int) -> list[int]:
    """The longest suffix n-gram (at most prompt_lookup_max long) that occurs ending before
    the last token, its first occurrence; the tokens after it."""
    length = len(tokens)
    for n in range(min(settings.prompt_lookup_max, length - 1), settings.prompt_lookup_min - 1, -1):
        suffix = tokens[length - n :]
        for start in range(0, length - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_drafts_match_a_brute_force_search():
    rng = random.Random(1)
    for _ in range(2000):
        tokens = [rng.randrange(rng.randint(2, 5)) for _ in range(rng.randint(1, 40))]
        lookup_min = rng.randint(1, 3)
        settings = NgramSpeculation(rng.randint(1, 6), lookup_min, rng.randint(lookup_min, 6))
        k = rng.randint(1, settings.num_speculative_tokens)
        expected = brute_force_drafts(tokens, settings, k)
        assert propose_ngram_drafts(tokens, settings, k) == expected, (tokens, settings, k)


def test_no_drafts_without_room_or_match():
    settings = NgramSpeculation(4, 2, 3)
    assert propose_ngram_drafts([1, 2, 3, 1, 2], settings, 0) == []
    assert propose_ngram_drafts([1, 2, 3, 4, 5], settings, 4) == []
    assert propose_ngram_drafts([7], settings, 4) == []
    # A match of one token is below prompt_lookup_min.
    assert propose_ngram_drafts([1, 5, 2, 3, 1], settings, 4) == []
    assert propose_ngram_drafts([1, 5, 2, 3, 1], NgramSpeculation(4, 1, 3), 4) == [5, 2, 3, 1]


SPECULATION = NgramSpeculation(3, 2, 3)
PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]  # then 7, 8, 9 follow "5 6" at its start


def _request(max_tokens: int = 10, prompt: list[int] = PROMPT, request_id: str = "r") -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens),
        seed=0,
        eos_token_ids=frozenset(),
        max_tokens=max_tokens,
    )


def _scheduler(num_blocks: int = 32, budget: int = 64, max_model_len: int = 64) -> Scheduler:
    return Scheduler(
        KVCacheManager(num_blocks, 4, enable_prefix_caching=True),
        max_num_seqs=4,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        speculation=SPECULATION,
    )


def _prefilled(scheduler: Scheduler, request: Request, first_token: int = 7) -> None:
    scheduler.add_request(request)
    while True:  # in chunks where the budget is small
        output = scheduler.schedule()
        (chunk,) = output.chunks
        assert not chunk.drafts  # a prompt drafts nothing
        scheduler.update(output, {"r": [first_token]} if chunk.samples else {})
        if chunk.samples:
            return


def test_a_decode_drafts_and_keeps_what_its_samples_confirm():
    scheduler, request = _scheduler(), _request()
    _prefilled(scheduler, request)  # ... 5 6 | 7: "6 7" occurred at 1..2, then 8 9 5
    output = scheduler.schedule()
    (chunk,) = output.chunks
    assert chunk.drafts == [8, 9, 5]
    assert (chunk.num_computed_tokens, chunk.num_tokens) == (12, 4)
    assert output.plan.chunks[0].token_ids == [7, 8, 9, 5]
    assert output.plan.chunks[0].num_drafts == 3
    # The samples confirm 8 and 9, then differ: three tokens kept, the KV of four positions
    # computed but only that of 7, 8, 9 good.
    scheduler.update(output, {"r": [8, 9, 4]})
    assert request.output_token_ids == [7, 8, 9, 4]
    assert request.num_computed_tokens == 15
    stats = scheduler.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 2)
    assert stats.num_accepted_tokens_per_pos == [1, 1, 0]
    # Full blocks of good KV only are cached: 15 tokens written, 3 blocks of 4.
    assert request.num_registered_blocks == 3


def test_drafts_stop_at_max_tokens_and_the_context():
    scheduler, request = _scheduler(), _request(max_tokens=3)
    _prefilled(scheduler, request)
    (chunk,) = scheduler.schedule().chunks
    assert chunk.drafts == [8]  # one output token, one more sampled, one draft: 3

    scheduler, request = _scheduler(max_model_len=15), _request()
    _prefilled(scheduler, request)
    (chunk,) = scheduler.schedule().chunks
    assert chunk.drafts == [8]  # 13 tokens known: 14 and 15 are the last the context holds


def test_drafts_stop_at_the_budget_and_give_way_to_blocks():
    scheduler, request = _scheduler(budget=3), _request()
    _prefilled(scheduler, request)
    assert scheduler.schedule().chunks[0].drafts == [8, 9]

    # --long-prefill-token-threshold caps one sequence's tokens while another waits.
    scheduler, request = _scheduler(), _request()
    scheduler.long_prefill_token_threshold = 2
    _prefilled(scheduler, request)
    scheduler.add_request(_request(prompt=[1, 2, 3, 4, 5, 6, 7, 8], request_id="other"))
    chunks = scheduler.schedule().chunks
    assert [(c.request.request_id, c.num_tokens, c.drafts) for c in chunks] == [
        ("r", 2, [8]),
        ("other", 2, []),
    ]

    # 14 + 1 tokens fit 4 blocks of 4; three drafts would need a fifth, which is not there.
    scheduler = _scheduler(num_blocks=4)
    request = _request(prompt=[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8])
    _prefilled(scheduler, request, first_token=9)
    (chunk,) = scheduler.schedule().chunks
    assert (chunk.drafts, chunk.num_tokens) == ([], 1)
    assert scheduler.stats.num_preemptions == 0


def test_drafts_never_take_what_another_sequence_needs():
    """Two decodes: the higher-ranked one drafts only from the blocks left once both have
    their token, and nobody is preempted for a draft."""
    for num_blocks, drafts in [(6, []), (7, [7, 8, 9])]:
        scheduler = _scheduler(num_blocks=num_blocks)
        scheduler.add_request(_request(prompt=[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5], request_id="a"))
        scheduler.add_request(_request(prompt=list(range(20, 28)), request_id="b"))
        scheduler.update(scheduler.schedule(), {"a": [6], "b": [28]})
        # a's 12 tokens and b's 9 take three blocks of 4 each; a's drafts need a seventh.
        chunks = scheduler.schedule().chunks
        assert [(c.request.request_id, c.drafts) for c in chunks] == [("a", drafts), ("b", [])]
        assert scheduler.stats.num_preemptions == 0


def test_a_stop_among_kept_drafts_ends_the_request_there():
    scheduler = _scheduler()
    request = _request()
    request.eos_token_ids = frozenset({9})
    _prefilled(scheduler, request)
    output = scheduler.schedule()
    sampled = {"r": [8, 9, 5, 6]}
    finished = scheduler.update(output, sampled)
    assert finished == [request]
    assert request.output_token_ids == [7, 8, 9]
    assert sampled["r"] == [8, 9]  # cut after the stop: the engine reports these
    assert scheduler.stats.num_accepted_tokens == 3  # vLLM counts what the sampler confirmed
    assert scheduler.kv_cache.num_free_blocks == 32


def test_constrained_sequences_draft_up_to_an_eos_once_their_reasoning_ended():
    """Their step masks follow the drafts through the matcher (step_masks.py), which never
    takes an EOS draft; a sequence still reasoning has no mask to follow yet."""
    scheduler, request = _scheduler(), _request()
    request.matcher = object()  # a structured output's or bad words' matcher
    _prefilled(scheduler, request)
    (chunk,) = scheduler.schedule().chunks
    assert chunk.drafts == [8, 9, 5]

    scheduler, request = _scheduler(), _request()
    request.eos_token_ids = frozenset({9})
    request.matcher = object()
    _prefilled(scheduler, request)
    (chunk,) = scheduler.schedule().chunks
    assert chunk.drafts == [8]
    scheduler, request = _scheduler(), _request()
    request.eos_token_ids = frozenset({9})  # unconstrained: an EOS is drafted as any token
    _prefilled(scheduler, request)
    (chunk,) = scheduler.schedule().chunks
    assert chunk.drafts == [8, 9, 5]

    scheduler, request = _scheduler(), _request()
    request.matcher, request.reasoning_gate = object(), object()
    _prefilled(scheduler, request)
    (chunk,) = scheduler.schedule().chunks
    assert (chunk.drafts, chunk.num_tokens) == ([], 1)


def test_every_result_leaves_the_sequence_consistent():
    """Whatever each step keeps, the sequence's good KV is its known tokens but the last,
    and every chunk has the blocks for all its tokens."""
    for kept_pattern in itertools.product(range(1, 5), repeat=3):
        scheduler, request = _scheduler(), _request(max_tokens=20)
        _prefilled(scheduler, request)
        for step, kept in enumerate(kept_pattern):
            output = scheduler.schedule()
            (chunk,) = output.chunks
            end = chunk.num_computed_tokens + chunk.num_tokens
            assert len(scheduler.kv_cache.block_table("r")) * 4 >= end
            # The drafts confirmed, then a token none of them is.
            tokens = chunk.drafts[: kept - 1] + [100 + step]
            scheduler.update(output, {"r": tokens})
            assert request.output_token_ids[-len(tokens) :] == tokens
            assert request.num_computed_tokens == request.num_tokens - 1
