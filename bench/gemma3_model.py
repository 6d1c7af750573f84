"""Write a random-weight Gemma 3 checkpoint for side-by-side runs: gemma-3-270m's shape (18
layers, hidden 640, 4 query heads over 1 kv head of 256, local layers with a 512-token
window and RoPE base 10,000, every sixth layer global with base 1,000,000) as transformers
saves it, bfloat16 safetensors, with the tokenizer of a model folder beside it (the peers'
SmolLM2 folder by default: its 49,152-token vocabulary stands in for Gemma's 262,144, which
no package here ships), so that vLLM's client and both servers read the same tokens.

    python bench/gemma3_model.py OUT_FOLDER [--tokenizer-from FOLDER] [--layers 18]

Then, from the checkout: bash bench/side_by_side_checkpoint.sh bench/results/gemma3-NAME OUT_FOLDER
"""

from __future__ import annotations

import argparse
import json

import torch
from moe_model import (  # this script's folder is on sys.path
    add_output_arguments,
    save_with_tokenizer,
)
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

# Every sixth layer global, as gemma-3-270m and gemma-3-1b have them.
GLOBAL_EVERY = 6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_output_arguments(parser)
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--sliding-window", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    source = args.tokenizer_from
    vocab_size = json.loads((source / "config.json").read_text())["vocab_size"]
    layer_types = [
        "full_attention" if (i + 1) % GLOBAL_EVERY == 0 else "sliding_attention"
        for i in range(args.layers)
    ]
    config = Gemma3TextConfig(
        vocab_size=vocab_size,
        hidden_size=640,
        intermediate_size=2048,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=args.sliding_window,
        layer_types=layer_types,
        max_position_embeddings=32768,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        },
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        architectures=["Gemma3ForCausalLM"],
    )
    torch.manual_seed(args.seed)
    model = Gemma3ForCausalLM(config).to(torch.bfloat16)
    save_with_tokenizer(model, args.out, source)
    total = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: {total / 1e6:.0f}M parameters, layers {layer_types}")


if __name__ == "__main__":
    main()
