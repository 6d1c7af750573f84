"""The Gemma family: GemmaForCausalLM (Gemma 1) and Gemma3ForCausalLM (Gemma 3's text-only
models, gemma-3-270m and gemma-3-1b; the larger ones are Gemma3ForConditionalGeneration).

Llama's decoder (models/llama.py: its attention's shapes, the stacked qkv_proj and
gate_up_proj, its loading and output head) with Gemma's differences, as transformers 5 and
vLLM compute them:

- the embeddings are scaled by sqrt(hidden_size), that factor first rounded to the model's
  dtype (55.4256 becomes 55.5 in bfloat16); the tied output head is not scaled;
- RMSNorm multiplies by (1 + weight) in float32. The checkpoint holds `weight`; the model
  holds 1 + weight in float32, added at load (`load_weights`), so that kernels/rms_norm.py
  runs unchanged and float32 gives transformers' values exactly. In 16 bits the kernel
  rounds the normalized row to the model's dtype before multiplying by the weight, as
  Llama's norm does, where Gemma's rounds once after: bfloat16 is close, not bit-equal;
- the MLP gates with GELU's tanh approximation (`gelu_pytorch_tanh`,
  kernels/activation.py `gelu_tanh_and_mul`) where Llama's uses SiLU.

Gemma 3 adds, per layer: q and k normalized head by head (Gemma's norm), scores scaled by
query_pre_attn_scalar ** -0.5 rather than head_dim ** -0.5, the sandwich norms (what
attention and the MLP output is normalized again before its residual add), a sliding
window on the layers `layer_types` marks "sliding_attention" (models/sliding_windows.py),
and RoPE per layer type: `rope_parameters` holds one base and scaling per type (the local
layers' base 10,000, the global ones' 1,000,000, linearly scaled by 8 on the 4B and larger),
so each type gets its own cos/sin table and each layer its type's.

Refused at load, by name: attention or final logit soft-capping (Gemma 2's; null in these
configs), bidirectional attention (EmbeddingGemma), activations other than GELU-tanh.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from aioserve.kernels.activation import gelu_tanh_and_mul
from aioserve.kernels.rotary import build_cos_sin_cache
from aioserve.models.linear import Embedding, Linear
from aioserve.models.llama import Attention, LlamaForCausalLM, RMSNorm, _head_dim
from aioserve.models.rope_parameters import (
    layer_type_rope,
    rotary_table_length,
    scaled_context_length,
)

GELU_TANH = "gelu_pytorch_tanh"


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w): its `weight` holds 1 + w in float32 (GemmaForCausalLM adds the
    1 at load), whatever the model's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        nn.Module.__init__(self)
        self.weight = nn.Parameter(torch.empty(size, dtype=torch.float32))
        self.eps = eps


class GemmaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * size, bias=False)
        self.down_proj = Linear(size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class Gemma3Attention(Attention):
    """Llama's attention (its sliding window included) with q and k normalized per head by
    Gemma's norm and the scores scaled by query_pre_attn_scalar ** -0.5."""

    def __init__(
        self, config: PretrainedConfig, cos_sin_cache: torch.Tensor, layer_index: int
    ) -> None:
        super().__init__(config, cos_sin_cache, layer_index)
        self.scale = float(config.query_pre_attn_scalar) ** -0.5
        self.qk_norm = True
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)


