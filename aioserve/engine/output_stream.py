"""OutputStream: one request's outputs on their way from the engine loop to its consumer."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

# In the queue: "the request has news", turned into an output when the consumer takes it.
_NEWS = object()


class OutputStream:
    """A queue with one consumer: the engine puts without waiting, the consumer awaits `get`.

    The engine puts items (an exception puts the consumer's end to it) or, with `notify`,
    says that the request has news. News becomes an output only when the consumer takes it,
    built then by `build`, and news not taken yet is not queued twice: a consumer that has
    fallen behind the steps gets one output covering all of them, as vLLM's front end merges
    the deltas its consumers have not taken, and the engine builds nothing for it meanwhile.

    It has the part of asyncio.Queue's interface that callers use (put_nowait, get,
    get_nowait, empty, qsize); its put/get pair costs about a microsecond less, which the
    engine would pay for every sequence on every step.
    """

    __slots__ = ("_items", "_waiter", "_loop", "_build", "_news_queued")

    def __init__(self, build: Callable[[], Any] | None = None) -> None:
        self._items: deque[Any] = deque()
        self._waiter: asyncio.Future | None = None  # the consumer's, while it waits
        # The consumer's loop, looked up once: on Python 3.11 every
        # `asyncio.get_running_loop()` calls getpid(), a system call (~2 µs on a VM).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._build = build  # the output the news amounts to, or None if none is due
        self._news_queued = False

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        self._wake()

    def notify(self) -> None:
        """The request has news: the consumer will get an output built when it takes it."""
        if self._news_queued:
            return
        if self._build is None:
            raise RuntimeError("this stream was made without a way to build its outputs")
        self._news_queued = True
        self._items.append(_NEWS)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # else the consumer was cancelled while waiting
                waiter.set_result(None)

    async def get(self) -> Any:
        while True:
            while not self._items:
                await self.wait()
            try:
                return self.get_nowait()
            except asyncio.QueueEmpty:
                continue  # the news amounted to nothing

    def wait(self) -> asyncio.Future:
        """A future that is done once an item has been put (the consumer then takes it).

        Awaiting it directly, rather than `get()`, saves a coroutine per item.
        """
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._waiter = waiter
        return waiter

    def get_nowait(self) -> Any:
        items = self._items
        while items:
            item = items.popleft()
            if item is not _NEWS:
                return item
            self._news_queued = False
            output = self._build()
            if output is not None:
                return output
        raise asyncio.QueueEmpty

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)
