"""Two revisions of a tiny random Llama for the hub tests (tests/models/fake_hub.py): each
with SmolLM2's tokenizer and a chat template naming its revision, and transformers' greedy
tokens on a revision's folder, the reference of what the engine serves from it."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

REPO = "org/tiny"
TOKEN = "hf_fake_secret_4f2a"
PROMPT = [1, 504, 3458, 282, 4649, 314]
NEW_TOKENS = 6


def tiny_revision(tokenizer, folder: Path, seed: int, marker: str) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer, whose chat template says `marker`."""
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(marker + "{{ messages[0]['content'] }}")
    return folder


def greedy_reference(folder: Path) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(PROMPT) :].tolist()
