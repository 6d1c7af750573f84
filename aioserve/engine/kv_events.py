"""KV-cache events as plain data: which prefix-cache blocks were stored, evicted, cleared.

The KV cache manager records them in a `KVEventRecorder` as they happen; the engine loop
takes them once a step and hands them, as one batch, to the publisher
(kv_event_publisher.py), which sends them in vLLM's wire format. The events are vLLM
0.32's (its BlockStored, BlockRemoved, AllBlocksCleared) as its block pool emits them for
a model whose layers all keep every block (one KV-cache group, 0, "full_attention"):

- BlockStored: full blocks that entered the prefix cache, in order, each hash chained on
  the one before; `parent_block_hash` is the hash of the block before the first (None for
  a prompt's first block). A block whose equal is cached already stays private and is not
  announced, so that each stored hash is removed exactly once.
- BlockRemoved: a cached block evicted to be reused for other tokens.
- AllBlocksCleared: the whole prefix cache forgotten (/reset_prefix_cache).

A block hash goes out as vLLM sends it: by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)
the low 64 bits of the digest read big-endian, as an unsigned integer; with the variable
set to 0, the digest bytes themselves. `medium` is "GPU" on every platform, as vLLM's
device block pool reports it (its "CPU" names a host-memory offloading tier).
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aioserve.config.declaration import ConfigError
from aioserve.config.kv_events import KVEventsSettings
from aioserve.engine.block_hashing import BlockHash

MEDIUM = "GPU"
GROUP_IDX = 0
SPEC_KIND = "full_attention"
INT_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"
_LOW_64_BITS = (1 << 64) - 1

ExternalBlockHash = bytes | int


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    lora_name: str | None
    # One entry a block: its extra hash keys without their tags (the LoRA name, the cache
    # salt, the prompt embeddings' digest), None for a block that has none.
    extra_keys: list[tuple[Any, ...] | None]


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[ExternalBlockHash]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def int_hashes_from_env() -> bool:
    """vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (default 1): hashes sent as integers."""
    return bool(int(os.environ.get(INT_HASHES_ENV, "1")))


def untagged(extra_keys: tuple[tuple[Any, ...], ...] | None) -> tuple[Any, ...] | None:
    """A block's extra keys as vLLM's events carry them: each key's value, tag dropped."""
    if extra_keys is None:
        return None
    return tuple(key[1] for key in extra_keys)


class KVEventRecorder:
    """The events since the last `take`, in the order they happened."""

    def __init__(self, int_hashes: bool = True) -> None:
        self._int_hashes = int_hashes
        self._events: list[KVEvent] = []

    def external(self, block_hash: BlockHash) -> ExternalBlockHash:
        """`block_hash` as the events carry it (vLLM's maybe_convert_block_hash)."""
        if isinstance(block_hash, int):  # the 64-bit algorithms ("builtin" may be negative)
            return block_hash & _LOW_64_BITS
        if self._int_hashes:
            return int.from_bytes(block_hash, "big") & _LOW_64_BITS
        return block_hash

    def stored(
        self,
        block_hashes: Sequence[BlockHash],
        parent: BlockHash | None,
        token_ids: list[int],
        block_size: int,
        lora: tuple[int, str] | None,
        extra_keys: list[tuple[Any, ...] | None],
    ) -> None:
        """Blocks that entered the cache; `lora` is the adapter's (int id, name)."""
        self._events.append(
            BlockStored(
                block_hashes=[self.external(h) for h in block_hashes],
                parent_block_hash=None if parent is None else self.external(parent),
                token_ids=token_ids,
                block_size=block_size,
                lora_id=None if lora is None else lora[0],
                lora_name=None if lora is None else lora[1],
                extra_keys=extra_keys,
            )
        )

    def removed(self, block_hash: BlockHash) -> None:
        self._events.append(BlockRemoved([self.external(block_hash)]))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events


def check_publisher_packages(settings: KVEventsSettings | None) -> None:
    """At start: a zmq publisher needs pyzmq and msgspec, which are optional for users."""
    if settings is None or not settings.publishes:
        return
    missing = [name for name in ("zmq", "msgspec") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(
            f"--kv-events-config: the zmq publisher needs {' and '.join(missing)} "
            "(pip install pyzmq msgspec)"
        )


class KVEventStream:
    """The recorder the KV cache manager writes to, and the publisher that each step's
    events go to as one batch (none for a step without events, as in vLLM)."""

    def __init__(self, settings: KVEventsSettings) -> None:
        check_publisher_packages(settings)
        from aioserve.engine.kv_event_publisher import ZmqEventPublisher

        self.recorder = KVEventRecorder(int_hashes_from_env())
        self._publisher = ZmqEventPublisher(settings)

    def flush(self) -> None:
        """Publish the events recorded since the last flush; called once a step."""
        events = self.recorder.take()
        if events:
            self._publisher.publish(time.time(), events)

    def shutdown(self) -> None:
        self.flush()
        self._publisher.shutdown()


def kv_event_stream(settings: KVEventsSettings | None) -> KVEventStream | None:
    """The stream --kv-events-config asks for; None when events are not published."""
    if settings is None or not settings.publishes:
        return None
    return KVEventStream(settings)
