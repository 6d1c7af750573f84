"""Tiny GGUF files written the way llama.cpp's converter writes them, for tests: a 2-layer
model's random weights (Q/K rows permuted as llama.cpp does), some tensors quantized by
gguf-py's own quantizer, or, in the k-quants, which gguf-py cannot quantize, random blocks
built byte by byte (`random_blocks`)."""

from __future__ import annotations

import gguf
import numpy as np
from gguf.quants import quantize as gguf_quantize

from aioserve.models.loaders.gguf import QType

# Where a k-quant block's fp16 scales are, and the range drawn for each: (byte, low, high).
# Every other byte of a block may take any value (codes, 6-bit or int8 sub-scales); these
# keep the weights finite and mostly within ±0.1 (a weight is at most d · 63 · 15 in Q4_K,
# d · 63 · 31 in Q5_K, d · 128 · 32 in Q6_K).
_K_QUANT_SCALES = {
    QType.Q4_K: ((0, 2**-14, 2**-12), (2, 2**-14, 2**-12)),  # d, dmin
    QType.Q5_K: ((0, 2**-15, 2**-13), (2, 2**-15, 2**-13)),
    QType.Q6_K: ((208, 2**-17, 2**-15),),  # d
}
K_QUANTS = tuple(_K_QUANT_SCALES)


def random_blocks(rows: int, cols: int, qtype: QType, seed: int) -> np.ndarray:
    """uint8 [rows, cols / 256 * block bytes]: k-quant blocks of random bytes but for the fp16
    scales (`_K_QUANT_SCALES`), in ggml's layout."""
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // 256, block_bytes), dtype=np.uint8)
    for at, low, high in _K_QUANT_SCALES[qtype]:
        scale = rng.uniform(low, high, (rows, cols // 256, 1)).astype(np.float16)
        blocks[:, :, at : at + 2] = scale.view(np.uint8)
    return blocks.reshape(rows, -1)


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to the llama Q and K rows."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def tiny_state_dict(
    arch: str, hidden: int = 64, head_dim: int = 32, ffn: int = 96
) -> dict[str, np.ndarray]:
    """A 2-layer model: llama and qwen2 with q/k/v biases, qwen3 with q/k norms and lm_head;
    4 query heads, 2 KV heads, a vocabulary of 40."""
    rng = np.random.default_rng(2)
    heads, kv_heads, vocab = 4, 2, 40

    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    state = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": w(hidden)}
    for layer in range(2):
        prefix = f"model.layers.{layer}."
        state |= {
            prefix + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
            prefix + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
            prefix + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            prefix + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
            prefix + "mlp.gate_proj.weight": w(ffn, hidden),
            prefix + "mlp.up_proj.weight": w(ffn, hidden),
            prefix + "mlp.down_proj.weight": w(hidden, ffn),
            prefix + "input_layernorm.weight": w(hidden),
            prefix + "post_attention_layernorm.weight": w(hidden),
        }
        if arch in ("llama", "qwen2"):
            state[prefix + "self_attn.q_proj.bias"] = w(heads * head_dim)
            state[prefix + "self_attn.k_proj.bias"] = w(kv_heads * head_dim)
            state[prefix + "self_attn.v_proj.bias"] = w(kv_heads * head_dim)
        if arch == "qwen3":
            state[prefix + "self_attn.q_norm.weight"] = w(head_dim)
            state[prefix + "self_attn.k_norm.weight"] = w(head_dim)
    if arch == "qwen3":
        state["lm_head.weight"] = w(vocab, hidden)
    return state


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(hf_name: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
    }
    if hf_name in top:
        return top[hf_name]
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, *module, kind = hf_name.split(".")
    return f"blk.{layer}.{_GGUF_NAMES['.'.join(module)]}.{kind}"


def write_tiny_gguf(
    path, arch: str, state: dict[str, np.ndarray], quantized: dict[str, QType] | None = None
) -> None:
    """Write `state` (of `tiny_state_dict`) as llama.cpp would; `quantized` maps a name
    suffix to the type its tensors are stored in (default: every mlp.up_proj weight in
    Q8_0), the rest in F32. A k-quant tensor holds `random_blocks`, not `state`'s values."""
    quantized = {"mlp.up_proj.weight": QType.Q8_0} if quantized is None else quantized
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(state["model.embed_tokens.weight"].shape[1])
    writer.add_feed_forward_length(state["model.layers.0.mlp.gate_proj.weight"].shape[0])
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_key_length(state["model.layers.0.self_attn.q_proj.weight"].shape[0] // 4)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(500000.0)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(4.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(40)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(3)
    writer.add_chat_template("{{ messages[0]['content'] }}")
    for name, value in state.items():
        if arch == "llama" and ".q_proj." in name:
            value = llama_cpp_permute(value, 4)
        elif arch == "llama" and ".k_proj." in name:
            value = llama_cpp_permute(value, 2)
        qtype = next((t for suffix, t in quantized.items() if name.endswith(suffix)), None)
        if qtype in K_QUANTS:
            blocks = random_blocks(*value.shape, qtype, seed=len(name) + value.size)
            writer.add_tensor(_gguf_name(name), blocks, raw_dtype=qtype)
        elif qtype is not None:
            writer.add_tensor(_gguf_name(name), gguf_quantize(value, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(_gguf_name(name), value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
