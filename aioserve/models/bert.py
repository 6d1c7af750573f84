"""BERT encoders (HF `BertModel`, and `RobertaModel` / `XLMRobertaModel`, which differ only in
where positions start): the hidden states of a packed batch of prompts, for pooling
(embedding) models such as sentence-transformers/all-MiniLM-L6-v2.

An encoder has no KV cache and no causal mask: each prompt is one step, and every token
attends to every token of its own prompt (kernels/encoder_attention.py). The step's
prompts come packed, sequence b owning rows cu_seqlens[b]:cu_seqlens[b+1]; positions
count from 0 within each prompt. Pooling the rows into one vector a prompt is
models/pooler.py's.

Layers as HF's: embeddings (word + absolute position + token type, then LayerNorm), then
per layer self-attention (q/k/v with biases), its output projection + residual +
LayerNorm, the intermediate projection with the config's activation (`gelu`: the exact,
erf one), the output projection + residual + LayerNorm. LayerNorm and the activation are
torch's ops; the dense layers are models/linear.py's Linear, as the Llama family's.

Parameter names follow the HF checkpoint, without a "bert." prefix (accepted on load), but
for q/k/v, stacked into one `attention.self.qkv_proj` (one product); `load_weights` does
the stacking. BERT's own pooler (`pooler.dense`, a tanh projection of the CLS row) and
pre-training heads (`cls.`) are not part of this model and are skipped on load, as vLLM
skips them: sentence-transformers' pooling does not use them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig

from aioserve.kernels.encoder_attention import encoder_attention
from aioserve.models.linear import Embedding, Linear
from aioserve.models.weight_copy import copy_hf_weights

# config.hidden_act -> the activation (transformers' ACT2FN names)
_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
# Checkpoint tensors the model does not take: BERT's pooler and pre-training heads, and
# the position-id buffer some checkpoints carry.
_SKIPPED_PREFIXES = ("pooler.", "cls.")
_SKIPPED_NAMES = ("embeddings.position_ids",)


class LayerNorm(nn.Module):
    """torch's LayerNorm whose parameters start uninitialized (the loader fills them)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.bias = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class BertEmbeddings(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.word_embeddings = Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(
        self, input_ids: Tensor, positions: Tensor, token_type_ids: Tensor | None
    ) -> Tensor:
        # Summed in transformers' order: words, token types, positions.
        if token_type_ids is None:
            # Every token of type 0: one row, broadcast.
            hidden = self.word_embeddings(input_ids) + self.token_type_embeddings.weight[0]
        else:
            hidden = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        hidden = hidden + self.position_embeddings(positions)
        return self.LayerNorm(hidden)


class BertSelfAttention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(config.hidden_size, 3 * config.hidden_size, bias=True)

    def forward(self, hidden: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        num_tokens = hidden.shape[0]
        # Views of the fused product, read in place by the attention.
        q, k, v = self.qkv_proj(hidden).view(num_tokens, 3, self.num_heads, self.head_dim).unbind(1)
        out = encoder_attention(q, k, v, cu_seqlens, max_seqlen, self.scale)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)


