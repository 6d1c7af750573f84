"""Tiny random-weight Llama checkpoints in AWQ and GPTQ, written with the formats' published
packing by plain numpy packers of their own (independent of aioserve's unpackers).

`write_tiny_quantized(folder, scheme)` quantizes the decoder's seven projections of a
random float Llama round-to-nearest, one scale and zero point per group of inputs and
output, packs them as AutoAWQ (GEMM) or AutoGPTQ do, writes model.safetensors (float
tensors in float16, as those tools save them) and config.json with its
`quantization_config`, and returns the float state dict the checkpoint stands for: every
quantized weight as (q - z) * s, the other tensors as stored.

With act-order (GPTQ `desc_act`) the inputs of a layer are grouped in a random order, the
same for the layers that share an input (q/k/v, gate/up), as GPTQ's order comes from the
input's statistics; g_idx[perm[i]] = i // G.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: value i of a word holds output 8j + order[i]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the projections that read one input (their act-order permutation is the same)
_SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up",
                 "up_proj": "gate_up"}  # fmt: skip


@dataclass(frozen=True)
class TinyScheme:
    """Which checkpoint to write."""

    method: str  # "awq" or "gptq"
    group_size: int = 32  # -1: one group
    sym: bool = False
    desc_act: bool = False
    v2: bool = False  # GPTQ's gptq_v2 format: zero points stored as they are

    def quantization_config(self) -> dict:
        if self.method == "awq":
            return {"quant_method": "awq", "bits": 4, "group_size": self.group_size,
                    "zero_point": True, "version": "gemm"}  # fmt: skip
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": self.group_size,
            "desc_act": self.desc_act,
            "sym": self.sym,
            "checkpoint_format": "gptq_v2" if self.v2 else "gptq",
        }


def tiny_config() -> LlamaConfig:
    """A 2-layer Llama whose projections have 128 or 256 inputs (groups of 32 to 128)."""
    return LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        torch_dtype="float16",
        architectures=["LlamaForCausalLM"],
    )


def quantize(
    weight: np.ndarray, g_idx: np.ndarray, groups: int, sym: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Round-to-nearest codes [K, N] (0..15), zeros [groups, N] and float16 scales
    [groups, N] of a float weight [N, K] whose input k is in group g_idx[k]."""
    w = weight.T.astype(np.float32)  # [K, N]
    codes = np.zeros(w.shape, np.int64)
    zeros = np.zeros((groups, w.shape[1]), np.int64)
    scales = np.zeros((groups, w.shape[1]), np.float16)
    for g in range(groups):
        rows = w[g_idx == g]
        if sym:
            scale = (np.abs(rows).max(axis=0) / 7).astype(np.float16)
            zero = np.full(w.shape[1], 8)
        else:
            low, high = rows.min(axis=0), rows.max(axis=0)
            scale = ((high - low) / 15).astype(np.float16)
            # 1..15: GPTQ's v1 format stores z - 1 in four bits
            zero = np.clip(np.round(-low / scale.astype(np.float32)), 1, 15).astype(np.int64)
        scale = np.maximum(scale, np.float16(1e-3))
        scales[g], zeros[g] = scale, zero
        codes[g_idx == g] = np.clip(np.round(rows / scale.astype(np.float32)) + zero, 0, 15)
    return codes, zeros, scales


