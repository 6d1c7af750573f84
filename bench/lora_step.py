"""What serving LoRA adapters costs on this host: decode time per token, in process.

Runs the offline engine on one model four ways: as served without LoRA (the compiled step
on the CPU), then with --enable-lora for requests of the base model, of one adapter, and
of two adapters in one batch. For each it times greedy decoding of --output-len tokens
after a random prompt of --input-len, at one stream and at --batch streams, the median of
--repeats runs, and prints the time per output token (one stream) and the output tokens a
second (the batch). The adapters are random, of rank --rank on every attention and MLP
projection, written as PEFT folders next to nothing else (no peft needed).

    python bench/lora_step.py
    python bench/lora_step.py --model /path/to/hf-folder --batch 64
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from aioserve import host_memory

PROJECTIONS = {
    "self_attn.q_proj": ("hidden", "q"),
    "self_attn.k_proj": ("hidden", "kv"),
    "self_attn.v_proj": ("hidden", "kv"),
    "self_attn.o_proj": ("q", "hidden"),
    "mlp.gate_proj": ("hidden", "intermediate"),
    "mlp.up_proj": ("hidden", "intermediate"),
    "mlp.down_proj": ("intermediate", "hidden"),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args()


def write_adapter(folder: Path, hf_config, rank: int, seed: int) -> str:
    """A random PEFT adapter of every projection of the model `hf_config` describes."""
    import torch
    from safetensors.torch import save_file

    head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )
    width = {
        "hidden": hf_config.hidden_size,
        "q": hf_config.num_attention_heads * head_dim,
        "kv": hf_config.num_key_value_heads * head_dim,
        "intermediate": hf_config.intermediate_size,
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for module, (into, out) in PROJECTIONS.items():
            name = f"base_model.model.model.layers.{layer}.{module}"
            a = torch.randn(rank, width[into], generator=generator) * 0.02
            b = torch.randn(width[out], rank, generator=generator) * 0.02
            tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"] = a, b
    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    config = {"r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS)}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return str(folder)


def tokens_per_second(llm, loras: list, args: argparse.Namespace, streams: int) -> float:
    """Output tokens a second of `streams` greedy requests at once (median of the runs),
    counting decode steps only: the run of 1 token is taken from the run of output-len."""
    from aioserve import SamplingParams

    rng = random.Random(0)
    vocab = llm.get_tokenizer().vocab_size

    def run(tokens: int) -> float:
        prompts = [
            {"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.input_len)]}
            for _ in range(streams)
        ]
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0)
        lora = [loras[i % len(loras)] for i in range(streams)]
        started = time.perf_counter()
        llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        return time.perf_counter() - started

    run(4)
    one = statistics.median(run(1) for _ in range(args.repeats))
    many = statistics.median(run(args.output_len + 1) for _ in range(args.repeats))
    return streams * args.output_len / (many - one)


def main() -> None:
    args = parse_args()
    host_memory.keep_host_memory()  # before torch is imported, as the CLI does
    from aioserve import LLM, LoRARequest

    max_len = args.input_len + args.output_len + 16
    folder = Path(tempfile.mkdtemp(prefix="lora-step-"))
    streams = (1, args.batch)
    llm = LLM(model=args.model, seed=0, max_model_len=max_len)
    rows = [
        ("no LoRA (compiled step)", *(tokens_per_second(llm, [None], args, s) for s in streams))
    ]
    hf_config = llm.engine.hf_config
    llm.close()
    adapters = [
        LoRARequest(f"a{i}", i, write_adapter(folder / f"a{i}", hf_config, args.rank, i))
        for i in (1, 2)
    ]
    llm = LLM(
        model=args.model,
        seed=0,
        max_model_len=max_len,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=args.rank,
    )
    for name, loras in [
        ("--enable-lora, base model", [None]),
        ("--enable-lora, one adapter", adapters[:1]),
        ("--enable-lora, two adapters", adapters),
    ]:
        rows.append((name, *(tokens_per_second(llm, loras, args, s) for s in streams)))
    llm.close()
    print(f"{args.model}: {args.input_len} in / {args.output_len} out, rank {args.rank}")
    print(f"{'':32} {'1 stream: ms/token':>20} {f'{args.batch} streams: tok/s':>20}")
    for name, one, batch in rows:
        print(f"{name:32} {1e3 / one:20.2f} {batch:20.0f}")


if __name__ == "__main__":
    main()
