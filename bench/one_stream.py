"""Where a token's time goes at one stream, in process: the model step against the host.

Runs the offline engine (the compiled step, as served) on one random prompt of
--input-len tokens at a time. The time per output token is the difference between
generating --output-len + 1 tokens and generating one, over --output-len, the median of
--repeats runs each; beside it, the medians of the model step (`ModelRunner.execute`, on
the model thread) and of preparing a step (`ModelRunner.prepare`, on the engine's thread,
wall and CPU time). What the step does not account for is host work on the engine's thread
(scheduling, preparing, recording, detokenizing) and the hand-offs between the threads.

    python bench/one_stream.py
    PYTHONPATH=/path/to/other/checkout python bench/one_stream.py   # an A/B

At one stream the host's work runs right after a model step has streamed its weights
through the CPU's caches: the same `prepare` that takes ~50 us replayed in a loop took
~400 us there on a Zen 5 EPYC (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from aioserve import host_memory


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    return parser.parse_args()


class Timings:
    """Wraps a method of ModelRunner: the wall and CPU time of each call."""

    def __init__(self, cls: type, name: str) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        original = getattr(cls, name)

        def timed(runner, *args):
            wall, cpu = time.perf_counter(), time.thread_time()
            result = original(runner, *args)
            self.cpu.append(time.thread_time() - cpu)
            self.wall.append(time.perf_counter() - wall)
            return result

        setattr(cls, name, timed)

    def clear(self) -> None:
        self.wall.clear()
        self.cpu.clear()


def one_request_at_a_time(model: str, input_len: int, output_len: int) -> Callable[[int], float]:
    """The offline engine on `model` (the compiled step, as served), and `generate(tokens)`:
    one random prompt of `input_len` token ids, greedy, `tokens` out, end of sequence
    ignored; it returns the seconds the request took. Every graph is compiled on return."""
    host_memory.keep_host_memory()  # before torch is imported, as the CLI does
    from aioserve import LLM, SamplingParams

    llm = LLM(model=model, seed=0, max_model_len=input_len + output_len + 16)
    rng = random.Random(0)
    vocab = llm.get_tokenizer().vocab_size

    def generate(tokens: int) -> float:
        prompt = {"prompt_token_ids": [rng.randrange(vocab) for _ in range(input_len)]}
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0)
        started = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - started

    generate(8)
    return generate


def main() -> None:
    args = parse_args()
    generate = one_request_at_a_time(args.model, args.input_len, args.output_len)
    from aioserve.runner.model_runner import ModelRunner

    prepare = Timings(ModelRunner, "prepare")
    execute = Timings(ModelRunner, "execute")
    one = statistics.median(generate(1) for _ in range(args.repeats))
    prepare.clear()
    execute.clear()
    many = statistics.median(generate(args.output_len + 1) for _ in range(args.repeats))
    # Decode steps only: the prefills are the slow ones.
    steps = sorted(execute.wall)[: len(execute.wall) - args.repeats]
    per_token = (many - one) / args.output_len
    step = statistics.median(steps)
    print(f"one stream, {args.input_len} in / {args.output_len} out, {args.repeats} runs each")
    print(f"time per output token    {per_token * 1e3:6.2f} ms")
    print(f"model step (median)      {step * 1e3:6.2f} ms")
    print(f"the rest                 {(per_token - step) * 1e3:6.2f} ms")
    print(
        f"preparing a step         {statistics.median(prepare.wall) * 1e6:6.0f} us wall, "
        f"{statistics.median(prepare.cpu) * 1e6:.0f} us CPU"
    )


if __name__ == "__main__":
    main()
