"""Publishes KV-cache event batches over ZMQ, as vLLM's ZmqEventPublisher does.

- A PUB socket sends each batch as the multipart message [topic, sequence number (8 bytes,
  big-endian, from 0 up by one), msgpack payload (kv_event_wire.py)]. An endpoint with
  `*` or `::` (or an ipc:// or inproc:// one) is bound; any other is connected to, where
  the consumer binds.
- With a replay endpoint, a ROUTER socket answers a request [b"", first wanted sequence
  number (8 bytes, big-endian)] (a DEALER socket's: the answer is a stream) with every
  batch kept since then, each as [b"", topic, sequence number, payload], then the end
  marker [b"", b"", -1 as 8 signed bytes, b""]. The last `buffer_steps` batches are kept.
- The sockets work on their own thread: `publish` only queues the step's events and
  never blocks the engine. A consumer that is slow or absent loses messages past the
  high-water mark (`hwm`), as in vLLM; a batch that finds the queue full
  (`max_queue_size`, a publisher thread that cannot keep up) is dropped with a warning,
  where vLLM would block its engine.

Imported only when a zmq publisher is configured: pyzmq and msgspec are optional.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from itertools import count

import zmq

from aioserve.config.kv_events import KVEventsSettings
from aioserve.engine.kv_event_wire import BatchEncoder
from aioserve.engine.kv_events import KVEvent

logger = logging.getLogger("aioserve")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
SHUTDOWN_WAIT_S = 1.0
_POLL_MS = 100


def _is_bind_endpoint(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """The PUB (and replay ROUTER) sockets, opened at start so that a bad endpoint fails
    the start, and the thread that encodes and sends the queued batches."""

    def __init__(self, settings: KVEventsSettings, data_parallel_rank: int = 0) -> None:
        self._queue: queue.Queue[tuple[float, list[KVEvent]] | None] = queue.Queue(
            settings.max_queue_size
        )
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=settings.buffer_steps)
        self._topic = settings.topic.encode()
        self._encoder = BatchEncoder(data_parallel_rank)
        self._dropped = 0
        self._context = zmq.Context()
        self._replay: zmq.Socket | None = None
        try:
            self._pub = self._context.socket(zmq.PUB)
            self._pub.set_hwm(settings.hwm)
            if _is_bind_endpoint(settings.endpoint):
                self._pub.bind(settings.endpoint)
            else:
                self._pub.connect(settings.endpoint)
            if settings.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.bind(settings.replay_endpoint)
        except zmq.ZMQError as error:
            self._context.destroy(linger=0)
            raise ValueError(f"--kv-events-config: cannot open its endpoints ({error})") from None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info(
            "publishing KV-cache events on %s%s",
            settings.endpoint,
            f" (replay on {settings.replay_endpoint})" if self._replay is not None else "",
        )

    def publish(self, ts: float, events: list[KVEvent]) -> None:
        """Queue one step's events as a batch stamped `ts` (time.time()); never blocks."""
        try:
            self._queue.put_nowait((ts, events))
        except queue.Full:
            self._dropped += 1
            if self._dropped == 1 or self._dropped % 1000 == 0:
                logger.warning(
                    "KV-cache events: the publisher's queue is full, %d batches dropped",
                    self._dropped,
                )

    def shutdown(self) -> None:
        """Send what is queued (for up to a second), stop the thread, close the sockets."""
        try:
            self._queue.put(None, timeout=SHUTDOWN_WAIT_S)
        except queue.Full:
            pass
        self._thread.join(SHUTDOWN_WAIT_S)
        if self._thread.is_alive():
            logger.warning("the KV-cache event publisher did not stop; leaving it behind")
            return
        self._context.destroy(linger=0)

    def _run(self) -> None:
        sequence = count()
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._answer_replay()
            try:
                item = self._queue.get(timeout=_POLL_MS / 1000)
            except queue.Empty:
                continue
            if item is None:
                return
            try:
                payload = self._encoder.encode(*item)
                seq = next(sequence)
                # Never blocks: past the high-water mark a PUB socket drops the message.
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
            except Exception as error:  # one bad batch must not stop the publishing
                logger.error("KV-cache events: a batch could not be sent: %s", error)

    def _answer_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV-cache events: malformed replay request %r", frames)
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart(
                    (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
