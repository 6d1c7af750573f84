"""--enable-mfu-metrics' estimate, against hand computations and torch's FlopCounterMode.

The tiny config: 2 layers, hidden 8, 2 query heads, 1 KV head of size 4, vocabulary 10, an
MLP of 16, bfloat16 weights, activations and cache (2 bytes). The step: one prefill of 3
tokens (context 3) and one decode (context 5); T = 4, sum T*C = 3*3 + 1*5 = 14, logits
tokens 2 (one per prefill, every decode token).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM, PretrainedConfig

from aioserve.engine.step_perf import ModelShape, StepShape


def _config(**more) -> PretrainedConfig:
    return LlamaConfig(
        num_hidden_layers=2,
        hidden_size=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        vocab_size=10,
        intermediate_size=16,
        **more,
    )


STEP = StepShape([(3, 3, True), (1, 5, False)])


def _shape(config: PretrainedConfig, quantization: str | None = None) -> ModelShape:
    return ModelShape.from_config(config, torch.bfloat16, torch.bfloat16, quantization)


def test_a_mixed_step_by_hand():
    perf = _shape(_config()).estimate(STEP)
    qkv = 2 * 4 * 8 * (2 + 2) * 4 * 2  # 2048
    out = 2 * 4 * 8 * 2 * 4 * 2  # 1024
    scores_and_values = 2 * (2 * 2 * 14 * 4 * 2)  # 896
    mlp = 2 * 8 * 3 * 16 * 4 * 2  # 6144
    unembed = 2 * 2 * 8 * 10  # 320
    assert perf.flops == qkv + out + scores_and_values + mlp + unembed == 10432
    # Reads: attention 128 + 512 + (192 + 192) + 128 + 256, MLP 2 * 1216, unembed 32 + 160.
    assert perf.read_bytes == 1408 + 2432 + 192 == 4032
    # Writes: attention 256 + 128 + 128, MLP 2 * 448, unembed 40.
    assert perf.write_bytes == 512 + 896 + 40 == 1448


def test_a_sliding_window_layer_caps_its_context():
    config = _config(sliding_window=2, layer_types=["full_attention", "sliding_attention"])
    perf = _shape(config).estimate(STEP)
    # The windowed layer: sum T*min(C, 2) = 3*2 + 1*2 = 8 instead of 14, and its scores and
    # values 2 * 2*q*TC*d = 32 * TC.
    assert perf.flops == 10432 - 32 * 14 + 32 * 8 == 10240


def test_mixture_of_experts_counts_the_routed_tokens():
    config = PretrainedConfig(
        num_hidden_layers=2,
        hidden_size=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        vocab_size=10,
        intermediate_size=16,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    perf = _shape(config).estimate(STEP)
    routed = 2 * 8 * 3 * 16 * (4 * 2) * 2  # T * top_k tokens through an expert's MLP
    assert perf.flops == 10432 - 6144 + routed


def test_quantized_weights_count_at_the_methods_bytes():
    full = _shape(_config()).estimate(STEP)
    four_bit = _shape(_config(), "awq").estimate(STEP)
    assert four_bit.flops == full.flops
    # The layers' weights (attention 512 + 256, MLP 2 * (512 + 256) bytes at bfloat16) are
    # read at 0.5 byte a weight instead of 2; the unembedding keeps the model's dtype.
    assert full.read_bytes - four_bit.read_bytes == (768 + 1536) * 3 // 4 == 1728


def test_a_method_vllm_cannot_size_leaves_only_the_unembedding():
    perf = _shape(_config(), "gguf").estimate(STEP)
    assert (perf.flops, perf.read_bytes, perf.write_bytes) == (320, 192, 40)


@pytest.mark.parametrize("num_tokens", [1, 7])
def test_a_prefill_matches_torchs_flop_count_of_the_forward(num_tokens):
    config = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=50,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 50, (1, num_tokens))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(ids, logits_to_keep=1)  # vLLM counts one logits token per prefill
    shape = ModelShape.from_config(config, torch.float32, torch.float32)
    estimate = shape.estimate(StepShape([(num_tokens, num_tokens, True)]))
    assert estimate.flops == counter.get_total_flops()


def test_an_fp8_kv_cache_halves_the_cache_traffic():
    shape = ModelShape.from_config(_config(), torch.bfloat16, torch.float8_e4m3fn)
    perf = shape.estimate(STEP)
    # The decode reads 2*C*kv*d*L = 80 cache values, the step writes 2*T*kv*d*L = 64.
    assert (perf.read_bytes, perf.write_bytes) == (4032 - 80, 1448 - 64)
