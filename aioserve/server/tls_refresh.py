"""`--enable-ssl-refresh`: the server's TLS files loaded again when they change on disk.

Certificates are rotated in place (cert-manager, certbot, a Kubernetes secret swapped
under its mount): the server takes the new certificate chain (--ssl-certfile with
--ssl-keyfile) and CA bundle (--ssl-ca-certs) into its live `ssl.SSLContext`, so new
connections get them while the connections already open keep theirs. No restart. (As in
vLLM, a CA bundle that changes is added to the context's trusted CAs: one taken out of the
file stays trusted until the server restarts.)

The files are polled on the event loop (a stat of each, once a second) rather than watched
through inotify, which needs a dependency and misses a secret's symlink swap. A change is
acted on once it is complete: when a key and its certificate are written one after the
other, loading between the two writes fails (they do not match); the failure is logged and
the old chain stays in use until the files change again. A new chain is tried on a scratch
context before the live one: OpenSSL would otherwise keep the new certificate of a pair
whose key it refuses, and no handshake would succeed (vLLM's refresher loads it straight
into the live context).
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import Callable

logger = logging.getLogger("aioserve")

POLL_SECONDS = 1.0

# A file's identity as far as a change goes: (inode, size, mtime in ns); None if missing.
Signature = tuple[tuple[int, int, int] | None, ...]


def _signature(paths: list[str]) -> Signature:
    signature = []
    for path in paths:
        try:
            stat = os.stat(path)  # follows symlinks: a swapped secret changes the inode
        except OSError:
            signature.append(None)
        else:
            signature.append((stat.st_ino, stat.st_size, stat.st_mtime_ns))
    return tuple(signature)


class _WatchedFiles:
    """Files, and what to do with the context once they change."""

    def __init__(self, what: str, paths: list[str], load: Callable[[], None]) -> None:
        self.what, self.paths, self.load = what, paths, load
        self.seen = _signature(paths)  # what the context holds, or the last failed try

    def reload_if_changed(self) -> None:
        signature = _signature(self.paths)
        if signature == self.seen:
            return
        self.seen = signature
        try:
            self.load()
        except (OSError, ssl.SSLError) as error:
            logger.warning(
                "TLS files changed but cannot be loaded (%s: %s); the server keeps the %s "
                "it has until they change again",
                ", ".join(self.paths),
                error,
                self.what,
            )
        else:
            logger.info("Reloaded the TLS %s from %s", self.what, ", ".join(self.paths))


class TLSRefresher:
    """Polls the TLS files of `context` and loads them into it when they change."""

    def __init__(
        self,
        context: ssl.SSLContext,
        certfile: str,
        keyfile: str | None = None,
        ca_certs: str | None = None,
        poll_seconds: float = POLL_SECONDS,
    ) -> None:
        self.poll_seconds = poll_seconds
        chain_files = [certfile] if keyfile is None else [certfile, keyfile]

        def load_chain() -> None:
            # A pair that fails to load can leave the context half changed (OpenSSL takes
            # the new certificate, then refuses the key that does not match it), which
            # breaks every handshake: so the pair is tried on a scratch context first.
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(certfile, keyfile)
            context.load_cert_chain(certfile, keyfile)

        self.watched = [_WatchedFiles("certificate chain", chain_files, load_chain)]
        if ca_certs is not None:
            self.watched.append(
                _WatchedFiles(
                    "CA certificates", [ca_certs], lambda: context.load_verify_locations(ca_certs)
                )
            )
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._poll())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_seconds)
            for files in self.watched:
                files.reload_if_changed()
