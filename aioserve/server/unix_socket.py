"""`--uds PATH`: the HTTP server on a Unix domain socket instead of --host/--port.

As in vLLM, --host and --port are then ignored, TLS (--ssl-certfile) is served over the
socket when asked for, and the socket file takes the permissions the process's umask
gives (vLLM binds it the same way; a client needs write permission on it to connect).

What vLLM leaves to the user, done here:

- the path is checked before the model loads (`check_socket_path`): its folder must
  exist, the path must fit a socket address (107 bytes), and what is at the path may only
  be a socket no server answers on;
- a socket file a server that is gone left behind (a crash, SIGKILL) is removed at bind
  time: vLLM's plain bind fails on it with "Address already in use" until someone removes
  it. A socket some server still answers on, or a file that is not a socket, is never
  removed: the start stops, naming --uds;
- `UnixSocket.remove` deletes the file when the server stops, as uvicorn does for its
  own --uds (vLLM leaves it), unless another server has put its own socket there since.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat

from aioserve.config.declaration import ConfigError

logger = logging.getLogger("aioserve")

# sun_path is 108 bytes on Linux, its last one the terminating NUL.
MAX_PATH_BYTES = 107
_PROBE_TIMEOUT_S = 1.0


def check_socket_path(path: str) -> None:
    """Refuse, naming --uds, a path the server could not listen on (see the module's
    docstring); a stale socket there is left for `bind_unix_socket` to replace."""
    if len(os.fsencode(path)) > MAX_PATH_BYTES:
        raise ConfigError(
            f"--uds {path}: a Unix socket path has at most {MAX_PATH_BYTES} bytes; this one "
            f"has {len(os.fsencode(path))}"
        )
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"--uds {path}: the folder {folder} does not exist")
    _check_occupant(path)


def _check_occupant(path: str) -> bool:
    """Whether a stale socket is at `path` (False: nothing is); a ConfigError when what is
    there must not be replaced."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    except OSError as error:
        raise ConfigError(f"--uds {path}: {error.strerror}") from None
    if not stat.S_ISSOCK(mode):
        raise ConfigError(f"--uds {path}: the path exists and is not a socket; not removing it")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(_PROBE_TIMEOUT_S)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            return True  # nobody listens: a socket left by a server that is gone
        except OSError as error:
            reason = "no answer" if isinstance(error, TimeoutError) else error.strerror
            raise ConfigError(
                f"--uds {path}: a socket is there and it cannot be told whether a server "
                f"still uses it ({reason}); not removing it"
            ) from None
    raise ConfigError(f"--uds {path}: another server is listening on this socket")


class UnixSocket:
    """The listening socket at `path`: bound by `bind`, its file removed by `remove`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.socket: socket.socket | None = None
        # (device, inode, mtime) of our socket file: an inode may be reused by a file that
        # replaces it, not with the same time to the nanosecond too.
        self._identity: tuple[int, int, int] | None = None

    def bind(self) -> socket.socket:
        """A socket bound to the path (not listening yet); a stale socket file there is
        replaced. ConfigError, naming --uds, when the path cannot be had."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:
                sock.bind(self.path)
            except OSError as error:
                if error.errno != errno.EADDRINUSE or not _check_occupant(self.path):
                    raise
                logger.warning("--uds %s: removing the socket a stopped server left", self.path)
                os.unlink(self.path)
                sock.bind(self.path)
        except ConfigError:
            sock.close()
            raise
        except OSError as error:
            sock.close()
            raise ConfigError(f"cannot listen on --uds {self.path}: {error.strerror}") from None
        self._identity = _identity(os.lstat(self.path))
        self.socket = sock
        return sock

    def remove(self) -> None:
        """Delete the socket file, if it is still the one `bind` made."""
        if self._identity is None:
            return
        try:
            if _identity(os.lstat(self.path)) == self._identity:
                os.unlink(self.path)
        except OSError:
            pass  # already gone, or not ours to remove
        self._identity = None


def _identity(found: os.stat_result) -> tuple[int, int, int]:
    return found.st_dev, found.st_ino, found.st_mtime_ns
