"""KV-cache events on the wire: the bytes vLLM 0.32's own msgspec structs
(vllm/distributed/kv_events.py's KVEventBatch) write for the same events, and the event
hashes of vLLM's sha256 block keys. Both vectors were produced once with vLLM 0.32:

    KVEventBatch(ts=1.5, events=[BlockStored(...), BlockStored(...), BlockRemoved(...),
    AllBlocksCleared()], data_parallel_rank=0), encoded by msgspec.msgpack.Encoder();
    hash_block_tokens(sha256, ...) after init_none_hash(sha256), PYTHONHASHSEED unset.
"""

from __future__ import annotations

import pytest

from aioserve.engine.block_hashing import BlockHasher
from aioserve.engine.kv_event_wire import BatchEncoder
from aioserve.engine.kv_events import KVEventRecorder

# fmt: off
VLLM_BATCH = bytes.fromhex(
    "93cb3ff8000000000000948ba474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573"
    "92cf0101010101010101cf0202020202020202b1706172656e745f626c6f636b5f68617368c0a9746f6b"
    "656e5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d65646975"
    "6da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797392c0c0a967726f75705f69647800b2"
    "6b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e8ba474797065ab426c"
    "6f636b53746f726564ac626c6f636b5f68617368657391cf0303030303030303b1706172656e745f626c"
    "6f636b5f68617368cf0202020202020202a9746f6b656e5f69647394090a0b0caa626c6f636b5f73697a"
    "6504a76c6f72615f696403a66d656469756da3475055a96c6f72615f6e616d65a26164aa65787472615f"
    "6b6579739292a26164a473616c7491a26164a967726f75705f69647800b26b765f63616368655f737065"
    "635f6b696e64ae66756c6c5f617474656e74696f6e84a474797065ac426c6f636b52656d6f766564ac62"
    "6c6f636b5f68617368657391cf0101010101010101a66d656469756da3475055a967726f75705f696478"
    "0081a474797065b0416c6c426c6f636b73436c656172656400"
)
# vLLM's sha256 keys of blocks 1..16 and 17..32 (the second chained on the first).
VLLM_SHA256_KEYS = (
    "7b255da405e1d722823892e4fef187b4d8ac78215d7f0dd2137bb037547f4caf",
    "8e717becdc2054b7a3223b7b844f462c0db0ac86287b752b16d077ad0843c577",
)
# fmt: on


def test_a_batch_encodes_to_vllms_bytes():
    recorder = KVEventRecorder(int_hashes=True)
    recorder.stored([b"\1" * 32, b"\2" * 32], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, [None, None])
    recorder.stored(
        [b"\3" * 32], b"\2" * 32, [9, 10, 11, 12], 4, (3, "ad"), [("ad", "salt"), ("ad",)]
    )
    recorder.removed(b"\1" * 32)
    recorder.cleared()
    assert BatchEncoder().encode(1.5, recorder.take()) == VLLM_BATCH
    assert recorder.take() == []


def test_hashes_are_sent_as_vllm_sends_them():
    digest = bytes(range(32))
    assert KVEventRecorder(int_hashes=True).external(digest) == int.from_bytes(digest[-8:], "big")
    assert KVEventRecorder(int_hashes=False).external(digest) == digest
    assert KVEventRecorder().external(-1) == 2**64 - 1  # "builtin" keys, unsigned


def test_sha256_keys_are_vllms(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    hasher = BlockHasher("sha256")
    first = hasher(None, list(range(1, 17)))
    second = hasher(first, list(range(17, 33)))
    assert (first.hex(), second.hex()) == VLLM_SHA256_KEYS


@pytest.mark.parametrize("algorithm", ["xxhash", "builtin"])
def test_keys_of_a_non_cryptographic_hash_differ_between_processes(monkeypatch, algorithm):
    """Their root is random per process unless PYTHONHASHSEED is set, as in vLLM: a router
    cannot match such keys across instances."""
    pytest.importorskip("xxhash")
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert BlockHasher(algorithm).root != BlockHasher(algorithm).root


def test_a_missing_pyzmq_is_a_start_error_naming_the_install(monkeypatch):
    from aioserve.config.declaration import ConfigError
    from aioserve.config.kv_events import kv_events_settings
    from aioserve.engine import kv_events

    real = kv_events.importlib.util.find_spec
    monkeypatch.setattr(
        kv_events.importlib.util, "find_spec", lambda n: None if n == "zmq" else real(n)
    )
    with pytest.raises(ConfigError, match=r"needs zmq \(pip install pyzmq msgspec\)"):
        kv_events.check_publisher_packages(kv_events_settings({"enable_kv_cache_events": True}))
    kv_events.check_publisher_packages(kv_events_settings({"enable_kv_cache_events": False}))