def pack_awq(values: np.ndarray) -> np.ndarray:
    """int32 [R, C / 8]: word [r, j] holds values[r, 8j + AWQ_ORDER[i]] in bits 4i..4i+3."""
    rows, cols = values.shape
    words = np.zeros((rows, cols // 8), np.uint32)
    for j in range(cols // 8):
        for i in range(8):
            words[:, j] |= values[:, 8 * j + AWQ_ORDER[i]].astype(np.uint32) << np.uint32(4 * i)
    return words.view(np.int32)


def pack_gptq_rows(values: np.ndarray) -> np.ndarray:
    """int32 [R / 8, C]: word [r, c] holds values[8r + i, c] in bits 4i..4i+3."""
    rows, cols = values.shape
    words = np.zeros((rows // 8, cols), np.uint32)
    for r in range(rows // 8):
        for i in range(8):
            words[r] |= values[8 * r + i].astype(np.uint32) << np.uint32(4 * i)
    return words.view(np.int32)


def pack_gptq_columns(values: np.ndarray) -> np.ndarray:
    """int32 [R, C / 8]: word [r, j] holds values[r, 8j + i] in bits 4i..4i+3."""
    rows, cols = values.shape
    words = np.zeros((rows, cols // 8), np.uint32)
    for j in range(cols // 8):
        for i in range(8):
            words[:, j] |= values[:, 8 * j + i].astype(np.uint32) << np.uint32(4 * i)
    return words.view(np.int32)


def quantized_tensors(
    weight: np.ndarray, scheme: TinyScheme, perm: np.ndarray | None
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The checkpoint's tensors of one layer (by suffix) and the float weight [N, K] they
    stand for."""
    k = weight.shape[1]
    size = k if scheme.group_size == -1 else scheme.group_size
    groups = k // size
    g_idx = np.arange(k) // size
    if perm is not None:
        g_idx = np.empty(k, np.int64)
        g_idx[perm] = np.arange(k) // size
    codes, zeros, scales = quantize(weight, g_idx, groups, scheme.sym)
    dequantized = ((codes - zeros[g_idx]) * scales[g_idx].astype(np.float32)).T
    if scheme.method == "awq":
        parts = {"qweight": pack_awq(codes), "qzeros": pack_awq(zeros), "scales": scales}
    else:
        stored_zeros = zeros if scheme.v2 else zeros - 1
        parts = {
            "qweight": pack_gptq_rows(codes),
            "qzeros": pack_gptq_columns(stored_zeros),
            "scales": scales,
            "g_idx": g_idx.astype(np.int32),
        }
    return parts, np.ascontiguousarray(dequantized, dtype=np.float32)


def write_tiny_quantized(
    folder: Path, scheme: TinyScheme, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Write the checkpoint into `folder`; returns the float32 state dict it stands for."""
    config = tiny_config()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    rng = np.random.default_rng(seed)
    tensors: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    perms: dict[tuple[int, str], np.ndarray] = {}
    for name, param in model.state_dict().items():
        projection = name.split(".")[-2]
        if name.endswith(".weight") and projection in PROJECTIONS:
            weight = param.float().numpy()
            perm = None
            if scheme.desc_act:
                layer = int(name.split(".")[2])
                key = (layer, _SHARED_INPUT.get(projection, projection))
                perm = perms.setdefault(key, rng.permutation(weight.shape[1]))
            parts, dequantized = quantized_tensors(weight, scheme, perm)
            prefix = name.removesuffix(".weight")
            for suffix, value in parts.items():
                tensors[f"{prefix}.{suffix}"] = torch.from_numpy(np.ascontiguousarray(value))
            expected[name] = torch.from_numpy(dequantized)
        else:
            tensors[name] = plain_tensor(name, param)
            expected[name] = tensors[name].float()
    save_folder(folder, tensors, config, scheme.quantization_config())
    return expected


def plain_tensor(name: str, param: torch.Tensor) -> torch.Tensor:
    """An unquantized tensor as the tools save it, float16; norms random, so that a mix-up
    cannot hide behind ones."""
    stored = param.detach().to(torch.float16)
    if "norm" in name:
        stored = torch.empty_like(stored).uniform_(0.5, 1.5)
    return stored.contiguous()


def save_folder(
    folder: Path, tensors: dict[str, torch.Tensor], config: LlamaConfig, quantization: dict
) -> None:
    """model.safetensors and a config.json with `quantization` as its quantization_config."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    raw = config.to_dict()
    raw["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
