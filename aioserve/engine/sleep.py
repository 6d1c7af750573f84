"""Sleep mode: vLLM 0.32's engine sleep, wake_up, release_kv_cache_memory and is_sleeping
(v1/engine/core.py over its executor's sleeping tags; the server's /sleep routes and
LLM.sleep / LLM.wake_up call them).

    level 0  the scheduler paused (pause.py, in the sleep's mode); no memory changes
    level 1  paused, the prefix cache forgotten, the KV cache's memory freed and the
             weights offloaded to host memory (on the CPU, where they are already, kept)
    level 2  paused, the prefix cache forgotten, the KV cache and the weights freed

runner/sleep_memory.py says how the memory goes and comes back. As in vLLM, the sleeping
tags are "weights" and "kv_cache" (both set by a level 1 or 2 sleep, "kv_cache" alone by
release_kv_cache_memory, which needs a completed pause and all memory resident); waking
with some tags brings those back and leaves the engine asleep; with all of them (or none
given) it is awake again and the pause ends: the requests that came meanwhile, queued as
during a pause, then run. The tag "scheduling" alone ends a level-0 sleep. A level-2 wake
loads the served model's weights again from its checkpoint, where vLLM waits for a trainer
to send new ones: aioserve has no route to send them through.

Without --enable-sleep-mode the tags and the pause are kept just the same, but no memory
is freed: vLLM then runs without its sleep allocator, whose sleep finds nothing to free (on
its CPU worker sleep is "not supported, ignored"), and answers as usual.

Departures: while memory is asleep /resume (resume_generation) is refused rather than let
steps run on freed memory (`EngineAsleepError`), and level 2 is refused where the weights
cannot be freed and loaded again (sleep_memory.level_2_refusal), with --enable-lora too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from torch import nn

from aioserve.engine.settings import EngineParts
from aioserve.runner.model_runner import ModelRunner
from aioserve.runner.sleep_memory import (
    KV_CACHE,
    SLEEP_TAGS,
    WEIGHTS,
    SleepingMemory,
    level_2_refusal,
)

logger = logging.getLogger("aioserve")

SLEEP_LEVELS = (0, 1, 2)


class SleepRefused(ValueError):
    """A sleep this engine cannot take (level 2 with weights it cannot load again)."""


class EngineAsleepError(RuntimeError):
    """Generation cannot resume while memory is asleep: wake the engine up first."""


class EngineSleep:
    """The engine's sleeping tags, the memory they stand for (None without
    --enable-sleep-mode), and the state vLLM's `vllm:engine_sleep_state` shows."""

    def __init__(self, memory: SleepingMemory | None) -> None:
        self.memory = memory
        self.sleeping_tags: set[str] = set()
        self.state = (0, 0)  # (sleep, level), as vLLM's record_sleep_state takes them
        self.lock = asyncio.Lock()  # one sleep, wake or release at a time

    @property
    def holds_memory(self) -> bool:
        """Whether memory steps need is freed or elsewhere now."""
        return self.memory is not None and bool(self.sleeping_tags)

    def record(self, sleep: int, level: int) -> None:
        self.state = (sleep, level)

    def level_2_refusal(self) -> str | None:
        return None if self.memory is None else level_2_refusal(self.memory.model)

    # -- the executor's bookkeeping (vLLM's v1/executor/abstract.py), on the model thread --

    def sleep(self, level: int) -> None:
        if WEIGHTS in self.sleeping_tags:
            logger.warning("Executor is already sleeping.")
            return
        if self.memory is None:
            _not_enabled()
        else:
            self.memory.sleep(level)
        self.sleeping_tags |= SLEEP_TAGS

    def wake_up(self, tags: list[str] | None) -> None:
        if not self.sleeping_tags:
            logger.warning("Executor is not sleeping.")
            return
        for tag in tags or ():
            if tag not in self.sleeping_tags:
                logger.warning("Tag %s is not in sleeping tags %s", tag, self.sleeping_tags)
                return
        if self.memory is not None:
            self.memory.wake_up(tags)
        if tags:
            self.sleeping_tags.difference_update(tags)
        else:
            self.sleeping_tags.clear()

    def discard_kv_cache(self) -> None:
        if KV_CACHE in self.sleeping_tags:
            logger.warning("Tags %s are already sleeping.", (KV_CACHE,))
            return
        if self.memory is None:
            _not_enabled()
        else:
            self.memory.discard((KV_CACHE,))
        self.sleeping_tags.add(KV_CACHE)


def _not_enabled() -> None:
    logger.warning(
        "sleep mode is not enabled (--enable-sleep-mode): generation is paused, no memory is freed"
    )


def check_level(level: int) -> None:
    """ValueError for a level vLLM's sleep does not know."""
    if level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level must be 0, 1 or 2, not {level!r}")


def wake_tags(tags: list[str] | None) -> list[str] | None:
    """vLLM's engine core's tags for the executor: "scheduling" taken out."""
    if tags is not None and "scheduling" in tags:
        return [tag for tag in tags if tag != "scheduling"]
    return tags


def sleeping_memory(
    runner: ModelRunner, load_weights: Callable[[], nn.Module] | None
) -> SleepingMemory:
    """The runner's memory as sleep frees it: its model and KV caches; a level-2 wake
    loads the model again with `load_weights` and the runner's derived copies."""
    reload = None
    if load_weights is not None:
        reload = lambda: runner.model_step.derive_weights(load_weights())  # noqa: E731
    graphs = runner.decode_graphs
    return SleepingMemory(
        runner.model,
        runner.kv_caches,
        runner.device,
        reload=reload,
        recapture=None if graphs is None else graphs.recapture,
    )


def engine_sleep(parts: EngineParts) -> EngineSleep:
    """The sleep state of an engine built of `parts`: its memory freed by sleep with
    --enable-sleep-mode, none without."""
    if not parts.settings.enable_sleep_mode:
        return EngineSleep(None)
    assert isinstance(parts.runner, ModelRunner)  # build refuses it for pooling models
    return EngineSleep(sleeping_memory(parts.runner, parts.load_weights))
