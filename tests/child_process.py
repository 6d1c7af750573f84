"""Child processes that die with the test process.

A server started by a test is killed in the test's `finally`, but a test process that is
itself killed (a CI timeout, SIGKILL) runs no `finally`, and its servers would live on,
each holding gigabytes. `die_with_parent` as a Popen `preexec_fn` asks the kernel to send
the child SIGKILL when its parent goes (Linux's PR_SET_PDEATHSIG); `start_logged` starts
a server that way with its output in a log file.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def start_logged(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """`argv` started with stdout and stderr in `log`, dying with this process."""
    with open(log, "wb") as output:
        return subprocess.Popen(
            argv, stdout=output, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent
        )
