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

Dequantization is the Triton kernels' torch reference (kernels/gguf_linear_reference.py
`dequantize_blocks`, where the block layouts are stated after ggml's `ggml-common.h`), so
that the loader and the kernels read one statement of each layout; the tests compare each
type with `gguf.quants.dequantize`, the package's numpy reference.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from transformers import LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3Config

from aioserve.kernels.gguf_linear_reference import GGUF_TYPES, dequantize_blocks
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


def _dequant_plain(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda blocks: blocks.contiguous().view(dtype).float()


_PLAIN: dict[QType, Callable[[torch.Tensor], torch.Tensor]] = {
    QType.F32: _dequant_plain(torch.float32),
    QType.F16: _dequant_plain(torch.float16),
    QType.BF16: _dequant_plain(torch.bfloat16),
}
SUPPORTED_QTYPES: tuple[QType, ...] = (
    *_PLAIN,
    *(QType[name.upper()] for name in GGUF_TYPES),
)


def check_qtype(qtype: QType, tensor_name: str = "") -> None:
    """Raise a clear error when we cannot dequantize `qtype`."""
    if qtype not in SUPPORTED_QTYPES:
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
    if qtype in _PLAIN:
        return _PLAIN[qtype](blocks).reshape(shape)
    rows = shape[0] if len(shape) > 1 else 1
    return dequantize_blocks(blocks.reshape(rows, -1), qtype.name.lower()).reshape(shape)


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
        if self._arch("expert_count", 0):
            raise ValueError(
                f"{self.path} holds a mixture-of-experts model ({self.architecture}, "
                f"{self._arch('expert_count')} experts): mixture-of-experts models in GGUF "
                "files are not supported yet; serve a 16-bit Hugging Face checkpoint of it"
            )
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
