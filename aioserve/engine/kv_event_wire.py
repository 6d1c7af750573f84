"""KV-cache event batches in vLLM's wire format: msgpack through msgspec structs.

The structs mirror vLLM 0.32's (vllm/distributed/kv_events.py) field for field, in order,
with the same encoding options, so that a consumer decoding with vLLM's KVEventBatch
reads aioserve's payloads:

- a batch is an array [ts, events, data_parallel_rank] (array_like, trailing defaults
  omitted);
- an event is a map whose first key "type" names it ("BlockStored", "BlockRemoved",
  "AllBlocksCleared"), then its fields in declaration order, those still at their default
  left out (omit_defaults; fields without a default are always written, None included).

Imported only when a zmq publisher is configured: msgspec is optional for users.
"""

from __future__ import annotations

from typing import Any

import msgspec

from aioserve.engine import kv_events

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
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


class BlockRemoved(_KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_KVCacheEvent):
    pass


def _wire_event(event: kv_events.KVEvent) -> _KVCacheEvent:
    if isinstance(event, kv_events.BlockStored):
        return BlockStored(
            block_hashes=event.block_hashes,
            parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=kv_events.MEDIUM,
            lora_name=event.lora_name,
            extra_keys=event.extra_keys or None,  # vLLM's to_event_extra_keys
            group_idx=kv_events.GROUP_IDX,
            kv_cache_spec_kind=kv_events.SPEC_KIND,
        )
    if isinstance(event, kv_events.BlockRemoved):
        return BlockRemoved(
            block_hashes=event.block_hashes, medium=kv_events.MEDIUM, group_idx=kv_events.GROUP_IDX
        )
    return AllBlocksCleared()


class BatchEncoder:
    """Encodes one step's events as one batch payload."""

    def __init__(self, data_parallel_rank: int = 0) -> None:
        self._rank = data_parallel_rank
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, ts: float, events: list[kv_events.KVEvent]) -> bytes:
        batch = EventBatch(ts, [_wire_event(e) for e in events], self._rank)
        return self._encoder.encode(batch)