class BertResidualOutput(nn.Module):
    """dense + residual + LayerNorm: after the attention (HF's BertSelfOutput, in_size the
    hidden size) and after the intermediate layer (HF's BertOutput)."""

    def __init__(self, config: PretrainedConfig, in_size: int) -> None:
        super().__init__()
        self.dense = Linear(in_size, config.hidden_size, bias=True)
        self.LayerNorm = LayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, hidden: Tensor, residual: Tensor) -> Tensor:
        return self.LayerNorm(self.dense(hidden) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertResidualOutput(config, config.hidden_size)

    def forward(self, hidden: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        return self.output(self.self(hidden, cu_seqlens, max_seqlen), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.activation = _ACTIVATIONS[config.hidden_act]

    def forward(self, hidden: Tensor) -> Tensor:
        return self.activation(self.dense(hidden))


class BertLayer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertResidualOutput(config, config.intermediate_size)

    def forward(self, hidden: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        attended = self.attention(hidden, cu_seqlens, max_seqlen)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class BertModel(nn.Module):
    # HF checkpoint name fragment -> (our stacked parameter, index of the shard in it)
    stacked_params = {
        ".attention.self.query.": (".attention.self.qkv_proj.", 0),
        ".attention.self.key.": (".attention.self.qkv_proj.", 1),
        ".attention.self.value.": (".attention.self.qkv_proj.", 2),
    }

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        check_bert_config(config)
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        cu_seqlens: Tensor,
        max_seqlen: int,
        token_type_ids: Tensor | None = None,
    ) -> Tensor:
        """Hidden states [T, hidden] of the packed prompts' tokens (the last layer's).

        input_ids, positions (from 0 within each prompt) int64 [T]; cu_seqlens int32
        [B+1], each prompt's first row then T; max_seqlen the longest prompt's length;
        token_type_ids [T] (segment ids of a sentence pair), all 0 when None.
        """
        hidden = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            hidden = layer(hidden, cu_seqlens, max_seqlen)
        return hidden

    @classmethod
    def max_prompt_len(cls, config: PretrainedConfig) -> int:
        """The longest prompt the position table holds."""
        return config.max_position_embeddings

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Copy HF-named tensors into the parameters (models/weight_copy.py); returns the
        parameter names filled."""
        return copy_hf_weights(self, weights)

    def parameter_for(self, hf_name: str) -> tuple[str, int | None] | None:
        """(our parameter name, index of the shard in it or None) of an HF checkpoint tensor;
        None for a tensor the model does not take (BERT's pooler and heads)."""
        name = hf_name.removeprefix("bert.")
        if name.startswith(_SKIPPED_PREFIXES) or name in _SKIPPED_NAMES:
            return None
        # Checkpoints of the original BERT release name LayerNorm's parameters gamma/beta.
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight")
        name = name.replace("LayerNorm.beta", "LayerNorm.bias")
        for fragment, (stacked, shard) in self.stacked_params.items():
            if fragment in name:
                return name.replace(fragment, stacked), shard
        return name, None

    def shard_rows(self, name: str, shard: int) -> tuple[int, int]:
        """(first row, row count) of shard `shard` of the stacked parameter `name`."""
        size = self.config.hidden_size
        return shard * size, size

    def shard_count(self, name: str) -> int:
        """How many checkpoint tensors are stacked into the parameter `name`."""
        return 3 if ".qkv_proj." in name else 1


class RobertaModel(BertModel):
    """RoBERTa and XLM-RoBERTa encoders (e5, bge, ...): BERT's layers, but a prompt's
    positions count from padding_idx + 1 (transformers' create_position_ids_from_input_ids,
    for a prompt without padding: the table's first padding_idx + 1 rows are never read),
    and checkpoint names may start with "roberta."."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.position_offset = config.pad_token_id + 1

    @classmethod
    def max_prompt_len(cls, config: PretrainedConfig) -> int:
        return config.max_position_embeddings - config.pad_token_id - 1

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        cu_seqlens: Tensor,
        max_seqlen: int,
        token_type_ids: Tensor | None = None,
    ) -> Tensor:
        return super().forward(
            input_ids, positions + self.position_offset, cu_seqlens, max_seqlen, token_type_ids
        )

    def parameter_for(self, hf_name: str) -> tuple[str, int | None] | None:
        return super().parameter_for(hf_name.removeprefix("roberta."))


class XLMRobertaModel(RobertaModel):
    pass


def check_bert_config(config: PretrainedConfig) -> None:
    """ValueError for what this implementation does not cover, named."""
    position_type = getattr(config, "position_embedding_type", "absolute")
    if position_type != "absolute":
        raise ValueError(
            f"BERT position_embedding_type {position_type!r} is not supported: only 'absolute'"
        )
    if config.hidden_act not in _ACTIVATIONS:
        raise ValueError(
            f"BERT activation {config.hidden_act!r} is not supported; "
            f"supported: {', '.join(_ACTIVATIONS)}"
        )
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(
            f"hidden_size {config.hidden_size} is not a multiple of num_attention_heads "
            f"{config.num_attention_heads}"
        )
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        raise ValueError("BERT as a decoder (is_decoder, add_cross_attention) is not supported")
