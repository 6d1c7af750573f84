"""Is the host hidden behind the device? Steps per second of the real engine on a stand-in
runner whose every step takes D ms of "device" time, against the ideal 1000 / D.

The engine is the real one (scheduler, KV-cache manager, output processor with incremental
detokenization by the default model's tokenizer, streaming to one consumer per request in
DELTA mode, as the server streams); only the model is replaced by `StandInRunner`, whose
step lasts D ms with the GIL released, in one of two ways:

- waited: the model thread waits the step out, as on the CPU, where the model thread
  computes the step, and it needs the GIL back before the next step can start;
- queued: the step is queued on the "device" and the model thread returns, as the
  runner's `execute` does on a GPU; each step starts when it is queued or when the one
  before it ends, and the host learns its tokens when it ends.

For each D and each batch of B decoding sequences it measures, the steps waited with
asynchronous scheduling on and off, and queued with it on:

- steps/s over `--steps` decode steps once all B sequences decode, and its share of the
  ideal 1000 / D;
- device ms per step: how long the stand-in's steps lasted (D, and more where the model
  thread waited for the GIL to hand back a waited step);
- host ms per step: CPU time of the event loop's thread per step (scheduling, input
  preparation, output processing, the consumers);
- the mean host gap: how long the device waited for the host between steps (waited: the
  engine's own `host_gap`; queued: the stand-in's idle time a step), and the event loop's
  lag p99 (a 1 ms timer's lateness);
- tokens per output: how many tokens each output a consumer took carried on average (the
  first consumer's; all are alike). A
  consumer builds its output when it takes it, so where the host cannot keep up with the
  steps, the loop runs ahead of the consumers (up to `RUN_AHEAD_S`) and each of their
  outputs covers several steps; 1.0 means one output per token.

It runs on uvloop, as the server does.

    python bench/host_overhead.py                       # D = 2, 5, 10 ms; B = 1, 64, 256
    python bench/host_overhead.py --device-ms 6 --batch 64 --steps 400

The queued figure is the one that carries over to a GPU: there a Llama-3-8B decode step
takes ~6 ms, and any host time not hidden behind it is lost.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from dataclasses import dataclass

from aioserve.engine.async_engine import AsyncEngine
from aioserve.engine.process_tuning import tune_process_for_serving
from aioserve.engine.sampling_params import RequestOutputKind, SamplingParams
from aioserve.engine.stand_in_parts import engine_parts_around
from aioserve.engine.stats import StepStats
from aioserve.models.checkpoint import open_checkpoint
from aioserve.models.resolve import DEFAULT_MODEL, resolve_model
from aioserve.runner.stand_in_runner import StandInRunner
from aioserve.server.serve import run_on_uvloop

PROMPT_LEN = 16
WARMUP_STEPS = 20


@dataclass
class Point:
    device_ms: float
    batch: int
    queued: bool
    async_scheduling: bool
    steps_per_s: float
    device_ms_per_step: float
    host_ms_per_step: float
    host_gap_ms: float
    lag_p99_ms: float
    tokens_per_output: float

    @property
    def share_of_ideal(self) -> float:
        return self.steps_per_s / (1000.0 / self.device_ms)


class HostGaps:
    """A StatLogger keeping the engine's host gaps."""

    def __init__(self) -> None:
        self.gaps: list[float] = []

    def record(self, stats: StepStats) -> None:
        if stats.host_gap is not None:
            self.gaps.append(stats.host_gap)


