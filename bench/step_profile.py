"""Where a model step's time goes: steps by kind, and torch's operator table for one of each.

Runs the offline engine (the compiled step, as served) on random prompts of --input-len
tokens, every prompt given at once, and times each model step on the model thread. Prints,
for prefill steps (--max-num-batched-tokens rows), decode steps (one row per prompt) and the
rest, how many ran, their total and their median; then, with --ops, the torch profiler's
operator table (self CPU time) for one prefill step and for one decode step taken past the
warm-up. Inside the compiled step, `## Call CompiledFxGraph` is the time spent in the code
inductor generated (normalization, rotary, activation, residual adds), `aten::mm` the
dense layers, and `aioserve::paged_attention` the attention op with its gathers and SDPA.

    python bench/step_profile.py --num-prompts 64 --input-len 256 --output-len 64 --ops
    python bench/step_profile.py --no-keep-host-memory      # glibc's and torch's defaults

By default the process tunes its allocators as `aioserve serve` does
(aioserve/host_memory.py), before torch is imported; the page faults the run took are
printed, so the two settings can be compared. Profiling adds overhead to each operator; the
step times printed are taken without the profiler, except for the two profiled steps.
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import sys
import time
from collections import defaultdict

from aioserve import host_memory


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=None, help="default: the platform's")
    parser.add_argument("--ops", action="store_true", help="print the profiler's tables")
    parser.add_argument(
        "--warmup-steps", type=int, default=8, help="decode steps before the profiled one"
    )
    parser.add_argument(
        "--keep-host-memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="tune the allocators as `aioserve serve` does",
    )
    return parser.parse_args()


class StepTimer:
    """Wraps ModelRunner.execute: the wall time of every step by kind, and a profile of one
    step of each kind when asked."""

    def __init__(self, prefill_rows: int, decode_rows: int, profile_after: int | None) -> None:
        self.kinds = {prefill_rows: "prefill", decode_rows: "decode"}
        self.times: dict[str, list[float]] = defaultdict(list)
        self.profile_after = profile_after
        self.tables: dict[str, str] = {}

    def kind(self, rows: int) -> str:
        return self.kinds.get(rows, "other")

    def wrap(self, execute):
        import torch

        def timed_execute(runner, step):
            kind = self.kind(int(step.inputs.input_ids.shape[0]))
            profile = (
                self.profile_after is not None
                and kind != "other"
                and kind not in self.tables
                and (kind == "prefill" or len(self.times["decode"]) >= self.profile_after)
            )
            if not profile:
                start = time.perf_counter()
                result = execute(runner, step)
                self.times[kind].append(time.perf_counter() - start)
                return result
            # The engine runs steps on its model thread; the profiler records the thread
            # that starts it, so it is started here.
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                result = execute(runner, step)
            self.tables[kind] = prof.key_averages().table(
                sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=48
            )
            return result

        return timed_execute


def main() -> None:
    args = parse_args()
    if args.keep_host_memory:
        host_memory.keep_host_memory()  # before torch is imported, as the CLI does
    from aioserve import LLM, SamplingParams
    from aioserve.runner import model_runner

    llm = LLM(
        model=args.model,
        seed=0,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
    )
    rng = random.Random(0)
    vocab = llm.get_tokenizer().vocab_size

    def prompts(count: int) -> list[dict]:
        return [
            {"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.input_len)]}
            for _ in range(count)
        ]

    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    llm.generate(prompts(2), params, use_tqdm=False)  # every graph compiled before timing

    timer = StepTimer(
        args.max_num_batched_tokens, args.num_prompts, args.warmup_steps if args.ops else None
    )
    model_runner.ModelRunner.execute = timer.wrap(model_runner.ModelRunner.execute)
    faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    llm.generate(prompts(args.num_prompts), params, use_tqdm=False)
    wall = time.perf_counter() - start
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before

    tokens = args.num_prompts * (args.input_len + args.output_len)
    print(f"host memory tuning: {'; '.join(host_memory.changes) or 'none'}")
    print(f"{tokens} tokens in {wall:.2f} s ({tokens / wall:.1f} tok/s), {faults} page faults")
    for kind, times in sorted(timer.times.items()):
        print(
            f"{kind:8s} {len(times):4d} steps, {sum(times):7.2f} s, "
            f"median {statistics.median(times) * 1e3:8.1f} ms"
        )
    for kind, table in timer.tables.items():
        print(f"\none {kind} step, by operator:\n{table}")


if __name__ == "__main__":
    sys.exit(main())
