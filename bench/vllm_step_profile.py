"""Where real vLLM-CPU's step time goes, to set beside `bench/step_profile.py`'s tables.

Runs vLLM offline in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, so that torch's
profiler sees the model run) on the side-by-side workload: prompts of --input-len random
token ids, then times all-prefill (one output token) and prefill-plus-decode passes, and
prints the profiler's operator tables for one of each. Run it with the peer venv's Python
(../shared/peers/install_vllm_cpu.sh), on an idle host:

    ~/.cache/aioserve-peers/vllm-venv/bin/python bench/vllm_step_profile.py
"""

from __future__ import annotations

import argparse
import os
import random
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    home = os.environ.get("PEERS_HOME", os.path.expanduser("~/.cache/aioserve-peers"))
    parser.add_argument("--model", default=f"{home}/models/SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--profiled-output-len", type=int, default=48)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM, SamplingParams

    # vLLM's API server defaults on a CPU, as `vllm serve` in ../shared/peers/ uses them.
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=2048,
        max_num_batched_tokens=2048,
        max_num_seqs=128,
        seed=0,
    )
    rng = random.Random(0)

    def prompts() -> list[dict]:
        return [
            {"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(args.input_len)]}
            for _ in range(args.num_prompts)
        ]

    def generate(output_len: int) -> None:
        params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)
        llm.generate(prompts(), params, use_tqdm=False)

    generate(8)  # warm-up
    for output_len in (1, args.output_len):
        start = time.perf_counter()
        generate(output_len)
        print(f"output {output_len} tokens a prompt: {time.perf_counter() - start:.2f} s")
    for output_len in (1, args.profiled_output_len):
        with torch.profiler.profile() as profile:
            generate(output_len)
        table = profile.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=16, max_name_column_width=48
        )
        print(f"\noutput {output_len} tokens a prompt, by operator:\n{table}")


if __name__ == "__main__":
    main()
