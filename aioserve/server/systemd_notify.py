"""What the server tells systemd: ready, status, watchdog pings from the engine's heartbeat, stopping.

Under a unit with `Type=notify` (tools/aioserve.service) systemd gives the service
`$NOTIFY_SOCKET`, the address of a unix datagram socket ("@name" for an abstract one), and
with `WatchdogSec=` also `$WATCHDOG_USEC` (and `$WATCHDOG_PID`). A notification is one
datagram of newline-separated `VAR=value` assignments (sd_notify(3)); `Notifier` sends
them itself. Without `$NOTIFY_SOCKET` nothing is sent and no task runs.

`SystemdService` says, as serve.py calls it:

- READY=1 once the model is loaded, a warm-up request has gone through the engine and the
  port (or the --uds socket) is open;
- STATUS= (what `systemctl status` shows): running and waiting requests and KV cache usage
  as of the engine's latest step, and what is wrong when something is; refreshed every
  `STATUS_INTERVAL_S` or sooner;
- WATCHDOG=1 every half `$WATCHDOG_USEC` (or sooner, with the status), only while the
  engine is healthy by its own judgement (`AsyncEngine.health_problem`, engine/health.py:
  alive, and its loop and model step within their stall limit), the one /health reports;
  never when `$WATCHDOG_USEC` is unset. When the pings stop, systemd kills the service
  after WatchdogSec and Restart=on-failure starts it again. A blocked event loop stops them
  too, as the pings come from it;
- STOPPING=1 when a signal starts the drain.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aioserve.engine.async_engine import AsyncEngine
    from aioserve.engine.stats import StepStats

logger = logging.getLogger("aioserve")

STATUS_INTERVAL_S = 5.0


def notify_socket_address(value: str) -> str | None:
    """The address to send to for a `$NOTIFY_SOCKET` value; None for a kind not handled here."""
    if value.startswith("@"):
        return "\0" + value[1:]  # the abstract namespace
    if value.startswith("/"):
        return value
    return None


def watchdog_interval(environ: Mapping[str, str]) -> float | None:
    """`$WATCHDOG_USEC` in seconds, or None when systemd expects no pings from this process."""
    usec = environ.get("WATCHDOG_USEC", "")
    pid = environ.get("WATCHDOG_PID", "")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        seconds = int(usec) / 1e6
    except ValueError:
        logger.warning("WATCHDOG_USEC=%r is not a number of microseconds: no watchdog pings", usec)
        return None
    return seconds if seconds > 0 else None


class Notifier:
    """Sends sd_notify(3) datagrams to `$NOTIFY_SOCKET`; sends nothing without one."""

    def __init__(self, notify_socket: str | None) -> None:
        self.address = notify_socket_address(notify_socket) if notify_socket else None
        if notify_socket and self.address is None:
            logger.warning("NOTIFY_SOCKET=%s: only unix socket paths are supported", notify_socket)
        self._socket: socket.socket | None = None
        self._warned = False

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *assignments: str) -> None:
        """Send `VAR=value` assignments in one datagram. Never blocks; a failure is logged once."""
        if self.address is None or not assignments:
            return
        try:
            if self._socket is None:
                self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._socket.setblocking(False)
            self._socket.sendto("\n".join(assignments).encode(), self.address)
        except OSError as error:
            log = logger.debug if self._warned else logger.warning
            log("cannot notify systemd (%s): %s", assignments[0], error)
            self._warned = True

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


class EngineHeartbeat:
    """A StatLogger that keeps the engine's latest step statistics for the status line, and
    asks the engine whether it is healthy."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.latest: StepStats | None = None

    def record(self, stats: StepStats) -> None:
        self.latest = stats

    def problem(self, now: float) -> str | None:
        """What is wrong with the engine at `now` (time.monotonic), or None when it is healthy."""
        return self.engine.health_problem(now)

    def status(self) -> str:
        """Requests running and waiting, and KV cache usage, as of the latest step."""
        stats = self.latest
        running, waiting = (stats.num_running, stats.num_waiting) if stats else (0, 0)
        usage = stats.kv_cache_usage if stats else 0.0
        return f"Running: {running} reqs, Waiting: {waiting} reqs, KV cache usage: {usage:.1%}"


class SystemdService:
    """The server's notifications to systemd over its life (see the module docstring).

    The heartbeat joins the engine's stat loggers at once, notifications or not, so that
    it also takes the statistics of the warm-up request, run before /metrics is attached.
    """

    def __init__(self, engine: AsyncEngine, environ: Mapping[str, str] = os.environ) -> None:
        self.notifier = Notifier(environ.get("NOTIFY_SOCKET"))
        self.watchdog_s = watchdog_interval(environ) if self.notifier.enabled else None
        self.heartbeat = EngineHeartbeat(engine)
        self._engine = engine
        engine.stat_loggers.append(self.heartbeat)
        self._status: str | None = None
        self._prefix = ""
        self._problem: str | None = None
        self._task: asyncio.Task | None = None

    def ready(self) -> None:
        """READY=1 with the status; then status and watchdog pings until `close`."""
        if not self.notifier.enabled:
            return
        self._status = self.heartbeat.status()
        self.notifier.notify("READY=1", f"STATUS={self._status}")
        if self.watchdog_s is not None:
            logger.info(
                "systemd watchdog: a ping every %.3g s while the engine makes progress",
                self.watchdog_s / 2,
            )
        self._task = asyncio.create_task(self._keep_informed(), name="aioserve-systemd-notify")

    def stopping(self) -> None:
        """STOPPING=1: the drain has begun. Status and pings go on until `close`."""
        self._prefix = "Stopping: "
        self._status = self._prefix + self.heartbeat.status()
        self.notifier.notify("STOPPING=1", f"STATUS={self._status}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self.heartbeat in self._engine.stat_loggers:
            self._engine.stat_loggers.remove(self.heartbeat)
        self.notifier.close()

    async def _keep_informed(self) -> None:
        period = STATUS_INTERVAL_S
        if self.watchdog_s is not None:
            period = min(period, self.watchdog_s / 2)
        while True:
            await asyncio.sleep(period)
            self._tick(time.monotonic())

    def _tick(self, now: float) -> None:
        problem = self.heartbeat.problem(now)
        if (problem is None) != (self._problem is None) and self.watchdog_s is not None:
            if problem is not None:
                logger.error("%s: watchdog pings stop, so systemd restarts the service", problem)
            else:
                logger.warning("the engine makes progress again: watchdog pings resume")
        self._problem = problem
        status = self._prefix + self.heartbeat.status()
        if problem is not None:
            status = f"{problem}; {status}"
        assignments = []
        if problem is None and self.watchdog_s is not None:
            assignments.append("WATCHDOG=1")
        if status != self._status:
            assignments.append(f"STATUS={status}")
            self._status = status
        self.notifier.notify(*assignments)
