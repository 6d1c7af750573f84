"""The dynamo config patch the model step enters at every step leaves no trace behind.

torch gives each `torch._dynamo.config.patch(...)` object a ContextVar of its own, and a
context never drops a variable once set: a new patch object per step grew the model
thread's context by one variable a call (~235 bytes), for as long as the server ran. The
soak test (tests/server/test_soak.py) found it; this is the fast check.
"""

from __future__ import annotations

import contextvars
import threading

from aioserve.runner.compiled_step import _one_graph_for_every_layer


def test_entering_the_step_patch_again_and_again_adds_nothing_to_the_threads_context():
    sizes: list[int] = []

    def model_thread() -> None:
        for _ in range(3):
            for _ in range(200):
                with _one_graph_for_every_layer():
                    pass
            sizes.append(len(contextvars.copy_context()))

    thread = threading.Thread(target=model_thread)
    thread.start()
    thread.join()
    assert sizes[0] == sizes[1] == sizes[2], sizes
