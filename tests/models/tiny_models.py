"""Tiny random-weight configs of each supported architecture, and a harness that runs our
model over the paged KV cache step by step, for parity tests against transformers; a
tiny BERT encoder (`tiny_bert_config`) apart, as it runs without a KV cache."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    BertConfig,
    Gemma3TextConfig,
    GemmaConfig,
    GraniteConfig,
    GraniteMoeConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OlmoeConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    RobertaConfig,
    SmolLM3Config,
    XLMRobertaConfig,
)

from aioserve.models.attention_metadata import AttentionMetadata
from aioserve.models.registry import model_class_for
from aioserve.models.step_context import step_context
from aioserve.runner.kv_memory import kv_cache_shape

COMMON = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=8,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)

# The engine tests' tiny Llama (`tiny_llama_config`): quick to build, load and compile.
_TINY_LLAMA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    architectures=["LlamaForCausalLM"],
)


def tiny_llama_config(**fields) -> LlamaConfig:
    """A 2-layer Llama of width 64 (4 heads, 2 KV heads) over 256 tokens and 256 positions,
    with `fields` changed."""
    return LlamaConfig(**{**_TINY_LLAMA, **fields})


def save_tiny_model(config: PretrainedConfig, folder, seed: int = 0):
    """`config`'s model with seeded random weights, saved as a Hugging Face folder."""
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


# Granite's four multipliers, none of them 1, so that each one's omission shows.
GRANITE_MULTIPLIERS = dict(
    embedding_multiplier=6.0, residual_multiplier=0.3, attention_multiplier=0.2, logits_scaling=4.0
)


def tiny_configs() -> dict[str, object]:
    return {
        "llama-gqa4-llama3-rope": LlamaConfig(
            **COMMON,
            num_key_value_heads=2,
            head_dim=16,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            architectures=["LlamaForCausalLM"],
        ),
        "mistral": MistralConfig(
            **COMMON,
            num_key_value_heads=4,
            head_dim=16,
            sliding_window=None,
            architectures=["MistralForCausalLM"],
        ),
        "qwen2-tied": Qwen2Config(
            **COMMON,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            architectures=["Qwen2ForCausalLM"],
        ),
        # Qwen2.5's long-context form: YaRN over a quarter of the trained context.
        "qwen2-yarn": Qwen2Config(
            **COMMON,
            num_key_value_heads=2,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            architectures=["Qwen2ForCausalLM"],
        ),
        "qwen3": Qwen3Config(
            **COMMON, num_key_value_heads=2, head_dim=32, architectures=["Qwen3ForCausalLM"]
        ),
        # Sliding windows narrower than the parity sequences: Mistral v0.1's over every
        # layer, Qwen2's over the layers past max_window_layers.
        "mistral-window": MistralConfig(
            **COMMON,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=5,
            architectures=["MistralForCausalLM"],
        ),
        "qwen2-window": Qwen2Config(
            **COMMON,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=3,
            max_window_layers=1,
            architectures=["Qwen2ForCausalLM"],
        ),
        "phi3-longrope": tiny_phi3_config(),
        "granite": GraniteConfig(
            **COMMON,
            **GRANITE_MULTIPLIERS,
            num_key_value_heads=2,
            architectures=["GraniteForCausalLM"],
        ),
        # SmolLM3: no rotary embedding in every second layer here (every fourth in the
        # released model), a tied head.
        "smollm3-nope": SmolLM3Config(
            **COMMON,
            num_key_value_heads=2,
            no_rope_layer_interval=2,
            tie_word_embeddings=True,
            pad_token_id=0,
            architectures=["SmolLM3ForCausalLM"],
        ),
        **tiny_gemma_configs(),
        **tiny_moe_configs(),
    }


def tiny_gemma_configs(window: int = 6) -> dict[str, PretrainedConfig]:
    """Gemma (a head size not hidden / heads, GELU-tanh, norms times 1 + weight, scaled
    embeddings, a tied head) and Gemma 3: besides, q/k norms, query_pre_attn_scalar not
    the head size, sandwich norms, a sliding window of `window` on the first of its two
    layers (the parity schedule's sequences are longer than 6), and each layer type's RoPE:
    the local layer's base 10,000, the global one's 1,000,000 linearly scaled by 8."""
    return {
        "gemma": GemmaConfig(
            **COMMON,
            num_key_value_heads=2,
            head_dim=32,
            hidden_act="gelu_pytorch_tanh",
            architectures=["GemmaForCausalLM"],
        ),
        "gemma3": Gemma3TextConfig(
            **COMMON,
            num_key_value_heads=2,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=window,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            },
            architectures=["Gemma3ForCausalLM"],
        ),
    }


def tiny_phi3_config(original_context: int = 64) -> Phi3Config:
    """Phi-4-mini's form: LongRoPE (its context stretched 4x past `original_context`, so
    that the attention factor is not 1), partial rotary (12 of 16 dimensions), a tied head.
    The factors differ dimension by dimension, short from long."""
    return Phi3Config(
        **{**COMMON, "max_position_embeddings": 4 * original_context},
        num_key_value_heads=2,
        partial_rotary_factor=0.75,
        original_max_position_embeddings=original_context,
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0, 1.1, 1.3, 1.7, 2.2, 3.0],
            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0],
        },
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        architectures=["Phi3ForCausalLM"],
    )


