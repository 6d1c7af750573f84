"""A tiny model for the benchmarks' end-to-end runs: SmolLM2's tokenizer on a two-layer Llama.

The weights are random (seeded) and saved as safetensors, so both aioserve and
transformers load it in a second; the tokenizer is the real one, so dataset lengths are
measured with what the default model uses.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


@pytest.fixture(scope="session")
def tiny_model(smollm2_gguf, tmp_path_factory) -> str:
    """Folder of a tiny random-weight Llama with SmolLM2-135M-Instruct's tokenizer."""
    from aioserve.models.checkpoint import open_checkpoint

    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = open_checkpoint(str(smollm2_gguf)).load_tokenizer()
    tokenizer.save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)
