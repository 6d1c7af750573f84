"""What the Transformers modeling backend (--model-impl transformers) costs against aioserve's
own model code, in process, on the same weights.

Builds (once, under --folder) a random-weight Llama of SmolLM2-135M's shape with SmolLM2's
tokenizer, then runs the offline engine on it both ways, alternated --rounds times: a batch
of --num-prompts random prompts of --input-len tokens, --output-len tokens each (greedy,
ignore_eos), and a single prompt at one stream. Prints each run's output tokens/s and the
medians; the backend always runs eagerly, aioserve's own code as served (compiled on the
CPU) unless --enforce-eager compares eager with eager.

    python bench/transformers_backend.py
    python bench/transformers_backend.py --enforce-eager
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default="/tmp/aioserve-bench-smollm2-shaped")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--enforce-eager", action="store_true")
    return parser.parse_args()


def smollm2_shaped_config(vocab_size: int):
    """SmolLM2-135M's Llama config (bench/image_requests.py builds its decoder from it)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
    )


def smollm2_shaped_folder(folder: Path) -> str:
    """A random Llama with SmolLM2-135M's config and tokenizer, saved once."""
    if (folder / "config.json").is_file():
        return str(folder)
    import torch
    from transformers import LlamaForCausalLM

    from aioserve.models.checkpoint import open_checkpoint
    from aioserve.models.resolve import DEFAULT_MODEL, resolve_model

    tokenizer = open_checkpoint(str(resolve_model(DEFAULT_MODEL).path)).load_tokenizer()
    config = smollm2_shaped_config(len(tokenizer))
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def run(folder: str, impl: str, args: argparse.Namespace) -> tuple[float, float]:
    """(batch output tok/s, one-stream output tok/s) of one engine."""
    from aioserve import LLM, SamplingParams

    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(args.input_len)]}
        for _ in range(args.num_prompts)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    with LLM(
        folder,
        dtype=args.dtype,
        model_impl=impl,
        max_model_len=args.input_len + args.output_len,
        enforce_eager=args.enforce_eager,
    ) as llm:
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        batch = args.num_prompts * args.output_len / (time.perf_counter() - started)
        started = time.perf_counter()
        llm.generate(prompts[:1], params, use_tqdm=False)
        single = args.output_len / (time.perf_counter() - started)
    return batch, single


def main() -> None:
    args = parse_args()
    folder = smollm2_shaped_folder(Path(args.folder))
    results: dict[str, list[tuple[float, float]]] = {"vllm": [], "transformers": []}
    for round_index in range(args.rounds):
        order = ("vllm", "transformers") if round_index % 2 == 0 else ("transformers", "vllm")
        for impl in order:
            batch, single = run(folder, impl, args)
            results[impl].append((batch, single))
            print(
                f"round {round_index + 1} {impl:12s} batch {batch:8.1f} tok/s, one stream {single:6.1f} tok/s"
            )
    for impl, runs in results.items():
        batch = statistics.median(r[0] for r in runs)
        single = statistics.median(r[1] for r in runs)
        print(f"median {impl:12s} batch {batch:8.1f} tok/s, one stream {single:6.1f} tok/s")


if __name__ == "__main__":
    main()
