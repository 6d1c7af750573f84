"""Faults for a real `python -m aioserve serve`, put on its PYTHONPATH by the tests.

Python imports `sitecustomize` at start-up. With `AIOSERVE_TEST_FAULTS=<folder>` set, each
model step first looks in that folder: a file `kill` makes the step raise the device
error a CUDA illegal memory access raises (the engine dies of it); a file `hang` blocks
the step until the file is gone (two minutes at most, so that the thread ends by itself);
a file `slow` makes it last 20 ms longer.
"""

import os

_FOLDER = os.environ.get("AIOSERVE_TEST_FAULTS")

if _FOLDER:
    import time
    from pathlib import Path

    import torch

    from aioserve.runner.model_runner import ModelRunner

    _execute = ModelRunner.execute
    _kill, _hang, _slow = (Path(_FOLDER, name) for name in ("kill", "hang", "slow"))

    def _faulty_execute(self, step):
        if _kill.exists():
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
        deadline = time.monotonic() + 120
        while _hang.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if _slow.exists():
            time.sleep(0.02)
        return _execute(self, step)

    ModelRunner.execute = _faulty_execute
