"""A small reference of vLLM 0.32's V1 scheduling rule (vllm/v1/core/sched/scheduler.py and
kv_cache_manager.allocate_slots), for the limits of --max-num-scheduled-tokens,
--max-num-active-seqs, --watermark, --scheduler-reserve-full-isl and
--long-prefill-token-threshold-adaptive; written from vLLM's rule, not from aioserve's code.

The subset: first come first served, chunked prefill, synchronous steps (each result known
before the next step), no prefix caching or speculation, full attention. One difference
is aioserve's and kept on purpose: the running requests are ranked by arrival (vLLM keeps
them in admission order, which differs only once a preempted request has resumed), so the
latest arrival is the one preempted.

A trace is one list a step: "A8" for 8 tokens of A, "-B" for B preempted in that step.
"""

from __future__ import annotations

from dataclasses import dataclass

BLOCK_SIZE = 4


@dataclass
class Job:
    """A request of the workload: its name, the step it arrives before, its prompt length
    and its max_tokens."""

    name: str
    arrival: int
    prompt: int
    max_tokens: int


@dataclass
class _State:
    job: Job
    order: int
    outputs: int = 0
    computed: int = 0
    blocks: int = 0

    @property
    def num_tokens(self) -> int:
        return self.job.prompt + self.outputs


@dataclass(frozen=True)
class Limits:
    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int = 64
    max_num_scheduled_tokens: int | None = None
    max_num_active_seqs: int | None = None
    watermark: float = 0.0
    reserve_full_isl: bool = True
    threshold: int = 0
    adaptive: bool = False


def _blocks(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def reference_trace(jobs: list[Job], limits: Limits, max_steps: int = 400) -> list[list[str]]:
    """The steps vLLM's rule gives `jobs` under `limits`, until every job has finished."""
    states = [_State(job, i) for i, job in enumerate(jobs)]
    running: list[_State] = []
    waiting: list[_State] = []
    finished = 0
    watermark_blocks = int(limits.watermark * limits.num_blocks)
    active = limits.max_num_active_seqs or limits.max_num_seqs
    trace: list[list[str]] = []
    for step in range(max_steps):
        if finished == len(states):
            return trace
        waiting += [s for s in states if s.job.arrival == step]
        waiting.sort(key=lambda s: s.order)
        running.sort(key=lambda s: s.order)

        def free() -> int:
            return limits.num_blocks - sum(s.blocks for s in running)

        token_budget = limits.max_num_scheduled_tokens or limits.max_num_batched_tokens
        input_budget = limits.max_num_batched_tokens
        num_requests = len(running) + len(waiting)
        cap = limits.threshold if num_requests > 1 else 0
        if cap > 0 and limits.adaptive:
            cap = max(cap, limits.max_num_batched_tokens // num_requests)
        scheduled: list[tuple[_State, int]] = []
        preempted: list[_State] = []

        i = 0
        while i < len(running) and token_budget > 0 and input_budget > 0:
            state = running[i]
            new = state.num_tokens - state.computed
            if 0 < cap < new:
                new = cap
            new = min(new, token_budget, input_budget)
            fits = True
            while _blocks(state.computed + new) - state.blocks > free():
                victim = running.pop()
                victim.blocks = victim.computed = 0
                waiting.append(victim)
                preempted.append(victim)
                if victim is state:
                    fits = False
                    break
            if not fits:
                break
            state.blocks = max(state.blocks, _blocks(state.computed + new))
            scheduled.append((state, new))
            token_budget -= new
            input_budget -= new
            i += 1
        waiting.sort(key=lambda s: s.order)

        while not preempted and waiting and token_budget > 0 and input_budget > 0:
            if len(running) >= active:
                break
            state = waiting[0]
            new = state.num_tokens
            if 0 < cap < new:
                new = cap
            new = min(new, token_budget, input_budget)
            keep = watermark_blocks if running else 0
            whole = _blocks(min(state.num_tokens, limits.max_model_len))
            if limits.reserve_full_isl and whole + keep > free():
                break
            if _blocks(new) + keep > free():
                break
            waiting.pop(0)
            state.blocks = _blocks(new)
            running.append(state)
            scheduled.append((state, new))
            token_budget -= new
            input_budget -= new

        trace.append(
            [f"{s.job.name}{n}" for s, n in scheduled] + [f"-{s.job.name}" for s in preempted]
        )
        for state, new in scheduled:
            state.computed += new
            if state.computed == state.num_tokens:
                state.outputs += 1
                if state.outputs == state.job.max_tokens:
                    running.remove(state)
                    state.blocks = 0
                    finished += 1
    raise AssertionError(f"the reference did not finish in {max_steps} steps: {trace[-5:]}")
