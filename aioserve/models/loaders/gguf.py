"""Our GGUF loader: llama.cpp checkpoint files, their header read by gguf_header.py.

A GGUF file holds the model's hyper-parameters and tokenizer as metadata and its weights
as tensors named the llama.cpp way (`blk.0.attn_q.weight`), mostly quantized in blocks.
`GGUFFile` turns the metadata into a transformers config (llama, qwen2, qwen3; mistral
GGUFs say "llama"), a generation config and a chat template, and yields every tensor as a
`GGUFTensor` under its Hugging Face name with its raw blocks still at hand, so that a
quantized matmul can take the blocks as they are while everything else calls
`dequantize()` for float32.

Two layout details matter:
- GGUF lists dimensions fastest first (ggml's `ne` order); shapes here are torch order.
- llama.cpp's converter permutes the rows of the llama Q and K projections to suit its
  rotary layout (pairs of adjacent dimensions). We undo that on the raw rows, so the raw
  blocks and the dequantized tensor are both in Hugging Face order. qwen2/qwen3 files are
  not permuted.

Dequantization is vectorized torch; the block layouts follow ggml (`ggml-common.h`), and
the tests compare each type with `gguf.quants.dequantize`, the package's numpy reference.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from transformers import LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3Config

from aioserve.models.loaders.gguf_header import GGUFHeader, TensorInfo

QType = GGMLQuantizationType

# GGUF architecture -> (transformers config class, HF architecture name)
_ARCHITECTURES: dict[str, tuple[type[PretrainedConfig], str]] = {
    "llama": (LlamaConfig, "LlamaForCausalLM"),
    "qwen2": (Qwen2Config, "Qwen2ForCausalLM"),
    "qwen3": (Qwen3Config, "Qwen3ForCausalLM"),
}

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# llama.cpp's sampling defaults (copied from generation_config.json by its converter)
_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face parameter name of a llama.cpp tensor name."""
    if gguf_name.startswith("rope_freqs."):
        raise ValueError(
            "this GGUF stores per-dimension rope frequency factors (rope_freqs, the Llama 3.1 "
            "rope scaling), which aioserve does not support yet"
        )
    if match := _BLOCK_TENSOR.fullmatch(gguf_name):
        layer, part, kind = match.groups()
        if part in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    else:
        stem, _, kind = gguf_name.rpartition(".")
        if stem in _TOP_LEVEL_NAMES and kind in ("weight", "bias"):
            return f"{_TOP_LEVEL_NAMES[stem]}.{kind}"
    raise ValueError(
        f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart that aioserve knows"
    )


# --- dequantization ------------------------------------------------------------------------
# Each function takes the blocks of one type as a (n_blocks, bytes_per_block) uint8 tensor
# and returns (n_blocks, values_per_block) float32.


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 stored at byte `start` of each block, as a (n_blocks, 1) float32 column."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Split (n, g, 32) or (n, 16) bytes into 4-bit values: all low nibbles, then all high."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """The bits of little-endian bytes (n, k) as (n, 8k) values 0/1, bit 0 of byte 0 first."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((packed.unsqueeze(-1) >> shifts) & 1).flatten(1)


def _dequant_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # fp16 d, then 32 int8
    return _f16(blocks, 0) * blocks[:, 2:].view(torch.int8).float()


def _dequant_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # fp16 d, then 16 bytes of nibbles; value (q - 8) * d
    return _f16(blocks, 0) * (_nibbles(blocks[:, 2:]).float() - 8)


def _dequant_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # fp16 d, fp16 m, then 16 bytes of nibbles; value q * d + m
    return _f16(blocks, 0) * _nibbles(blocks[:, 4:]).float() + _f16(blocks, 2)


def _dequant_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    # fp16 d, 4 bytes of fifth bits, 16 bytes of nibbles; value (q - 16) * d
    q = _nibbles(blocks[:, 6:]) | (_bits(blocks[:, 2:6]) << 4)
    return _f16(blocks, 0) * (q.float() - 16)


def _dequant_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    # fp16 d, fp16 m, 4 bytes of fifth bits, 16 bytes of nibbles; value q * d + m
    q = _nibbles(blocks[:, 8:]) | (_bits(blocks[:, 4:8]) << 4)
    return _f16(blocks, 0) * q.float() + _f16(blocks, 2)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins of a Q4_K/Q5_K block, packed in 12 bytes."""
    low, mid, high = packed.reshape(-1, 3, 4).unbind(1)
    scales = torch.cat([low & 0x3F, (high & 0x0F) | ((low >> 2) & 0x30)], dim=1)
    mins = torch.cat([mid & 0x3F, (high >> 4) | ((mid >> 2) & 0x30)], dim=1)
    return scales.float(), mins.float()


