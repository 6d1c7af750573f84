"""Write a random-weight mixture-of-experts checkpoint for side-by-side runs: a small
Qwen3-MoE (Qwen3-30B-A3B's routing, 64 experts of which each token takes 8, renormalized,
shrunk to SmolLM2's size) as transformers saves it, bfloat16 safetensors, one tensor per
expert, with the tokenizer of a model folder beside it (the peers' SmolLM2 folder by
default), so that vLLM's client and both servers read the same tokens.

    python bench/moe_model.py OUT_FOLDER [--tokenizer-from FOLDER] [--experts 64 --top-k 8]

Then, from the checkout: bash bench/side_by_side_checkpoint.sh bench/results/moe-NAME OUT_FOLDER
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """The output folder, and the model folder whose tokenizer goes beside the weights."""
    parser.add_argument("out", type=Path)
    parser.add_argument(
        "--tokenizer-from",
        type=Path,
        default=Path.home() / ".cache/aioserve-peers/models/SmolLM2-135M-Instruct",
    )


def save_with_tokenizer(model: torch.nn.Module, out: Path, source: Path) -> None:
    """Save `model` as transformers does into `out`, with `source`'s tokenizer files."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, out / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_output_arguments(parser)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--moe-intermediate", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    source = args.tokenizer_from
    vocab_size = json.loads((source / "config.json").read_text())["vocab_size"]
    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.moe_intermediate,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        architectures=["Qwen3MoeForCausalLM"],
    )
    torch.manual_seed(args.seed)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                # Routers far from uniform, so tokens spread over the experts as trained
                # ones do rather than by index order.
                param.normal_(0, 1.0)
    save_with_tokenizer(model, args.out, source)
    total = sum(p.numel() for p in model.parameters())
    print(
        f"wrote {args.out}: {total / 1e6:.0f}M parameters, {config.num_experts} experts, top {config.num_experts_per_tok}"
    )


if __name__ == "__main__":
    main()
