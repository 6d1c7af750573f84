"""`aioserve bench latency`: how long one batch takes from submission to its last token.

As `vllm bench latency`: a batch of `--batch-size` random prompts of `--input-len` tokens,
each generating exactly `--output-len` tokens (temperature 1, EOS ignored), run
`--num-iters-warmup` times untimed, then `--num-iters` times timed. It prints the mean and
standard deviation and the 10/25/50/75/90/99th percentiles of the batch latency, and writes
them with every iteration's latency to --output-json (the standard deviation, line and key,
is aioserve's addition). Prefix caching is off unless asked
for, so every iteration computes its prompts in full.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
from tqdm import tqdm

from aioserve.config.declaration import ConfigError
from aioserve.config.engine import engine_config_from_args
from aioserve.engine.sampling_params import SamplingParams

PERCENTAGES = (10, 25, 50, 75, 90, 99)
# vLLM draws the prompt ids below this bound.
PROMPT_ID_BOUND = 10000


def _check_options(args: argparse.Namespace) -> None:
    for flag, value, minimum in (
        ("--input-len", args.input_len, 1),
        ("--output-len", args.output_len, 1),
        ("--batch-size", args.batch_size, 1),
        ("--n", args.n, 1),
        ("--num-iters-warmup", args.num_iters_warmup, 0),
        ("--num-iters", args.num_iters, 1),
    ):
        if value < minimum:
            raise ConfigError(f"{flag} must be at least {minimum}, got {value}")


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run `bench latency` with parsed arguments; print the figures and return them."""
    from aioserve.engine.llm import LLM

    _check_options(args)
    config = engine_config_from_args(args)
    with LLM.from_config(config) as llm:
        max_model_len = llm.engine.settings.max_model_len
        if args.input_len + args.output_len > max_model_len:
            raise ConfigError(
                f"--input-len + --output-len ({args.input_len + args.output_len}) is more than "
                f"the model's context of {max_model_len}"
            )
        params = SamplingParams(
            n=args.n,
            temperature=1.0,
            top_p=1.0,
            ignore_eos=True,
            max_tokens=args.output_len,
            detokenize=not args.disable_detokenize,
        )
        rng = np.random.default_rng(config.model.seed)
        bound = min(PROMPT_ID_BOUND, llm.engine.hf_config.vocab_size)
        prompts = [
            {"prompt_token_ids": ids}
            for ids in rng.integers(0, bound, size=(args.batch_size, args.input_len)).tolist()
        ]

        def run_batch() -> float:
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - start

        print("Warming up...")
        for _ in tqdm(range(args.num_iters_warmup), desc="Warmup iterations"):
            run_batch()
        latencies = np.array(
            [run_batch() for _ in tqdm(range(args.num_iters), desc="Bench iterations")]
        )
    percentiles = np.percentile(latencies, PERCENTAGES)
    print(f"Avg latency: {np.mean(latencies).item()} seconds")
    print(f"Std latency: {np.std(latencies).item()} seconds")
    for percentage, value in zip(PERCENTAGES, percentiles, strict=True):
        print(f"{percentage}% percentile latency: {value} seconds")
    results = {
        "model_id": config.model.model,
        "avg_latency": np.mean(latencies).item(),
        "std_latency": np.std(latencies).item(),
        "latencies": latencies.tolist(),
        "percentiles": dict(zip(PERCENTAGES, percentiles.tolist(), strict=True)),
    }
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as file:
            json.dump(results, file, indent=4)
    return results
