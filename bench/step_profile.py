"""Where a model step's time goes: wall time per kernel, for prefill and for decode steps.

Runs the offline engine on random prompts and times, on the model thread, every call the
decoder makes to a kernel (rms_norm, apply_rotary, write_kv_cache, paged_attention,
silu_and_mul), every linear layer, the output head and sampling. Prints, for the steps of
each kind, the median step time and the median time per kernel within a step.

    python bench/step_profile.py --num-prompts 64 --input-len 256 --output-len 24

With those settings the prefill steps are the 4096-token ones (the default
max_num_batched_tokens on the CPU) and the decode steps hold 64 rows. Wall-clock timing of
kernels adds a few microseconds per call; on a GPU it would need synchronization and
measures nothing useful, so this is a CPU tool.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import aioserve.models.llama as llama
from aioserve import LLM, SamplingParams
from aioserve.models.linear import Linear
from aioserve.runner import model_runner

KERNELS = ("rms_norm", "apply_rotary", "write_kv_cache", "paged_attention", "silu_and_mul")


class StepClock:
    """Per-step totals of wall time, by kernel, for steps of a chosen size."""

    def __init__(self) -> None:
        self.current: dict[str, float] | None = None
        self.steps: dict[str, list[tuple[float, dict[str, float]]]] = defaultdict(list)

    def timed(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if self.current is None:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            self.current[name] = self.current.get(name, 0.0) + time.perf_counter() - start
            return result

        return wrapper

    def record_step(self, kind: str, execute: Callable) -> Callable:
        def run(*args, **kwargs):
            self.current = {}
            start = time.perf_counter()
            try:
                return execute(*args, **kwargs)
            finally:
                self.steps[kind].append((time.perf_counter() - start, self.current))
                self.current = None

        return run


def instrument(clock: StepClock, decode_rows: int, prefill_tokens: int) -> None:
    for name in KERNELS:
        setattr(llama, name, clock.timed(name, getattr(llama, name)))
    Linear.forward = clock.timed("linear layers", Linear.forward)
    llama.LlamaForCausalLM.compute_logits = clock.timed(
        "output head", llama.LlamaForCausalLM.compute_logits
    )
    model_runner.sample = clock.timed("sampling", model_runner.sample)
    execute = model_runner.ModelRunner.execute

    def execute_and_time(runner, step):
        tokens = int(step.inputs.input_ids.shape[0])
        kind = {decode_rows: "decode", prefill_tokens: "prefill"}.get(tokens)
        if kind is None:
            return execute(runner, step)
        return clock.record_step(kind, execute)(runner, step)

    model_runner.ModelRunner.execute = execute_and_time


def report(clock: StepClock, skip_decodes: int) -> None:
    for kind, steps in clock.steps.items():
        kept = steps[skip_decodes:] if kind == "decode" else steps
        print(
            f"\n{kind}: {len(kept)} steps, median {statistics.median(t for t, _ in kept) * 1e3:.1f} ms"
        )
        names = sorted({name for _, parts in kept for name in parts})
        rows = [
            (name, statistics.median(parts.get(name, 0.0) for _, parts in kept)) for name in names
        ]
        for name, seconds in sorted(rows, key=lambda row: -row[1]):
            print(f"  {name:16s} {seconds * 1e3:9.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=24)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--skip", type=int, default=3, help="decode steps left out as warm-up")
    args = parser.parse_args()

    clock = StepClock()
    instrument(clock, decode_rows=args.num_prompts, prefill_tokens=args.max_num_batched_tokens)
    llm = LLM(model=args.model, seed=0, max_num_batched_tokens=args.max_num_batched_tokens)
    rng = random.Random(0)
    vocab = llm.get_tokenizer().vocab_size
    prompts = [
        {"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.input_len)]}
        for _ in range(args.num_prompts)
    ]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    llm.generate(prompts, params, use_tqdm=False)
    report(clock, args.skip)


if __name__ == "__main__":
    main()
