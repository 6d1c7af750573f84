"""The sampler's time for one step of the default model's logits, by sampling settings.

Runs the offline engine (compiled, as served) on --rows random prompts of --input-len
tokens for a few decode steps and keeps the logits of the last step that sampled all of
them (a real model's distributions: their tails decide what top-p costs), then times
`sample` on those rows for each setting, the median of --repeats calls, under inference
mode as the runner samples: eagerly, and with the race the runner compiles
(runner/sampler_graphs.py) where the engine has it.

    python bench/sampler_settings.py
    PYTHONPATH=/path/to/other/checkout python bench/sampler_settings.py   # an A/B
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

import aioserve.runner.model_runner as model_runner
from aioserve import LLM, SamplingParams
from aioserve.kernels.sampling import make_sampling_batch, sample
from aioserve.models.resolve import DEFAULT_MODEL, resolve_model

SETTINGS = {
    "greedy": {"temperature": 0.0},
    "temperature 1": {"temperature": 1.0},
    "temperature 0.7, top-p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "temperature 1, top-p 0.95": {"temperature": 1.0, "top_p": 0.95},
    "temperature 1, min-p 0.05": {"temperature": 1.0, "min_p": 0.05},
    "temperature 1, top-k 50": {"temperature": 1.0, "top_k": 50},
    "temperature 0.8, top-k 50, top-p 0.95": {"temperature": 0.8, "top_k": 50, "top_p": 0.95},
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10)
    return parser.parse_args()


def model_logits(llm: LLM, rows: int, input_len: int) -> torch.Tensor:
    """The logits of a decode step of `rows` random prompts."""
    seen = []
    real = model_runner.sample

    def keeping(logits, batch, *race):
        if logits.shape[0] == rows:
            seen.append(logits.clone())
        return real(logits, batch, *race)

    model_runner.sample = keeping
    try:
        rng = random.Random(0)
        prompts = [
            {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(input_len)]}
            for _ in range(rows)
        ]
        llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False
        )
    finally:
        model_runner.sample = real
    return seen[-1]


def median_ms(call, repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    args = parse_args()
    gguf = resolve_model(DEFAULT_MODEL).path
    with LLM(model=str(gguf), dtype="auto", max_model_len=2048) as llm:
        race = getattr(llm.engine.runner, "race", None)  # None before the compiled race
        logits = model_logits(llm, args.rows, args.input_len)
    # Timed once the engine is closed: its model thread's OpenMP workers, spinning beside
    # this thread's, doubled the eager times.
    print(f"{args.rows} rows of {logits.shape[1]} logits ({logits.dtype}); ms a step:")
    print(f"{'setting':40} {'eager':>8} {'compiled race':>14}")
    with torch.inference_mode():
        for name, setting in SETTINGS.items():
            batch = make_sampling_batch(args.rows, seeds=list(range(args.rows)), **setting)
            eager = median_ms(lambda b=batch: sample(logits, b), args.repeats)
            compiled = (
                f"{median_ms(lambda b=batch: sample(logits, b, race), args.repeats):14.2f}"
                if race is not None
                else f"{'-':>14}"
            )
            print(f"{name:40} {eager:8.2f} {compiled}")


if __name__ == "__main__":
    main()