def tiny_moe_configs() -> dict[str, PretrainedConfig]:
    """The mixture-of-experts architectures: every layer sparse (Mixtral: renormalized top-2
    of 4; Qwen3-MoE: top-2 of 8, renormalized), or a sparse layer with a shared expert, not
    renormalized, beside a dense one (Qwen2-MoE)."""
    return {
        "mixtral": MixtralConfig(
            **COMMON,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=None,
            architectures=["MixtralForCausalLM"],
        ),
        "qwen2-moe": Qwen2MoeConfig(
            **COMMON,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=96,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            architectures=["Qwen2MoeForCausalLM"],
        ),
        "granite-moe": GraniteMoeConfig(
            **{**COMMON, "intermediate_size": 64},
            num_key_value_heads=2,
            **GRANITE_MULTIPLIERS,
            num_local_experts=4,
            num_experts_per_tok=2,
            tie_word_embeddings=True,
            architectures=["GraniteMoeForCausalLM"],
        ),
        # OLMoE: q and k normalized whole, not renormalized, q/k/v bounded by clip_qkv.
        "olmoe": OlmoeConfig(
            **{**COMMON, "intermediate_size": 64},
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
            clip_qkv=1.5,
            pad_token_id=0,
            architectures=["OlmoeForCausalLM"],
        ),
        "qwen3-moe": Qwen3MoeConfig(
            **COMMON,
            num_key_value_heads=2,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            norm_topk_prob=True,
            architectures=["Qwen3MoeForCausalLM"],
        ),
    }


def hf_and_ours(config, dtype: torch.dtype = torch.float32, seed: int = 0, device: str = "cpu"):
    """A transformers model with random weights (float32) and ours with the same weights."""
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # Random norms too, so that a norm-weight mix-up cannot hide behind all-ones weights.
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif "bias" in name:
                param.normal_(0, 0.1)
            elif name.endswith("mlp.gate.weight"):
                # A MoE router: logits far apart, so that no token's choice of experts
                # hangs on a near tie that rounding could tip either way.
                param.normal_(0, 1.0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            ours = model_class_for(config)(config)
    finally:
        torch.set_default_dtype(previous)
    ours.load_weights(hf.state_dict().items())
    return hf, ours.eval()


@dataclass
class PagedRunner:
    """Drives our model over shuffled physical blocks, one flat mixed batch per step."""

    model: torch.nn.Module
    block_size: int = 4
    num_blocks: int = 64
    dtype: torch.dtype = torch.float32
    tables: dict[int, list[int]] = field(default_factory=dict)
    lengths: dict[int, int] = field(default_factory=dict)

    def __post_init__(self):
        shape = kv_cache_shape(self.model.config, self.num_blocks, self.block_size)
        self.kv = [
            (torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype))
            for _ in range(self.model.config.num_hidden_layers)
        ]
        self.free = list(range(self.num_blocks))
        random.Random(0).shuffle(self.free)

    @torch.inference_mode()
    def step(self, chunks: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Run one step: (sequence id, new tokens) per sequence; logits of every row."""
        ids, positions, slots, starts, seq_lens, tables = [], [], [], [0], [], []
        for seq, tokens in chunks:
            start = self.lengths.get(seq, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            for pos in range(start, end):
                positions.append(pos)
                slots.append(
                    table[pos // self.block_size] * self.block_size + pos % self.block_size
                )
            ids += tokens
            starts.append(starts[-1] + len(tokens))
            seq_lens.append(end)
            self.lengths[seq] = end
            tables.append(table)
        width = max(len(t) for t in tables)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(
                [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32
            ),
            max_query_len=max(len(t) for _, t in chunks),
            max_seq_len=max(seq_lens),
        )
        with step_context(meta, self.kv):
            hidden = self.model(torch.tensor(ids), torch.tensor(positions))
        return self.model.compute_logits(hidden)


def tiny_bert_config() -> BertConfig:
    """A tiny random BERT encoder (BertModel): 2 heads of 32 (MiniLM's head size), 2 layers."""
    return BertConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=128,
        type_vocab_size=2,
        layer_norm_eps=1e-12,
        hidden_act="gelu",
        architectures=["BertModel"],
    )


def tiny_roberta_config(architecture: str = "RobertaModel") -> PretrainedConfig:
    """A tiny random RoBERTa (or, with "XLMRobertaModel", XLM-R) encoder: BERT's shape, one
    token type, positions from pad_token_id + 1."""
    config_class = XLMRobertaConfig if architecture == "XLMRobertaModel" else RobertaConfig
    fields = tiny_bert_config().to_dict()
    fields.update(type_vocab_size=1, pad_token_id=1, max_position_embeddings=130)
    fields.update(architectures=[architecture])
    for key in ("model_type", "transformers_version"):
        fields.pop(key, None)
    return config_class(**fields)


def hf_bert_and_ours(config: PretrainedConfig, dtype: torch.dtype = torch.float32, seed: int = 0):
    """transformers' encoder of the config (BertModel, RobertaModel, ...) with random
    weights (float32, its pooler included) and ours with the same weights, in `dtype`."""
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    hf = AutoModel.from_config(config).eval()
    with torch.no_grad():  # random norms and biases too, so that a mix-up cannot hide
        for name, param in hf.named_parameters():
            if "LayerNorm.weight" in name:
                param.uniform_(0.5, 1.5)
            elif "bias" in name:
                param.normal_(0, 0.1)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        ours = model_class_for(config)(config)
    finally:
        torch.set_default_dtype(previous)
    ours.load_weights(hf.state_dict().items())
    return hf, ours.eval()