class GemmaDecoderLayer(nn.Module):
    """Gemma 1's layer: Llama's, with Gemma's norms and MLP."""

    def __init__(
        self, config: PretrainedConfig, cos_sin_cache: torch.Tensor, layer_index: int
    ) -> None:
        super().__init__()
        self.self_attn = Attention(config, cos_sin_cache, layer_index)
        self.mlp = GemmaMLP(config)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Gemma3DecoderLayer(nn.Module):
    """Gemma 3's layer: attention and the MLP each between two norms, the second one's
    output added to the residual stream (by the next norm's fused add)."""

    def __init__(
        self,
        config: PretrainedConfig,
        cos_sin_cache: torch.Tensor,
        layer_index: int,
    ) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(config, cos_sin_cache, layer_index)
        self.mlp = GemmaMLP(config)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # transformers: h = residual + post_attention_layernorm(attn(input_layernorm(residual)))
        # then h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h))).
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 1. Llama's loading (q/k/v and gate/up stacked, `parameter_for`), output head
    (`compute_logits`, tied or not) and KV-cache scales; its own layers and embedding scale."""

    def __init__(self, config: PretrainedConfig) -> None:
        nn.Module.__init__(self)
        _refuse_unsupported(config)
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        # sqrt(hidden_size) rounded to the model's dtype, as transformers and vLLM round it.
        self.embed_scale = torch.tensor(
            config.hidden_size**0.5, dtype=self.embed_tokens.weight.dtype
        ).item()
        self.layers = self._build_layers(config)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        # What LlamaForCausalLM's compute_logits and loading read.
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.logits_scaling = 1.0
        self.embedding_multiplier = 1.0  # the scale is in `embed`
        self.register_buffer("head_row_weight", None, persistent=False)
        self.register_buffer("head_packed_weight", None, persistent=False)
        self.kv_scales = torch.ones((config.num_hidden_layers, 2), dtype=torch.float32)
        self.kv_scales_loaded = False

    def _build_layers(self, config: PretrainedConfig) -> nn.ModuleList:
        # float32 whatever the model's dtype, not a buffer (LlamaForCausalLM says why).
        table = _cos_sin_cache(config, "full_attention")
        return nn.ModuleList(
            GemmaDecoderLayer(config, table, i) for i in range(config.num_hidden_layers)
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The scaled embeddings of `input_ids`: the first layer's input, and what rows
        given as embeddings replace, as vLLM's Gemma takes them."""
        return self.embed_tokens(input_ids) * self.embed_scale

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """LlamaForCausalLM's, each norm's weight w held as 1 + w in float32."""
        return super().load_weights(
            (name, tensor.float() + 1.0 if name.endswith("norm.weight") else tensor)
            for name, tensor in weights
        )


class Gemma3ForCausalLM(GemmaForCausalLM):
    """Gemma 3's text-only models: one RoPE table per layer type, a window per layer."""

    def _build_layers(self, config: PretrainedConfig) -> nn.ModuleList:
        count = config.num_hidden_layers
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * count
        tables = {kind: _cos_sin_cache(config, kind) for kind in sorted(set(layer_types))}
        return nn.ModuleList(
            Gemma3DecoderLayer(config, tables[kind], i) for i, kind in enumerate(layer_types)
        )


def _cos_sin_cache(config: PretrainedConfig, layer_type: str) -> torch.Tensor:
    """The float32 cos/sin table of the config's layers of `layer_type`."""
    theta, scaling = layer_type_rope(config, layer_type)
    return build_cos_sin_cache(
        _head_dim(config),
        rotary_table_length(config),
        theta,
        scaling,
        dtype=torch.float32,
        scaling_length=scaled_context_length(config),
    )


def _refuse_unsupported(config: PretrainedConfig) -> None:
    """ValueError, naming the key, for what a Gemma config may ask and aioserve does not do."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, key, None) is not None:
            raise ValueError(
                f"{key}={getattr(config, key)} (logit soft-capping, Gemma 2's) is not "
                "supported: aioserve serves Gemma and Gemma 3 configs, which leave it null"
            )
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(
            "use_bidirectional_attention=True (EmbeddingGemma's) is not supported: "
            "aioserve's Gemma models attend causally"
        )
    # Gemma's first configs said hidden_act "gelu" meaning the tanh approximation, as
    # transformers 5 and vLLM read it; Gemma 3's name it in hidden_activation.
    activation = getattr(config, "hidden_activation", None)
    if activation is None:
        activation = getattr(config, "hidden_act", None) or GELU_TANH
        activation = GELU_TANH if activation == "gelu" else activation
    if activation != GELU_TANH:
        raise ValueError(
            f"unsupported activation {activation!r}: Gemma's MLP implements {GELU_TANH} only"
        )
