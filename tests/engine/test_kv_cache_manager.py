"""The KV block pool: random admit / step / finish / abort / preempt sequences, and prefix hashes.

A hypothesis state machine drives the real Scheduler and KVCacheManager (no model: sampled
tokens are drawn at random) with a pool small enough that preemption happens, and checks
after every step that block ownership is consistent, and at the end that the pool is whole.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from aioserve.engine.kv_cache_manager import KVCacheManager
from aioserve.engine.request import Request, RequestStatus
from aioserve.engine.sampling_params import SamplingParams
from aioserve.engine.scheduler import Scheduler

BLOCK_SIZE = 4
NUM_BLOCKS = 24
MAX_MODEL_LEN = 64
EOS = 0
SHARED_PREFIXES = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24]]


class BlockPoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True)
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=6,
            max_num_batched_tokens=16,
            max_model_len=MAX_MODEL_LEN,
            enable_chunked_prefill=True,
            policy="fcfs",
        )
        self.ids = itertools.count()
        self.live: dict[str, Request] = {}

    @rule(
        prefix=st.sampled_from([[], *SHARED_PREFIXES]),
        suffix=st.lists(st.integers(1, 30), min_size=1, max_size=20),
        max_tokens=st.integers(1, 12),
    )
    def add(self, prefix, suffix, max_tokens):
        n = next(self.ids)
        prompt = prefix + suffix
        request = Request(
            request_id=f"r{n}",
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=max_tokens),
            seed=n,
            eos_token_ids=frozenset({EOS}),
            max_tokens=min(max_tokens, MAX_MODEL_LEN - len(prompt)),
            arrival_index=n,
        )
        self.scheduler.add_request(request)
        self.live[request.request_id] = request

    @precondition(lambda self: self.scheduler.has_unfinished())
    @rule(seed=st.integers(0, 2**16))
    def step(self, seed):
        output = self.scheduler.schedule()
        assert not output.is_empty, "work is waiting but nothing was scheduled"
        rng = random.Random(seed)  # token 0 is EOS, so some sequences stop early
        sampled = {c.request.request_id: [rng.randrange(31)] for c in output.chunks if c.samples}
        for request in self.scheduler.update(output, sampled):
            self.live.pop(request.request_id)

    @precondition(lambda self: self.live)
    @rule(
        data=st.data(),
        status=st.sampled_from([RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_STOPPED]),
    )
    def end_one(self, data, status):
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        self.scheduler.finish_requests([request_id], status)
        self.live.pop(request_id)

    @invariant()
    def ownership_is_consistent(self):
        tables = {r.request_id: self.kv.block_table(r.request_id) for r in self.live.values()}
        for request in self.live.values():
            if request.status is not RequestStatus.RUNNING:
                assert not tables[request.request_id], "only running sequences hold blocks"
        counts: dict[int, int] = {}
        for request_id, table in tables.items():
            assert len(set(table)) == len(table), f"{request_id} lists a block twice"
            for block_id in table:
                counts[block_id] = counts.get(block_id, 0) + 1
        assert counts == self.kv.owners(), "reference counts differ from the block tables"
        assert self.kv.num_free_blocks + len(counts) == NUM_BLOCKS
        # A block in several tables is a shared prefix: same position, same tokens up to it.
        where: dict[int, list[tuple[str, int]]] = {}
        for request_id, table in tables.items():
            for index, block_id in enumerate(table):
                where.setdefault(block_id, []).append((request_id, index))
        for block_id, places in where.items():
            if len(places) < 2:
                continue
            prefixes = {
                (index, tuple(self.live[request_id].token_ids_range(0, (index + 1) * BLOCK_SIZE)))
                for request_id, index in places
            }
            assert len(prefixes) == 1, (
                f"block {block_id} is shared by sequences with different prefixes"
            )

    def teardown(self):
        self.scheduler.finish_requests(list(self.live), RequestStatus.FINISHED_ABORTED)
        assert self.kv.num_free_blocks == NUM_BLOCKS, "blocks leaked"
        assert self.kv.owners() == {}


BlockPoolMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockPool = BlockPoolMachine.TestCase


def _request(request_id: str, prompt: list[int], cache_salt: str | None = None) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=4),
        seed=0,
        eos_token_ids=frozenset({EOS}),
        max_tokens=4,
        cache_salt=cache_salt,
    )


def test_prefix_cache_hits_full_blocks_and_leaves_one_token_to_compute():
    kv = KVCacheManager(16, BLOCK_SIZE, enable_prefix_caching=True)
    first = _request("a", list(range(1, 13)))  # exactly three full blocks
    assert kv.allocate(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    kv.cache_full_blocks(first, first.num_tokens)
    first_table = kv.block_table("a")
    kv.free(first)

    again = _request("b", list(range(1, 13)))
    # Two blocks, not three: the last prompt token must still run to give logits.
    assert kv.find_cached_prefix(again) == first_table[:2]
    other = _request("c", [99] + list(range(2, 13)))
    assert kv.find_cached_prefix(other) == [], "a different first block must break the chain"


def test_a_cache_salt_shares_blocks_only_with_requests_of_the_same_salt():
    kv = KVCacheManager(16, BLOCK_SIZE, enable_prefix_caching=True)
    prompt = list(range(1, 13))
    salted = _request("a", prompt, cache_salt="tenant-a")
    assert kv.allocate(salted, salted.num_tokens)
    salted.num_computed_tokens = salted.num_tokens
    kv.cache_full_blocks(salted, salted.num_tokens)
    table = kv.block_table("a")
    kv.free(salted)

    assert kv.find_cached_prefix(_request("b", prompt, cache_salt="tenant-a")) == table[:2]
    assert kv.find_cached_prefix(_request("c", prompt, cache_salt="tenant-b")) == []
    assert kv.find_cached_prefix(_request("d", prompt)) == []
    # The salt is in the first block's key and so, chained, in every later one.
    unsalted, other = _request("e", prompt), _request("f", prompt, cache_salt="tenant-b")
    for request in (unsalted, other):
        kv.update_block_hashes(request)
    for i in range(3):
        assert len({salted.block_hashes[i], unsalted.block_hashes[i], other.block_hashes[i]}) == 3


def test_a_request_that_ends_in_its_prefill_step_leaves_its_prompt_blocks_cached():
    kv = KVCacheManager(8, BLOCK_SIZE, enable_prefix_caching=True)
    scheduler = Scheduler(
        kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32, enable_chunked_prefill=True
    )
    prompt = list(range(1, 11))  # two full blocks and two tokens
    scheduler.add_request(dataclasses.replace(_request("first", prompt), max_tokens=1))
    output = scheduler.schedule()
    assert [r.request_id for r in scheduler.update(output, {"first": [5]})] == ["first"]
    assert kv.num_free_blocks == 8 and kv.owners() == {}
    assert len(kv.find_cached_prefix(_request("again", prompt))) == 2


def test_lru_eviction_takes_the_oldest_free_block_and_forgets_its_hash():
    kv = KVCacheManager(2, BLOCK_SIZE, enable_prefix_caching=True)
    a = _request("a", [1, 2, 3, 4, 5])
    assert kv.allocate(a, 5)
    a.num_computed_tokens = 5
    kv.cache_full_blocks(a, 5)
    kv.free(a)
    b = _request("b", [9, 9, 9, 9, 9, 9, 9, 9])
    assert kv.allocate(b, 8), "both blocks, one of them cached, must be reusable"
    assert kv.find_cached_prefix(_request("c", [1, 2, 3, 4, 5])) == []
    assert not kv.allocate(_request("d", [1]), 1), "the pool is exhausted"


def test_siblings_with_equal_rank_queue_and_preempt_without_comparing_requests():
    kv = KVCacheManager(8, BLOCK_SIZE, enable_prefix_caching=False)
    scheduler = Scheduler(
        kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32, enable_chunked_prefill=True
    )
    for index in range(3):  # three samples of one request: same arrival, same rank
        request = _request(f"req#{index}", list(range(1, 10)))
        scheduler.add_request(request)
    output = scheduler.schedule()
    assert len(output.chunks) == 2, "8 blocks hold two 9-token prompts of 3 blocks, not three"
    scheduler.finish_requests(
        [c.request.request_id for c in output.chunks], RequestStatus.FINISHED_ABORTED
    )
    assert [c.request.request_id for c in scheduler.schedule().chunks] == ["req#2"]


def test_an_eos_from_the_generation_config_reports_itself_as_the_stop_reason():
    """As vLLM, which adds a generation config's other EOS ids to the stop token ids: the
    tokenizer's EOS (7) ends with no stop_reason, another (EOS, 0) with its id."""
    kv = KVCacheManager(8, BLOCK_SIZE, enable_prefix_caching=False)
    scheduler = Scheduler(
        kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32, enable_chunked_prefill=True
    )
    requests = [
        dataclasses.replace(
            _request(name, [1, 2, 3]), eos_token_ids=frozenset({7, EOS}), eos_token_id=7
        )
        for name in ("tokenizer-eos", "config-eos")
    ]
    for request in requests:
        scheduler.add_request(request)
    output = scheduler.schedule()
    finished = scheduler.update(output, {"tokenizer-eos": [7], "config-eos": [EOS]})
    assert [(r.request_id, r.status, r.stop_reason) for r in finished] == [
        ("tokenizer-eos", RequestStatus.FINISHED_STOPPED, None),
        ("config-eos", RequestStatus.FINISHED_STOPPED, EOS),
    ]


