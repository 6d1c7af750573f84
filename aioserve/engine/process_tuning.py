"""A serving process's interpreter settings: garbage collection and the GIL's switch interval.

Garbage collection: the start-up heap frozen, young collections rarer. Every step creates
a few short-lived objects per running sequence (outputs, token lists, text pieces). With CPython's default thresholds a 256-sequence step sets off several
young collections, and every so often a full one walks each object the tokenizer, the
model wrappers and the interpreter hold: pauses of tens to hundreds of milliseconds on the
event loop. `bench/host_overhead.py` (256 sequences, 5 ms steps, asynchronous scheduling)
measured the loop's lag p99 going from 194 ms to 12–25 ms with the heap frozen and the
thresholds below. As vLLM does once its engine has started, what is alive after loading is
frozen (never scanned again); the young generation is collected every 50,000 allocations
instead of 700, and the older ones 5 and 10 times less often than by default.

The GIL, where the model runs on a device: the model thread gives it up while it waits
for the device and needs it back to hand over the result, while the event loop's thread
prepares the next step. A thread asking for the GIL waits until the holder yields it,
which CPython forces only every switch interval: 5 ms by default, a whole decode step. At
0.5 ms the step's end waits at most that long (`bench/host_overhead.py`, 256 sequences at
5 ms steps: 91.4-94.9% of ideal with the default, 96.2-96.8% at 0.5 ms). On the CPU the
model thread runs Python between its torch ops and both threads share the cores: there
the shorter interval measured slower (the side-by-side at rate inf, 213 against ~350
total tok/s in bench/RESULTS.md), so CPython's default stays.
"""

from __future__ import annotations

import atexit
import gc
import sys

YOUNG_THRESHOLD = 50_000
GIL_SWITCH_INTERVAL = 0.0005  # seconds

_engines_tuned = 0
_defaults: tuple[float, tuple[int, ...]] | None = None  # switch interval, gc thresholds


def tune_process_for_serving(*, model_on_device: bool) -> None:
    """Freeze everything alive now, make collections rarer and, when the model runs on a
    device, shorten the GIL's switch interval (process-wide), until every engine that
    asked has called `restore_process_settings`."""
    global _engines_tuned, _defaults
    if _engines_tuned == 0:
        _defaults = (sys.getswitchinterval(), gc.get_threshold())
        # Frozen objects are never collected, not even at exit, where extension modules
        # (Triton's nanobind bindings) would then report them as leaked.
        atexit.register(gc.unfreeze)
    _engines_tuned += 1
    if model_on_device:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL)
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, 50, 100)


def restore_process_settings() -> None:
    """Called by an engine that has shut down: unfreeze the heap, and once no engine
    is left, give the interpreter back its own thresholds and switch interval.

    Unfrozen at every engine's shutdown, not only the last one's: a frozen object is never
    collected, so every reference cycle an engine had when it froze the heap (its model's
    layers and their compiled forwards refer to each other) would keep that engine's
    weights in memory for good. In one process that built compiled engines in turn, each
    kept ~330 MB (SmolLM2) once closed; the objects of engines still running are scanned
    again until the next freeze."""
    global _engines_tuned
    gc.unfreeze()
    _engines_tuned = max(_engines_tuned - 1, 0)
    if _engines_tuned == 0 and _defaults is not None:
        switch_interval, thresholds = _defaults
        sys.setswitchinterval(switch_interval)
        gc.set_threshold(*thresholds)
