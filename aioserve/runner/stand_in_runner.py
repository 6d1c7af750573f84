"""A runner without a model, for measuring the host's share of a step and for engine tests.

`StandInRunner` has the ModelRunner's interface (prepare, execute, collect) and keeps the
same contract: it tracks which sequences it holds, refuses a chunk for a sequence it does
not hold, and refuses a decode of "the token sampled last step" for a sequence that did not
sample in the step before. Its step lasts `step_seconds` of "device" time on the model
thread: it samples for each row a token that depends only on the sequence's seed and step
index (so a run gives the same tokens whatever the batching; `eos_every` makes some
sequences stop early on EOS), then sleeps out the rest of the step with the GIL released,
as waiting for a device does.

Where the model thread waits out each step, as it does on the CPU, it needs the GIL back
at the step's end before the next step can start. On a GPU it does not: the runner's
`execute` queues the step on the device and returns, and the device goes on to the next
queued step while the host learns the tokens. `queued=True` stands in for that: `execute`
makes the tokens and returns, the step occupies the "device" for `step_seconds` from when
it was queued or when the step before it ends, whichever is later, and its output is ready
then.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from aioserve.runner.cudagraph_stats import CUDAGraphSettings, CUDAGraphStat
from aioserve.runner.step_plan import StepPlan, StepResult, TokenLogprobs


@dataclass
class _StandInStep:
    plan: StepPlan
    placeholder_seqs: list[str]
    rows: list[tuple[str, int, int, int | None]]  # seq id, seed, step index, logprobs


@dataclass
class _StandInOutput:
    sampled: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]]
    ready_at: float = 0.0  # perf_counter() when the queued step is done

    def is_ready(self) -> bool:
        return time.perf_counter() >= self.ready_at

    def wait(self) -> None:
        remaining = self.ready_at - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)


def stand_in_token(seed: int, step: int, vocab_size: int) -> int:
    """The token a stand-in sequence samples at `step`: a fixed mix of seed and step."""
    mixed = (seed * 0x9E3779B1 + (step + 1) * 0x85EBCA77) & 0xFFFFFFFF
    mixed ^= mixed >> 15
    return (mixed * 0x2C1B3C6D & 0xFFFFFFFF) % vocab_size


def _sleep_overshoot(seconds: float, samples: int = 15) -> float:
    """How much later than asked `time.sleep(seconds)` returns here (the median of a few
    sleeps: ~50-100 us on a VM), so that a step can aim its sleep to last `seconds`."""
    late = []
    for _ in range(samples):
        started = time.perf_counter()
        time.sleep(seconds)
        late.append(time.perf_counter() - started - seconds)
    return min(statistics.median(late), seconds / 2)


class StandInRunner:
    graph_settings = CUDAGraphSettings()  # no graphs: every step runs as it is

    def __init__(
        self,
        vocab_size: int,
        *,
        step_seconds: float = 0.0,
        eos_token_id: int | None = None,
        eos_every: int = 0,
        queued: bool = False,
    ) -> None:
        self.vocab_size = vocab_size
        self.step_seconds = step_seconds
        self.queued = queued
        self._device_free_at = 0.0  # queued: when the last queued step ends
        self.device_idle_seconds = 0.0  # queued: the device's waits for a step to be queued
        self._sleep_overshoot = _sleep_overshoot(step_seconds) if step_seconds > 0 else 0.0
        self.eos_token_id = eos_token_id
        self.eos_every = eos_every  # a sequence whose seed divides by it stops at step 3 + seed % 7
        self.num_steps = 0
        self.num_sampled_rows = 0
        self.device_seconds = 0.0  # total time spent in steps
        self._seqs: dict[str, tuple[int, int]] = {}  # seq id -> (seed, tokens sampled so far)
        self._logprobs: dict[str, int | None] = {}
        self._sampled_last_step: set[str] = set()

    def prepare(self, plan: StepPlan) -> _StandInStep:
        for seq_id in plan.finished_seq_ids:
            self._seqs.pop(seq_id, None)
        for seq in plan.new_sequences:
            if seq.seq_id in self._seqs:
                raise ValueError(f"sequence {seq.seq_id!r} is already in the runner")
            self._seqs[seq.seq_id] = (seq.sampling.seed, len(seq.output_token_ids))
            self._logprobs[seq.seq_id] = seq.sampling.logprobs
        rows = []
        placeholders = []
        for chunk in plan.chunks:
            if chunk.seq_id not in self._seqs:
                raise KeyError(f"sequence {chunk.seq_id!r} is not in the runner")
            if chunk.token_ids is None:
                placeholders.append(chunk.seq_id)
            if chunk.samples:
                seed, step = self._seqs[chunk.seq_id]
                self._seqs[chunk.seq_id] = (seed, step + 1)
                rows.append((chunk.seq_id, seed, step, self._logprobs[chunk.seq_id]))
        return _StandInStep(plan, placeholders, rows)

    @staticmethod
    def graph_stat(step: _StandInStep) -> CUDAGraphStat:
        return CUDAGraphStat.eager(step.plan.num_tokens)

    def execute(self, step: _StandInStep) -> _StandInOutput:
        started = time.perf_counter()
        missing = [s for s in step.placeholder_seqs if s not in self._sampled_last_step]
        if missing:
            raise RuntimeError(f"decode of a token never sampled the step before: {missing}")
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprobs]] = {}
        for seq_id, seed, index, wanted in step.rows:
            token = stand_in_token(seed, index, self.vocab_size)
            if self.eos_every and seed % self.eos_every == 0 and index == 3 + seed % 7:
                token = self.eos_token_id
            sampled[seq_id] = [token]
            if wanted is not None:
                logprobs[seq_id] = [TokenLogprobs(-1.0, 1, [token] * wanted, [-1.0] * wanted)]
        self._sampled_last_step = set(sampled)
        self.num_steps += 1
        self.num_sampled_rows += len(step.rows)
        if self.queued:
            return _StandInOutput(sampled, logprobs, self._queue(started))
        # The tokens are made first, inside the step's time, as a device samples them
        # within its step: the stand-in's own Python is not the host's work.
        # One sleep, releasing the GIL once and taking it back once, as waiting for a
        # device does (spinning in short sleeps would queue for the GIL at each one).
        remaining = started + self.step_seconds - self._sleep_overshoot - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        self.device_seconds += time.perf_counter() - started
        return _StandInOutput(sampled, logprobs)

    def _queue(self, queued_at: float) -> float:
        """Occupy the device for one step after those queued before; when it ends."""
        begins = max(queued_at, self._device_free_at)
        if self.num_steps > 1:  # before the first step the device was not waiting for us
            self.device_idle_seconds += begins - self._device_free_at
        self._device_free_at = begins + self.step_seconds
        self.device_seconds += self.step_seconds
        return self._device_free_at

    def collect(self, output: _StandInOutput) -> StepResult:
        return StepResult(output.sampled, output.logprobs)
