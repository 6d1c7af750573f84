"""--kv-events-config end to end: an engine on a tiny random Llama publishes its prefix
cache's events over ZMQ to a subscriber in the test, which decodes them with structs
written here from vLLM 0.32's definitions (vllm/distributed/kv_events.py) and checks
them against block hashes computed here by vLLM's rule (SHA-256 of the pickled
(parent, tokens, extra keys), the first parent derived from "vllm-none-hash")."""

from __future__ import annotations

import hashlib
import os
import pickle
import socket
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import zmq

from aioserve import LLM, SamplingParams
from tests.models.tiny_models import save_tiny_model, tiny_llama_config

BLOCK = 16
TOPIC = b"kv"
RECEIVE_TIMEOUT_S = 20.0


# vLLM 0.32's structs, field for field.
class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _Event(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_Event):
    pass


class Batch(KVEventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(Batch)


def vllm_event_hashes(tokens: list[int]) -> list[int]:
    """vLLM's sha256 block hashes of the full blocks of `tokens`, as its events send them
    (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1: the digest's low 64 bits)."""
    seed = os.environ.get("PYTHONHASHSEED", "vllm-none-hash")
    parent = hashlib.sha256(pickle.dumps(seed, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    hashes = []
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        key = (parent, tuple(tokens[start : start + BLOCK]), None)
        parent = hashlib.sha256(pickle.dumps(key, protocol=pickle.HIGHEST_PROTOCOL)).digest()
        hashes.append(int.from_bytes(parent[-8:], "big"))
    return hashes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompt(seed: int, length: int) -> list[int]:
    return [(seed * 31 + 7 * i) % 250 + 1 for i in range(length)]


@dataclass
class Received:
    seq: int
    topic: bytes
    payload: bytes
    batch: Batch


class Subscriber:
    """A SUB socket bound where the engine's PUB connects (vLLM: a concrete host connects)."""

    def __init__(self, context: zmq.Context) -> None:
        self.socket = context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.received: list[Received] = []

    def events(self) -> list[Any]:
        return [e for r in self.received for e in r.batch.events]

    def receive_until(self, done) -> None:
        """Receive batches until `done(events)` holds; fail after RECEIVE_TIMEOUT_S."""
        deadline = time.monotonic() + RECEIVE_TIMEOUT_S
        while not done(self.events()):
            left_ms = int((deadline - time.monotonic()) * 1000)
            assert left_ms > 0 and self.socket.poll(left_ms), "no KV-cache event came"
            topic, seq, payload = self.socket.recv_multipart()
            batch = DECODER.decode(payload)
            self.received.append(Received(int.from_bytes(seq, "big"), topic, payload, batch))


def _stored(events) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]


def _stored_hashes(events) -> set[int]:
    return {h for e in _stored(events) for h in e.block_hashes}


def _removed_hashes(events) -> set[int]:
    return {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}


@dataclass
class Run:
    received: list[Received]
    first: list[int]  # the prompt whose stored blocks are checked
    evicting: list[list[int]]  # the prompts run after it, which evict its blocks
    reset: bool
    replayed: list[tuple[bytes, int, bytes]]  # (topic, seq, payload)


def _replay(context: zmq.Context, endpoint: str, start: int) -> list[tuple[bytes, int, bytes]]:
    """vLLM's replay protocol, from a DEALER socket (a REQ one would take only the first
    answer of the stream): [b"", start] in, [b"", topic, seq, payload]... then the end."""
    request = context.socket(zmq.DEALER)
    try:
        request.connect(endpoint)
        request.send_multipart((b"", start.to_bytes(8, "big")))
        answers = []
        while True:
            assert request.poll(int(RECEIVE_TIMEOUT_S * 1000)), "the replay did not answer"
            empty, topic, seq, payload = request.recv_multipart()
            assert empty == b""
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert (topic, payload) == (b"", b"")
                return answers
            answers.append((topic, int.from_bytes(seq, "big"), payload))
    finally:
        request.close(linger=0)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    folder = save_tiny_model(tiny_llama_config(), tmp_path_factory.mktemp("tiny_llama"))
    context = zmq.Context()
    subscriber = Subscriber(context)
    replay_endpoint = f"tcp://127.0.0.1:{_free_port()}"
    llm = LLM(
        model=str(folder),
        dtype="float32",
        max_model_len=64,
        block_size=BLOCK,
        num_gpu_blocks_override=8,
        max_num_seqs=1,
        enforce_eager=True,
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        kv_events_config={
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://127.0.0.1:{subscriber.port}",
            "replay_endpoint": replay_endpoint,
            "topic": TOPIC.decode(),
        },
    )
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    try:

        def generate(prompt: list[int]) -> None:
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)

        # The subscription reaches the publisher some time after it connects, and a PUB
        # socket drops what comes before: prompts until one batch arrives (the replay
        # below gets the dropped ones back).
        for attempt in range(100):
            generate(_prompt(1000 + attempt, BLOCK + 1))
            if subscriber.socket.poll(200):
                break
        subscriber.receive_until(lambda events: bool(events))
        first = _prompt(1, 3 * BLOCK + 1)  # 3 full blocks: 4 of the 8 with its answer
        generate(first)
        first_hashes = set(vllm_event_hashes(first))
        subscriber.receive_until(lambda events: first_hashes <= _stored_hashes(events))
        evicting = [_prompt(2, 3 * BLOCK + 1), _prompt(3, 3 * BLOCK + 1)]
        for prompt in evicting:
            generate(prompt)
        subscriber.receive_until(lambda events: first_hashes <= _removed_hashes(events))
        reset = llm.engine.reset_prefix_cache()
        subscriber.receive_until(
            lambda events: any(isinstance(e, AllBlocksCleared) for e in events)
        )
        replayed = _replay(context, replay_endpoint, 0)
        return Run(subscriber.received, first, evicting, reset, replayed)
    finally:
        llm.close()
        subscriber.socket.close(linger=0)
        context.term()


def test_stored_blocks_are_the_prompts_full_blocks_with_vllms_hashes(run):
    events = [e for r in run.received for e in r.batch.events]
    expected = vllm_event_hashes(run.first)
    stored = [e for e in _stored(events) if set(e.block_hashes) & set(expected)]
    assert [h for e in stored for h in e.block_hashes] == expected
    assert [t for e in stored for t in e.token_ids] == run.first[: 3 * BLOCK]
    # Each event's parent is the block before its first: the chain has no gap.
    chain = [None, *expected]
    for event in stored:
        index = expected.index(event.block_hashes[0])
        assert event.parent_block_hash == chain[index]
        assert len(event.token_ids) == BLOCK * len(event.block_hashes)
        assert event.block_size == BLOCK
        assert event.medium == "GPU"
        assert (event.lora_id, event.lora_name) == (None, None)
        assert event.extra_keys == [None] * len(event.block_hashes)
        assert event.group_idx == 0
        assert event.kv_cache_spec_kind == "full_attention"


def test_evicting_a_cached_block_removes_its_hash(run):
    # The whole history, from the replay: the subscriber missed the first batches.
    events = [e for _, _, payload in run.replayed for e in DECODER.decode(payload).events]
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert set(vllm_event_hashes(run.first)) <= _removed_hashes(removed)
    assert all(e.medium == "GPU" and e.group_idx == 0 for e in removed)
    # Only cached blocks are removed: each hash is cached (stored, not yet removed) then.
    cached: set[int] = set()
    for event in events:
        if isinstance(event, BlockStored):
            assert cached.isdisjoint(event.block_hashes)
            cached.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            (block_hash,) = event.block_hashes
            assert block_hash in cached
            cached.remove(block_hash)
        else:
            cached.clear()


def test_resetting_the_prefix_cache_clears_all_blocks(run):
    assert run.reset
    last = run.received[-1].batch.events
    assert isinstance(last[-1], AllBlocksCleared)


def test_batches_carry_the_topic_consecutive_numbers_and_the_rank(run):
    assert all(r.topic == TOPIC for r in run.received)
    seqs = [r.seq for r in run.received]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert all(r.batch.data_parallel_rank == 0 and r.batch.events for r in run.received)
    assert all(isinstance(r.batch.ts, float) for r in run.received)


def test_the_replay_endpoint_sends_every_batch_since_the_one_asked_for(run):
    assert [seq for _, seq, _ in run.replayed] == list(range(len(run.replayed)))
    assert all(topic == TOPIC for topic, _, _ in run.replayed)
    replayed = {seq: payload for _, seq, payload in run.replayed}
    for received in run.received:
        assert replayed[received.seq] == received.payload
