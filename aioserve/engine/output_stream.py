"""OutputStream: one request's outputs on their way from the engine loop to its consumer."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any


class OutputStream:
    """A queue with one consumer: the engine puts without waiting, the consumer awaits `get`.

    It has the part of asyncio.Queue's interface that callers use (put_nowait, get,
    get_nowait, empty, qsize). asyncio.Queue would do, but its put/get pair costs about a
    microsecond more, and the engine pays that for every sequence on every step.
    """

    __slots__ = ("_items", "_waiter", "_loop")

    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._waiter: asyncio.Future | None = None  # the consumer's, while it waits
        # The consumer's loop, looked up once: on Python 3.11 every
        # `asyncio.get_running_loop()` calls getpid(), a system call (~2 µs on a VM).
        self._loop: asyncio.AbstractEventLoop | None = None

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # else the consumer was cancelled while waiting
                waiter.set_result(None)

    async def get(self) -> Any:
        while not self._items:
            await self.wait()
        return self._items.popleft()

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
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)