def _dequant_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # fp16 d, fp16 dmin, 12 bytes of scales/mins, 128 bytes of nibbles: 8 groups of 32
    n = blocks.shape[0]
    scales, mins = _k_scales(blocks[:, 4:16])
    q = _nibbles(blocks[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32).float()
    d = (_f16(blocks, 0) * scales).unsqueeze(-1)
    m = (_f16(blocks, 2) * mins).unsqueeze(-1)
    return (d * q - m).reshape(n, 256)


def _dequant_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    # as Q4_K, with 32 bytes of fifth bits (bit g of byte j belongs to group g) before the nibbles
    n = blocks.shape[0]
    scales, mins = _k_scales(blocks[:, 4:16])
    high = (blocks[:, 16:48].unsqueeze(1) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1
    low = _nibbles(blocks[:, 48:].reshape(n, 4, 32)).reshape(n, 8, 32)
    q = (low | (high << 4)).float()
    d = (_f16(blocks, 0) * scales).unsqueeze(-1)
    m = (_f16(blocks, 2) * mins).unsqueeze(-1)
    return (d * q - m).reshape(n, 256)


def _dequant_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, fp16 d;
    # value (q - 32) * d * scale, one scale per 16 values
    n = blocks.shape[0]
    low = _nibbles(blocks[:, :128].reshape(n, 2, 64)).reshape(n, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    high = ((blocks[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 8, 32)
    q = ((low | (high << 4)).float() - 32).reshape(n, 16, 16)
    scales = blocks[:, 192:208].view(torch.int8).float()
    d = (_f16(blocks, 208) * scales).unsqueeze(-1)
    return (d * q).reshape(n, 256)


def _dequant_plain(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda blocks: blocks.contiguous().view(dtype).float()


_DEQUANTIZERS: dict[QType, Callable[[torch.Tensor], torch.Tensor]] = {
    QType.F32: _dequant_plain(torch.float32),
    QType.F16: _dequant_plain(torch.float16),
    QType.BF16: _dequant_plain(torch.bfloat16),
    QType.Q8_0: _dequant_q8_0,
    QType.Q4_0: _dequant_q4_0,
    QType.Q4_1: _dequant_q4_1,
    QType.Q5_0: _dequant_q5_0,
    QType.Q5_1: _dequant_q5_1,
    QType.Q4_K: _dequant_q4_k,
    QType.Q5_K: _dequant_q5_k,
    QType.Q6_K: _dequant_q6_k,
}
SUPPORTED_QTYPES: tuple[QType, ...] = tuple(_DEQUANTIZERS)


def check_qtype(qtype: QType, tensor_name: str = "") -> None:
    """Raise a clear error when we cannot dequantize `qtype`."""
    if qtype not in _DEQUANTIZERS:
        where = f" (tensor {tensor_name})" if tensor_name else ""
        supported = ", ".join(t.name for t in SUPPORTED_QTYPES)
        raise ValueError(
            f"GGUF quantization type {qtype.name}{where} is not supported; supported: {supported}"
        )


def dequantize(
    raw: np.ndarray | torch.Tensor, qtype: QType, shape: tuple[int, ...]
) -> torch.Tensor:
    """Float32 values of shape `shape` (torch order) from the uint8 blocks of type `qtype`."""
    check_qtype(qtype)
    blocks = torch.from_numpy(raw) if isinstance(raw, np.ndarray) else raw
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    return _DEQUANTIZERS[qtype](blocks.reshape(-1, block_bytes)).reshape(shape)


@dataclass
class GGUFTensor:
    """One weight of a GGUF file under its Hugging Face name, still in its stored blocks.

    `raw` is uint8 of shape (*shape[:-1], bytes per row), the layout `gguf.quants.dequantize`
    takes; it is a view of the file's memory map unless the rows had to be un-permuted.
    """

    name: str
    qtype: QType
    shape: tuple[int, ...]
    raw: np.ndarray

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.raw, self.qtype, self.shape)


def _unpermute_rows(raw: np.ndarray, rows: int, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of the `rows` rows of a weight or bias.

    llama.cpp stores each head's rows as (head_dim/2, 2) where HF has (2, head_dim/2). A row
    is whole blocks (biases are unquantized: a row is one value's bytes), so moving rows moves
    their bytes unchanged.
    """
    order = np.arange(rows).reshape(n_heads, rows // n_heads // 2, 2).swapaxes(1, 2).reshape(-1)
    return raw.reshape(rows, -1)[order].reshape(raw.shape)


class GGUFFile:
    """An open GGUF file: its config, generation config, chat template and tensors."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._header = GGUFHeader(self.path)
        self.architecture: str = self.metadata("general.architecture")
        self._tensor_names = {t.name for t in self._header.tensors}

    def metadata(self, key: str, default: Any = None) -> Any:
        return self._header.metadata.get(key, default)

    def _arch(self, key: str, default: Any = None) -> Any:
        return self.metadata(f"{self.architecture}.{key}", default)

    @property
    def num_tensors(self) -> int:
        return len(self._header.tensors)

    def stored_type_bytes(self) -> dict[str, int]:
        """Bytes of the tensors per stored type (Q4_1, F32, ...), as in the file."""
        sizes: dict[str, int] = {}
        for tensor in self._header.tensors:
            sizes[tensor.qtype.name] = sizes.get(tensor.qtype.name, 0) + tensor.n_bytes
        return sizes

    def hf_config(self) -> PretrainedConfig:
        """The transformers config of the model, built from the metadata alone."""
        if self.architecture not in _ARCHITECTURES:
            raise ValueError(
                f"GGUF architecture {self.architecture!r} of {self.path} is not supported; "
                f"supported: {', '.join(_ARCHITECTURES)}"
            )
        for name in self._tensor_names:
            hf_tensor_name(name)  # refuse tensors we would not know where to put
        config_class, hf_architecture = _ARCHITECTURES[self.architecture]
        hidden_size = self._arch("embedding_length")
        num_heads = self._arch("attention.head_count")
        tokens = self.metadata("tokenizer.ggml.tokens")
        vocab_size = len(tokens) if tokens is not None else self._arch("vocab_size")
        config: dict[str, Any] = {
            "architectures": [hf_architecture],
            "vocab_size": vocab_size,
            "hidden_size": hidden_size,
            "intermediate_size": self._arch("feed_forward_length"),
            "num_hidden_layers": self._arch("block_count"),
            "num_attention_heads": num_heads,
            "num_key_value_heads": self._arch("attention.head_count_kv", num_heads),
            "max_position_embeddings": self._arch("context_length"),
            "rms_norm_eps": self._arch("attention.layer_norm_rms_epsilon"),
            "rope_theta": self._arch("rope.freq_base", 10000.0),
            "head_dim": self._arch("attention.key_length", hidden_size // num_heads),
            "tie_word_embeddings": "output.weight" not in self._tensor_names,
        }
        if self.architecture == "llama" and "blk.0.attn_q.bias" in self._tensor_names:
            config["attention_bias"] = True
        if (rope_scaling := self._rope_scaling()) is not None:
            config["rope_scaling"] = rope_scaling
        for key, hf_key in (
            ("bos_token_id", "bos_token_id"),
            ("eos_token_id", "eos_token_id"),
            ("padding_token_id", "pad_token_id"),
        ):
            if (token_id := self.metadata(f"tokenizer.ggml.{key}")) is not None:
                config[hf_key] = token_id
        return config_class(**config)

    def _rope_scaling(self) -> dict[str, Any] | None:
        kind = self._arch("rope.scaling.type")
        factor = self._arch("rope.scaling.factor")
        if kind is None and (linear := self._arch("rope.scale_linear")) is not None:
            kind, factor = "linear", linear  # the key older converters wrote
        if kind in (None, "none") or factor in (None, 1.0):
            return None
        if kind not in ("linear", "yarn"):
            raise ValueError(f"GGUF rope scaling type {kind!r} is not supported")
        scaling: dict[str, Any] = {"rope_type": kind, "factor": factor}
        if (original := self._arch("rope.scaling.original_context_length")) is not None:
            scaling["original_max_position_embeddings"] = original
        return scaling

    def generation_config(self) -> dict[str, Any]:
        """bos/eos/pad ids (eos: every end-of-generation id) and llama.cpp's sampling defaults."""
        generation: dict[str, Any] = {}
        if (bos := self.metadata("tokenizer.ggml.bos_token_id")) is not None:
            generation["bos_token_id"] = bos
        eos_ids: list[int] = []
        for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
            token_id = self.metadata(f"tokenizer.ggml.{key}")
            if token_id is not None and token_id not in eos_ids:
                eos_ids.append(token_id)
        if eos_ids:
            generation["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
        if (pad := self.metadata("tokenizer.ggml.padding_token_id")) is not None:
            generation["pad_token_id"] = pad
        for key, hf_key in _SAMPLING_KEYS.items():
            if (value := self.metadata(key)) is not None:
                generation[hf_key] = value
        return generation

    def chat_template(self) -> str | None:
        return self.metadata("tokenizer.chat_template")

    def tensors(self) -> Iterator[GGUFTensor]:
        """Every tensor under its HF name, Q/K rows in HF order; fails early on unknown types."""
        for tensor in self._header.tensors:
            check_qtype(tensor.qtype, tensor.name)
        for tensor in self._header.tensors:
            yield self._tensor(tensor)

    def _tensor(self, tensor: TensorInfo) -> GGUFTensor:
        name = hf_tensor_name(tensor.name)
        shape = tensor.shape
        raw = tensor.raw
        if self.architecture == "llama":
            if ".attn_q." in tensor.name:
                raw = _unpermute_rows(raw, shape[0], self._arch("attention.head_count"))
            elif ".attn_k." in tensor.name:
                raw = _unpermute_rows(raw, shape[0], self._arch("attention.head_count_kv"))
        return GGUFTensor(name=name, qtype=tensor.qtype, shape=shape, raw=raw)
