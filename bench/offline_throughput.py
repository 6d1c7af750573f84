"""Offline generation throughput: aioserve's LLM against transformers' batched generate.

Same workload for both, in the same process run: random prompts of --input-len tokens,
--output-len new tokens each (EOS ignored), --num-prompts prompts, sampling at
temperature 1.0 like `vllm bench throughput`. Prints the figures and, with
--write-results, records them in bench/RESULTS.md.

    python bench/offline_throughput.py --num-prompts 64 --input-len 256 --output-len 128 --write-results
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import random
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).with_name("RESULTS.md")
MARKER = "<!-- offline-throughput -->"


def random_prompts(tokenizer, count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [t for t in range(len(tokenizer)) if t not in special]
    return [[rng.choice(vocab) for _ in range(length)] for _ in range(count)]


def run_aioserve(model: str, prompts, output_len: int, engine_args: dict) -> float:
    from aioserve import LLM, SamplingParams

    with LLM(model=model, **engine_args) as llm:
        params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=output_len, ignore_eos=True)
        llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
    return elapsed


def run_transformers(gguf: Path, prompts, output_len: int, batch_size: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            batch = torch.tensor(prompts[i : i + batch_size])
            out = model.generate(
                batch,
                attention_mask=torch.ones_like(batch),
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                pad_token_id=0,
            )
            assert out.shape[1] == batch.shape[1] + output_len
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-max-batch-size", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--skip-hf", action="store_true", help="measure aioserve only")
    parser.add_argument(
        "--write-results", action="store_true", help="record the figures in bench/RESULTS.md"
    )
    args = parser.parse_args()

    from aioserve.models.checkpoint import open_checkpoint
    from aioserve.models.resolve import DEFAULT_MODEL, resolve_model

    gguf = resolve_model(DEFAULT_MODEL).path
    tokenizer = open_checkpoint(str(gguf)).load_tokenizer()
    prompts = random_prompts(tokenizer, args.num_prompts, args.input_len, seed=0)
    total_tokens = args.num_prompts * (args.input_len + args.output_len)
    output_tokens = args.num_prompts * args.output_len

    engine_args = {"dtype": "float32"}
    if args.max_num_batched_tokens:
        engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    rows = [("aioserve", run_aioserve(str(gguf), prompts, args.output_len, engine_args))]
    gc.collect()
    if not args.skip_hf:
        rows.append(
            (
                "transformers generate",
                run_transformers(gguf, prompts, args.output_len, args.hf_max_batch_size),
            )
        )

    lines = [
        "| engine | seconds | requests/s | total tokens/s | output tokens/s |",
        "|---|---|---|---|---|",
    ]
    for name, seconds in rows:
        lines.append(
            f"| {name} | {seconds:.1f} | {args.num_prompts / seconds:.2f} | {total_tokens / seconds:.0f} | {output_tokens / seconds:.0f} |"
        )
        print(
            f"{name}: Throughput: {args.num_prompts / seconds:.2f} requests/s, "
            f"{total_tokens / seconds:.2f} total tokens/s, {output_tokens / seconds:.2f} output tokens/s"
        )
    if len(rows) == 2:
        print(f"aioserve / transformers: {rows[1][1] / rows[0][1]:.2f}x")
    if args.write_results:
        command = "python bench/offline_throughput.py " + " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in vars(args).items()
            if v not in (None, False, True)
        )
        cpu = platform.processor() or platform.machine()
        section = "\n".join(
            [
                MARKER,
                f"## Offline throughput, {DEFAULT_MODEL} (Q4_1 GGUF dequantized, float32), CPU",
                "",
                f"Measured {datetime.date.today()} on {os.cpu_count()} CPU cores ({cpu}), torch {torch.__version__}, "
                f"random {args.input_len}-token prompts, {args.output_len} new tokens each, {args.num_prompts} prompts, "
                "temperature 1.0, EOS ignored.",
                "",
                f"Command: `{command} --write-results`",
                "",
                *lines,
                MARKER,
            ]
        )
        text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
        if MARKER in text:
            head, _, rest = text.partition(MARKER)
            _, _, tail = rest.partition(MARKER)
            text = head + section + tail
        else:
            text = text.rstrip() + "\n\n" + section + "\n"
        RESULTS.write_text(text)


if __name__ == "__main__":
    main()
