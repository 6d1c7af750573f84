"""Where the start of `aioserve serve` goes: a timestamp at each phase, up to the first 200
on /health, then the server is stopped.

Runs the server in this process, as `python -m aioserve serve` would (its host memory
tuned before torch is imported, as the CLI does), with the engine's
start-up steps wrapped to print the seconds since Python started when each begins and
ends (the KV pool's zeroing included), and a thread polling /health. Arguments
after the script's own are `aioserve serve`'s:

    python bench/startup_timeline.py
    python bench/startup_timeline.py --enforce-eager
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import sys
import threading
import time
import urllib.request

STARTED = time.perf_counter()


def stamp(what: str) -> None:
    # One write a line: the zeroing thread stamps too, and print() writes the text and its
    # newline apart, so two threads' lines could run together.
    sys.stderr.write(f"[{time.perf_counter() - STARTED:6.2f} s] {what}\n")
    sys.stderr.flush()


def timed(owner: object, name: str, label: str) -> None:
    """Replace owner.name with a wrapper that stamps when it starts and ends."""
    function = getattr(owner, name)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        stamp(f"{label} starts")
        try:
            return function(*args, **kwargs)
        finally:
            stamp(f"{label} ends")

    setattr(owner, name, wrapper)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def stop_when_healthy(port: int) -> None:
    url = f"http://127.0.0.1:{port}/health"
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1):
                stamp("healthy")
                os.kill(os.getpid(), signal.SIGTERM)
                return
        except OSError:
            time.sleep(0.05)


def main() -> None:
    from aioserve import host_memory

    host_memory.keep_host_memory()  # before torch is imported, as the CLI does
    import torch  # noqa: F401 - timed on its own: the largest single import

    stamp("torch imported")
    from aioserve.engine import build, served_weights
    from aioserve.runner import compiled_step, kv_memory, model_runner

    stamp("aioserve's engine imported")
    from aioserve import cli

    timed(build, "open_checkpoint", "opening the checkpoint")
    timed(served_weights, "load_model", "loading the model")
    timed(model_runner.ModelRunner, "__init__", "building the runner")
    timed(kv_memory.KVZeroing, "_zero_on_one_core", "zeroing the KV pool on its thread")
    timed(kv_memory.KVZeroing, "join", "joining the KV pool's zeroing")
    timed(compiled_step.ModelStep, "warm_up", "compiling the model step")
    port = free_port()
    sys.argv = ["aioserve", "serve", "--host", "127.0.0.1", "--port", str(port), *sys.argv[1:]]
    threading.Thread(target=stop_when_healthy, args=(port,), daemon=True).start()
    cli.main()


if __name__ == "__main__":
    main()