async def measure(
    tokenizer, device_ms: float, batch: int, steps: int, queued: bool, overlap: bool
) -> Point:
    runner = StandInRunner(len(tokenizer), step_seconds=device_ms / 1000, queued=queued)
    max_tokens = WARMUP_STEPS + steps + 10
    engine = AsyncEngine(
        engine_parts_around(
            runner,
            vocab_size=len(tokenizer),
            tokenizer=tokenizer,
            num_blocks=batch * (-(-(PROMPT_LEN + max_tokens) // 16)) + 16,
            max_model_len=PROMPT_LEN + max_tokens,
            max_num_seqs=max(batch, 1),
            max_num_batched_tokens=max(4096, batch * PROMPT_LEN),
            async_scheduling=overlap,
        )
    )
    gaps = HostGaps()
    engine.stat_loggers.append(gaps)
    params = SamplingParams(
        temperature=1.0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    lags: list[float] = []
    counts = {"outputs": 0, "tokens": 0}  # the first consumer's, inside the measured window
    marks: dict[str, tuple[int, float, float, int, float, float]] = {}
    loop_thread = threading.current_thread()

    def mark(name: str) -> None:
        assert threading.current_thread() is loop_thread
        marks[name] = (
            runner.num_steps,
            time.perf_counter(),
            time.thread_time(),
            len(gaps.gaps),
            runner.device_seconds,
            runner.device_idle_seconds,
        )

    async def consume(i: int) -> None:
        prompt = {"prompt_token_ids": [(97 * i + 13 * k) % 40000 + 100 for k in range(PROMPT_LEN)]}
        outputs = engine.generate(prompt, params, f"r{i}")
        if i > 0:  # the others only take their outputs: the bench's own work stays small
            async for _ in outputs:
                pass
            return
        # The first consumer times the window and counts its outputs (all are alike).
        async for out in outputs:
            tokens = len(out.outputs[0].token_ids)
            if "start" not in marks:
                if tokens and runner.num_steps >= WARMUP_STEPS:
                    mark("start")
            elif "end" not in marks:
                counts["outputs"] += 1
                counts["tokens"] += tokens
                if runner.num_steps >= marks["start"][0] + steps:
                    mark("end")

    async def lag_monitor() -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await asyncio.sleep(0.001)
            lags.append(max(0.0, loop.time() - started - 0.001))

    monitor = asyncio.create_task(lag_monitor())
    await asyncio.gather(*(consume(i) for i in range(batch)))
    monitor.cancel()
    await engine.shutdown()
    (s0, t0, c0, g0, d0, i0), (s1, t1, c1, g1, d1, i1) = marks["start"], marks["end"]
    num_steps = s1 - s0
    if queued:
        host_gap = (i1 - i0) / num_steps
    else:
        host_gap = statistics.fmean(gaps.gaps[g0:g1] or [0.0])
    return Point(
        device_ms=device_ms,
        batch=batch,
        queued=queued,
        async_scheduling=overlap,
        steps_per_s=num_steps / (t1 - t0),
        device_ms_per_step=(d1 - d0) / num_steps * 1000,
        host_ms_per_step=(c1 - c0) / num_steps * 1000,
        host_gap_ms=host_gap * 1000,
        lag_p99_ms=statistics.quantiles(lags, n=100)[98] * 1000 if len(lags) > 2 else 0.0,
        tokens_per_output=counts["tokens"] / max(counts["outputs"], 1),
    )


def table(points: list[Point]) -> str:
    lines = [
        "| D ms | batch | step | async scheduling | steps/s | ideal | share of ideal "
        "| device ms/step "
        "| host ms/step | host gap ms | loop lag p99 ms | tokens per output |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        lines.append(
            f"| {p.device_ms:g} | {p.batch} | {'queued' if p.queued else 'waited'} "
            f"| {'on' if p.async_scheduling else 'off'} "
            f"| {p.steps_per_s:.1f} | {1000 / p.device_ms:.0f} | {p.share_of_ideal:.1%} "
            f"| {p.device_ms_per_step:.2f} | {p.host_ms_per_step:.2f} | {p.host_gap_ms:.3f} "
            f"| {p.lag_p99_ms:.2f} | {p.tokens_per_output:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device-ms", type=float, nargs="+", default=[2.0, 5.0, 10.0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=200, help="decode steps measured per point")
    args = parser.parse_args()
    tokenizer = open_checkpoint(str(resolve_model(DEFAULT_MODEL).path)).load_tokenizer()
    # As AsyncEngine.from_config does after loading; the stand-in plays a device.
    tune_process_for_serving(model_on_device=True)
    points = []
    for device_ms in args.device_ms:
        for batch in args.batch:
            for queued, overlap in ((False, True), (False, False), (True, True)):
                point = run_on_uvloop(
                    measure(tokenizer, device_ms, batch, args.steps, queued, overlap)
                )
                points.append(point)
                print(table([point]).splitlines()[-1], flush=True)
    print()
    print(table(points))


if __name__ == "__main__":
    main()
