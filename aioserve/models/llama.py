"""The Llama family: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
Phi3ForCausalLM, SmolLM3ForCausalLM, GraniteForCausalLM, and the mixture-of-experts kin
MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, GraniteMoeForCausalLM,
OlmoeForCausalLM.

They share one decoder: RMSNorm, rotary embeddings (scaled as the config says, over the
first `partial_rotary_factor` of each head), grouped-query attention over the paged KV
cache, and a SiLU-gated MLP, or in the MoE models' sparse layers a sparse MoE block
(models/moe.py). The differences are switches read from the HF config: Qwen2 (and
Qwen2-MoE) has biases on q/k/v, Qwen3 (and Qwen3-MoE) normalizes each head of q and k,
OLMoE all of q and all of k (and may bound q, k and v by its clip_qkv),
SmolLM3 leaves out the rotary embedding in the layers its `no_rope_layers` marks 0,
Granite (and GraniteMoe) scales the embeddings, what each layer adds to the residual
stream, the attention scores and the logits by its multipliers, and any of them may tie
the output head to the input embeddings.

Parameter names follow the HF checkpoints, except that q/k/v are stacked into one `qkv_proj`
and gate/up into one `gate_up_proj` (one matmul each; Phi-3's checkpoints hold them so
already), Mixtral's `block_sparse_moe` is named `mlp` as Qwen-MoE's is, and the experts'
tensors are stacked into `w13` / `w2` (models/moe.py); `load_weights` does the stacking.
A checkpoint's fp8 KV-cache scales (`model.layers.N.self_attn.k_scale` / `v_scale`) land in
`kv_scales`, [layers, 2] float32 (k, v), 1.0 where it has none; they scale the KV cache
only when it is fp8 (runner/kv_memory.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from aioserve.kernels.activation import silu_and_mul
from aioserve.kernels.rms_norm import rms_norm
from aioserve.kernels.rotary import build_cos_sin_cache
from aioserve.models.linear import Embedding, Linear, dense
from aioserve.models.moe import ExpertWeightCopy, SparseMoeBlock, is_sparse_layer
from aioserve.models.paged_attention_op import rotate_and_attend
from aioserve.models.prompt_embeds import PromptEmbeds, with_prompt_embeds
from aioserve.models.rope_parameters import (
    rope_scaling,
    rope_theta,
    rotary_table_length,
    scaled_context_length,
)
from aioserve.models.sliding_windows import layer_sliding_windows
from aioserve.models.weight_copy import copy_hf_weights


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, self.weight, self.eps, residual)


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Attention(nn.Module):
    def __init__(
        self, config: PretrainedConfig, cos_sin_cache: torch.Tensor, layer_index: int
    ) -> None:
        super().__init__()
        self.layer_index = layer_index  # which of the step's KV caches is this layer's
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = _head_dim(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Granite scales the scores by its attention_multiplier instead.
        multiplier = getattr(config, "attention_multiplier", None)
        self.scale = self.head_dim**-0.5 if multiplier is None else float(multiplier)
        # Qwen2 always has q/k/v biases; Llama-style configs may ask for them (and for an
        # o_proj bias) with attention_bias.
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = (
            attention_bias
            or config.model_type == "qwen2"
            or (config.model_type == "qwen2_moe" and getattr(config, "qkv_bias", True))
        )
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=attention_bias)
        # Qwen3 normalizes each head of q and k; OLMoE all of q, and all of k, at once.
        self.qk_norm = config.model_type in ("qwen3", "qwen3_moe")
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm_whole = config.model_type == "olmoe"
        if self.qk_norm_whole:
            self.q_norm = RMSNorm(self.q_size, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.kv_size, config.rms_norm_eps)
        # OLMoE's optional bound on every q, k and v value (None: none).
        self.clip_qkv = getattr(config, "clip_qkv", None)
        self.cos_sin_cache = cos_sin_cache
        # Mistral v0.1's and Phi-3-mini's window over every layer, Qwen2's over some: the
        # positions a row sees through its own (0: all of them).
        self.sliding_window = layer_sliding_windows(config)[layer_index]

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm_whole:
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        if self.clip_qkv is not None:
            bound = self.clip_qkv
            q, k, v = q.clamp(-bound, bound), k.clamp(-bound, bound), v.clamp(-bound, bound)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view_as(q)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view_as(k)
        out = rotate_and_attend(
            positions,
            q,
            k,
            v,
            self.cos_sin_cache,
            True,
            self.layer_index,
            self.scale,
            self.sliding_window,
        )
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(
                f"unsupported activation {config.hidden_act!r}: only silu is implemented"
            )
        if getattr(config, "mlp_bias", False):
            raise ValueError("MLP biases (mlp_bias=True) are not supported yet")
        intermediate_size = intermediate_size or config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self, config: PretrainedConfig, cos_sin_cache: torch.Tensor, layer_index: int
    ) -> None:
        super().__init__()
        self.self_attn = Attention(config, cos_sin_cache, layer_index)
        self.mlp = _feed_forward(config, layer_index)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Granite scales what attention and the MLP add to the residual stream.
        self.residual_multiplier = float(getattr(config, "residual_multiplier", 1.0))

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        if self.residual_multiplier != 1.0:
            hidden = hidden * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        hidden = self.mlp(hidden)
        if self.residual_multiplier != 1.0:
            hidden = hidden * self.residual_multiplier
        return hidden, residual


def _feed_forward(config: PretrainedConfig, layer_index: int) -> nn.Module:
    """A layer's MLP: dense, or a sparse MoE block (with Qwen2-MoE's shared expert)."""
    if not is_sparse_layer(config, layer_index):
        return MLP(config)
    shared_size = getattr(config, "shared_expert_intermediate_size", 0)
    return SparseMoeBlock(config, MLP(config, shared_size) if shared_size else None)


class LlamaForCausalLM(nn.Module):
    # HF checkpoint name fragment -> (our stacked parameter, index of the shard in it)
    stacked_params = {
        ".q_proj.": (".qkv_proj.", 0),
        ".k_proj.": (".qkv_proj.", 1),
        ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        head_dim = _head_dim(config)
        rotary_dim = int(head_dim * getattr(config, "partial_rotary_factor", 1.0))
        # float32 whatever the model's dtype, on the device the model is built on (the
        # loader builds it under a torch.device context); not a buffer, so .to(dtype)
        # cannot round it.
        cos_sin_cache = build_cos_sin_cache(
            rotary_dim,
            rotary_table_length(config),
            rope_theta(config),
            rope_scaling(config),
            dtype=torch.float32,
            scaling_length=scaled_context_length(config),
        )
        tables = [cos_sin_cache] * config.num_hidden_layers
        rotates = getattr(config, "no_rope_layers", None) or [1] * config.num_hidden_layers
        if not all(rotates):
            # SmolLM3's layers without rotary embedding rotate by angle 0 (cos 1, sin 0,
            # which leaves every value as it is, bit for bit): the others' code and graph.
            half = rotary_dim // 2
            cos, sin = cos_sin_cache[:, :half], cos_sin_cache[:, half:]
            no_rotation = torch.cat((torch.ones_like(cos), torch.zeros_like(sin)), dim=-1)
            tables = [table if rotates[i] else no_rotation for i, table in enumerate(tables)]
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, table, i) for i, table in enumerate(tables)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # Granite's: the embeddings scaled up, the logits divided down.
        self.embedding_multiplier = float(getattr(config, "embedding_multiplier", 1.0))
        self.logits_scaling = float(getattr(config, "logits_scaling", 1.0))
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        # The tied head's narrow copy for single-row products (linear.keep_row_weights),
        # and its copy in oneDNN's layout (linear.pack_weights).
        self.register_buffer("head_row_weight", None, persistent=False)
        self.register_buffer("head_packed_weight", None, persistent=False)
        # Not buffers: they are not weights, and stay float32 whatever the model's dtype.
        self.kv_scales = torch.ones((config.num_hidden_layers, 2), dtype=torch.float32)
        self.kv_scales_loaded = False

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of `input_ids`, where rows given as embeddings go (before the
        embedding multiplier, as vLLM's Granite takes them)."""
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        embeds: PromptEmbeds | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of the step's flat batch of tokens, the rows of
        `embeds` embedded as given (models/prompt_embeds.py).

        Run it inside `step_context(meta, kv_caches)`: each layer's attention writes to and
        reads from that step's KV caches.
        """
        hidden = with_prompt_embeds(self.embed(input_ids), embeds)
        if self.embedding_multiplier != 1.0:
            hidden = hidden * self.embedding_multiplier
        # Zeros, not None, so that every layer runs the same code: the first layer's
        # residual add then changes nothing, and one compiled layer serves all of them.
        residual = torch.zeros_like(hidden)
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tie_word_embeddings:
            table = self.embed_tokens.weight
            logits = dense(
                hidden,
                table,
                # The table itself where it has no narrower copy: a single row reads it
                # rather than the packed copy (linear.dense).
                row_weight=table if self.head_row_weight is None else self.head_row_weight,
                packed_weight=self.head_packed_weight,
            ).float()
        else:
            logits = self.lm_head(hidden).float()
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the parameters (models/weight_copy.py), the KV-cache
        scales and the experts' tensors aside; returns the parameter names filled."""
        experts = ExpertWeightCopy(self)
        loaded = copy_hf_weights(
            self,
            (
                (name, t)
                for name, t in weights
                if not self._load_kv_scale(name, t) and not experts.copy(name, t)
            ),
        )
        return loaded | experts.complete()

    def _load_kv_scale(self, hf_name: str, tensor: torch.Tensor) -> bool:
        """Whether `hf_name` is a layer's k_scale/v_scale, then kept in kv_scales."""
        match = _KV_SCALE_NAME.fullmatch(hf_name)
        if match is None:
            return False
        if tensor.numel() != 1:
            raise ValueError(f"{hf_name} holds {tensor.numel()} values; one per layer is supported")
        layer, kind = int(match["layer"]), match["kind"]
        self.kv_scales[layer, 0 if kind == "k" else 1] = float(tensor.float().reshape(()))
        self.kv_scales_loaded = True
        return True

    def parameter_for(self, hf_name: str) -> tuple[str, int | None] | None:
        """(our parameter name, index of the shard in it or None) of an HF checkpoint tensor;
        None for a tensor the model does not take (rotary tables, a tied head's copy)."""
        name = hf_name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
        # The experts stacked as transformers 5 holds them in memory (its checkpoints keep
        # one tensor an expert, ExpertWeightCopy's): our w13 / w2 already.
        name = name.replace(".experts.gate_up_proj", ".w13").replace(".experts.down_proj", ".w2")
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        for fragment, (stacked, shard) in self.stacked_params.items():
            if fragment in name:
                return name.replace(fragment, stacked), shard
        return name, None

    def shard_rows(self, name: str, shard: int) -> tuple[int, int]:
        """(first row, row count) of shard `shard` of the stacked parameter `name`."""
        if ".qkv_proj." in name:
            attn = self.layers[0].self_attn
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:  # a gate_up_proj: a dense layer's, or a Qwen2-MoE shared expert's
            sizes = [self.get_submodule(name.rsplit(".", 1)[0]).out_features // 2] * 2
        return sum(sizes[:shard]), sizes[shard]

    def shard_count(self, name: str) -> int:
        """How many checkpoint tensors are stacked into the parameter `name`."""
        return sum(stacked in name for stacked, _ in self.stacked_params.values()) or 1


_KV_SCALE_NAME = re.compile(r"(?:model\.)?layers\.(?P<layer>\d+)\.self_attn\.(?P<kind>[kv])_scale")


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass


class MixtralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    pass


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    pass


class SmolLM3ForCausalLM(LlamaForCausalLM):
    pass


class OlmoeForCausalLM(LlamaForCausalLM):
    pass


class GraniteForCausalLM(LlamaForCausalLM):
    def __init__(self, config: PretrainedConfig) -> None:
        _refuse_granite_attention_variants(config)
        super().__init__(config)


def _refuse_granite_attention_variants(config: PretrainedConfig) -> None:
    """ValueError for what newer Granite configs may ask of the attention and aioserve does
    not do yet: a RoPE base a layer, attention sinks."""
    asked = [
        name
        for name, value in (
            ("layer_rope_theta", getattr(config, "layer_rope_theta", None)),
            ("attention_sinks", getattr(config, "attention_sinks", False)),
        )
        if value
    ]
    if asked:
        raise ValueError(
            f"this Granite config asks for {', '.join(asked)} (a RoPE base a layer, attention "
            "sinks), which aioserve does not implement yet"
        )


class GraniteMoeForCausalLM(LlamaForCausalLM):
    """Granite's multipliers with a sparse MoE block in every layer, whose checkpoints hold
    the experts stacked already: `input_linear` (gate then up) is our w13, `output_linear`
    our w2, and `router.layer` the router."""

    def __init__(self, config: PretrainedConfig) -> None:
        _refuse_granite_attention_variants(config)
        super().__init__(config)

    def parameter_for(self, hf_name: str) -> tuple[str, int | None] | None:
        name = hf_name.replace(".block_sparse_moe.input_linear.weight", ".mlp.w13")
        name = name.replace(".block_sparse_moe.output_linear.weight", ".mlp.w2")
        name = re.sub(r"\.block_sparse_moe\.router(\.layer)?\.weight$", ".mlp.gate.weight", name)
        return super().parameter_for(name)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3, Phi-3.5 and Phi-4 (mini): Llama's layers with LongRoPE and, for Phi-4-mini,
    partial rotary, whose checkpoints hold q/k/v and gate/up already stacked (`qkv_proj`,
    `gate_up_proj`, in our order), so nothing is stacked at load."""

    stacked_params: dict[str, tuple[str, int]] = {}