def test_priority_policy_admits_and_preempts_by_priority_then_arrival():
    kv = KVCacheManager(6, BLOCK_SIZE, enable_prefix_caching=False)
    scheduler = Scheduler(
        kv,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=32,
        enable_chunked_prefill=True,
        policy="priority",
    )
    for arrival, (name, priority) in enumerate([("late-low", 5), ("urgent", -1), ("normal", 0)]):
        request = _request(name, list(range(1, 9)))  # 8 tokens: 2 blocks, + 1 when decoding
        request.priority, request.arrival_index = priority, arrival
        scheduler.add_request(request)
    first = scheduler.schedule()
    assert [c.request.request_id for c in first.chunks] == ["urgent", "normal", "late-low"]
    scheduler.update(first, {c.request.request_id: [7] for c in first.chunks})
    # Each now needs a third block and only 0 are free: the lowest priority gives way.
    second = scheduler.schedule()
    assert [r.request_id for r in second.preempted] == ["late-low"]
    assert [c.request.request_id for c in second.chunks] == ["urgent", "normal"]


def test_long_prefill_token_threshold_caps_each_sequence_unless_it_is_alone():
    """vLLM's --long-prefill-token-threshold: no sequence takes more than the threshold of
    a step's budget while another runs or waits; a lone one takes what the budget allows."""
    kv = KVCacheManager(16, BLOCK_SIZE, enable_prefix_caching=False)
    scheduler = Scheduler(
        kv,
        max_num_seqs=4,
        max_num_batched_tokens=24,
        max_model_len=32,
        enable_chunked_prefill=True,
        long_prefill_token_threshold=6,
    )
    scheduler.add_request(_request("alone", list(range(1, 21))))
    assert [c.num_tokens for c in scheduler.schedule().chunks] == [20]
    scheduler.finish_requests(["alone"], RequestStatus.FINISHED_ABORTED)
    for name in ("long", "short"):
        scheduler.add_request(_request(name, list(range(1, 21 if name == "long" else 5))))
    chunks = scheduler.schedule().chunks
    assert [(c.request.request_id, c.num_tokens) for c in chunks] == [("long", 6), ("short", 4)]
    chunks = scheduler.schedule().chunks  # short decodes (its token pending), long goes on
    assert [(c.request.request_id, c.num_tokens) for c in chunks] == [("long", 6), ("short", 1)]
