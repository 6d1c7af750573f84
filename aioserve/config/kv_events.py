"""--kv-events-config: vLLM's JSON of KV-cache event settings (its KVEventsConfig).

With `enable_kv_cache_events`, the engine records which prefix-cache blocks it stores,
evicts and clears (engine/kv_events.py) and publishes them once a step over ZMQ
(engine/kv_event_publisher.py), for KV-aware routers. The keys, their defaults and the
default publisher (zmq when events are on, else null) are vLLM 0.32's; other keys are
refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aioserve.config import values

PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsSettings:
    """vLLM's KVEventsConfig, with `publisher` resolved."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"  # bound when it has * or :: (or is ipc/inproc), else connected
    replay_endpoint: str | None = None  # a ROUTER socket answering requests for past batches
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark: messages queued per subscriber
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    @property
    def publishes(self) -> bool:
        """Whether events are recorded and sent anywhere."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


def _endpoint(value: Any) -> str:
    text = values.string(value)
    if not text.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"must be a ZMQ endpoint (tcp://, ipc:// or inproc://), got {text!r}")
    return text


def _optional_endpoint(value: Any) -> str | None:
    return None if value is None else _endpoint(value)


_FIELDS = {
    "enable_kv_cache_events": values.boolean,
    "publisher": values.one_of(*PUBLISHERS),
    "endpoint": _endpoint,
    "replay_endpoint": _optional_endpoint,
    "buffer_steps": values.integer_at_least(1),
    "hwm": values.integer_at_least(0),
    "max_queue_size": values.integer_at_least(1),
    "topic": values.string,
}
_check = values.json_settings(_FIELDS)


def kv_events_settings(value: Any) -> KVEventsSettings | None:
    """--kv-events-config: a JSON object of vLLM's keys, each checked; None when not given.

    vLLM only warns when `publisher` is zmq and events are off, and publishes nothing:
    refused here, since the endpoint would be parsed and ignored."""
    if value is None or isinstance(value, KVEventsSettings):
        return value
    settings = _check(value)
    enabled = settings.get("enable_kv_cache_events", False)
    publisher = settings.setdefault("publisher", "zmq" if enabled else "null")
    if publisher == "zmq" and not enabled:
        raise ValueError('publisher "zmq" publishes nothing without "enable_kv_cache_events": true')
    return KVEventsSettings(**settings)
