"""What keying prefix-cache blocks costs the host, per --prefix-caching-hash-algo.

Times `KVCacheManager.update_block_hashes` over fresh requests (every block hashed anew,
as for a prompt that enters the engine) with blocks of `--block-size` tokens, and reports
microseconds a block and milliseconds a step of `--step-tokens` prompt tokens: the host
work the hashing adds to a prefill step. Run: python bench/block_hashing.py
"""

from __future__ import annotations

import argparse
import random
import time

from aioserve.engine.block_hashing import HASH_ALGORITHMS
from aioserve.engine.kv_cache_manager import KVCacheManager
from aioserve.engine.request import Request
from aioserve.engine.sampling_params import SamplingParams


def _prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def microseconds_a_block(algorithm: str, prompts: list[list[int]], block_size: int) -> float:
    kv = KVCacheManager(1, block_size, enable_prefix_caching=True, hash_algorithm=algorithm)
    requests = [
        Request(
            request_id=str(i),
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(),
            seed=0,
            eos_token_ids=frozenset(),
            max_tokens=1,
        )
        for i, prompt in enumerate(prompts)
    ]
    started = time.perf_counter()
    for request in requests:
        kv.update_block_hashes(request)
    elapsed = time.perf_counter() - started
    blocks = sum(len(r.block_hashes) for r in requests)
    return elapsed / blocks * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--step-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    prompts = _prompts(args.prompts, args.prompt_len, 49152)
    blocks_a_step = args.step_tokens / args.block_size
    print(f"blocks of {args.block_size} tokens; a step of {args.step_tokens} prompt tokens")
    for algorithm in HASH_ALGORITHMS:
        best = min(
            microseconds_a_block(algorithm, prompts, args.block_size) for _ in range(args.repeats)
        )
        print(
            f"{algorithm:>18}: {best:7.2f} us a block, {best * blocks_a_step / 1e3:6.3f} ms a step"
        )


if __name__ == "__main__":
    main()
