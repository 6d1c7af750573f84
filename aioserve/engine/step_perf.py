"""--enable-mfu-metrics: each step's FLOPs and memory traffic, estimated from the model's
config, as vLLM 0.32 estimates them (v1/metrics/perf.py).

The estimate is analytic: plain numbers from the config (layers, widths, heads, experts,
vocabulary, dtypes) and, from the step, each sequence's scheduled tokens T_i and context
length C_i (its computed tokens plus T_i). A sequence is a prefill when its chunk still
computes prompt tokens or runs more than one token (vLLM: a new request, or a cached one
with more than one token), else a decode. Over the step, T = sum T_i and TC = sum T_i*C_i
(C_i capped at the window on sliding-window layers). Per layer, with D the hidden size,
q/kv the query/KV heads and d the head size:

    attention  qkv 2*T*D*(q+2kv)*d, out 2*T*D*q*d, scores 2*q*TC*d, values 2*q*TC*d
    dense FFN  2*D*3*I*T (a gated MLP's three matrices)
    MoE        routed 2*D*3*MI*(T*top_k), shared 2*D*3*MI*S*T
    unembed    2*D*V per logits token: one per prefill, every token of a decode

and the bytes read and written are vLLM's per-term sums (weights once per step, activations
per token, the KV cache read by decodes at the cache's dtype). One device, no parallelism:
aioserve runs the model whole, so vLLM's per-GPU figures are the whole model's.

As in vLLM, a quantized checkpoint counts its weights at the method's bytes (fp8 1, the
4-bit methods 0.5); a method vLLM has no size for (GGUF) leaves out attention and FFN,
which then count nothing, and the estimate is the unembedding's alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aioserve.models.moe import is_sparse_layer, num_experts
from aioserve.models.sliding_windows import layer_sliding_windows

# vLLM 0.32's bytes per weight of a quantization method (perf.py's table).
QUANT_WEIGHT_BYTES: dict[str, float] = {
    **dict.fromkeys(("fp8", "fbgemm_fp8", "ptpc_fp8", "fp_quant", "modelopt"), 1.0),
    **dict.fromkeys(("modelopt_mxfp8", "experts_int8"), 1.0),
    **dict.fromkeys(
        ("mxfp4", "awq", "awq_marlin", "gptq", "gptq_marlin", "modelopt_fp4", "petit_nvfp4"), 0.5
    ),
    **dict.fromkeys(("compressed-tensors", "torchao", "quark", "moe_wna16", "inc"), 0.5),
}


@dataclass(frozen=True)
class StepPerf:
    """One step's estimate."""

    flops: int
    read_bytes: int
    write_bytes: int


@dataclass
class StepShape:
    """The step as the estimate sees it: (tokens, context length, prefill) per sequence."""

    sequences: list[tuple[int, int, bool]]

    def add(self, num_tokens: int, context_len: int, is_prefill: bool) -> None:
        self.sequences.append((num_tokens, context_len, is_prefill))


@dataclass(frozen=True)
class ModelShape:
    """What the estimate reads from the model's config."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    weight_bytes: float  # of the layers' weights: the quantization method's, if any
    activation_bytes: int  # also the unembedding's weights, never quantized in vLLM's count
    cache_bytes: int
    layer_windows: tuple[int, ...] = ()  # each layer's sliding window, 0: full attention
    num_moe_layers: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    count_layers: bool = True  # False: attention and FFN left out (vLLM's InvalidComponent)

    @classmethod
    def from_config(
        cls,
        config: object,
        dtype: torch.dtype,
        kv_cache_dtype: torch.dtype,
        quantization: str | None = None,
    ) -> ModelShape:
        config = getattr(config, "text_config", None) or config
        layers = int(config.num_hidden_layers)
        hidden = int(config.hidden_size)
        heads = int(config.num_attention_heads)
        act = torch.empty((), dtype=dtype).element_size()
        weight: float = act
        if quantization is not None:
            weight = QUANT_WEIGHT_BYTES.get(quantization, 0.0)
        experts = num_experts(config)
        return cls(
            num_layers=layers,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
            vocab_size=int(config.vocab_size),
            intermediate_size=int(getattr(config, "intermediate_size", None) or 4 * hidden),
            weight_bytes=weight or act,
            activation_bytes=act,
            cache_bytes=torch.empty((), dtype=kv_cache_dtype).element_size(),
            layer_windows=tuple(layer_sliding_windows(config)),
            num_moe_layers=sum(is_sparse_layer(config, i) for i in range(layers)),
            num_experts=experts,
            experts_per_token=int(getattr(config, "num_experts_per_tok", 0) or 0) if experts else 0,
            moe_intermediate_size=int(
                getattr(config, "moe_intermediate_size", None)
                or getattr(config, "intermediate_size", 0)
            ),
            num_shared_experts=int(
                getattr(config, "n_shared_experts", None)
                or getattr(config, "num_shared_experts", None)
                or 0
            ),
            count_layers=quantization is None or weight > 0,
        )

    def estimate(self, step: StepShape) -> StepPerf:
        """The step's FLOPs, bytes read and bytes written."""
        flops, read, write = self._unembed(step)
        if self.count_layers:
            for part in (self._attention(step), self._ffn(step)):
                flops, read, write = flops + part[0], read + part[1], write + part[2]
        return StepPerf(int(flops), int(read), int(write))

    def _unembed(self, step: StepShape) -> tuple[float, float, float]:
        D, V = self.hidden_size, self.vocab_size
        logits = sum(1 if prefill else n for n, _, prefill in step.sequences)
        return (
            2 * logits * D * V,
            logits * D * self.activation_bytes + D * V * self.activation_bytes,
            logits * V * self.activation_bytes,
        )

    def _attention(self, step: StepShape) -> tuple[float, float, float]:
        D, q, kv, d = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        act, cache, L = self.activation_bytes, self.cache_bytes, self.num_layers
        seqs = step.sequences
        T = sum(n for n, _, _ in seqs)
        flops = 2 * T * D * (q + 2 * kv) * d * L + 2 * T * D * q * d * L
        read = T * D * act * L + D * (q + 2 * kv) * d * self.weight_bytes * L
        read += T * q * d * act * L + q * d * D * self.weight_bytes * L
        windows = self.layer_windows or (0,) * L
        for window in set(windows):  # the same sums for every layer of one window
            layers = windows.count(window)

            def ctx(c: int, w: int = window) -> int:
                return min(c, w) if w else c

            flops += 4 * q * d * sum(n * ctx(c) for n, c, _ in seqs) * layers
            pre_t = sum(n for n, _, p in seqs if p)
            pre_c = sum(ctx(c) for _, c, p in seqs if p)
            dec_t = sum(n for n, _, p in seqs if not p)
            dec_c = sum(ctx(c) for _, c, p in seqs if not p)
            if pre_t:
                read += (pre_t * q + 2 * pre_c * kv) * d * act * layers
            if dec_t:
                read += (dec_t * q * d * act + 2 * dec_c * kv * d * cache) * layers
        write = T * (q + 2 * kv) * d * act * L + 2 * T * kv * d * cache * L + T * D * act * L
        return flops, read, write

    def _ffn(self, step: StepShape) -> tuple[float, float, float]:
        D, DI, act = self.hidden_size, self.intermediate_size, self.activation_bytes
        w = self.weight_bytes
        T = sum(n for n, _, _ in step.sequences)
        Lm = self.num_moe_layers
        Ld = self.num_layers - Lm
        flops = read = write = 0.0
        if Ld:
            flops += 2 * D * 3 * DI * T * Ld
            read += (T * D * act + 2 * D * DI * w + 2 * T * DI * act + T * DI * act) * Ld
            read += D * DI * w * Ld
            write += (2 * T * DI * act + T * DI * act + T * D * act) * Ld
        MI, E, S = self.moe_intermediate_size, self.experts_per_token, self.num_shared_experts
        if Lm and E:
            tokens = T * E
            active = min(tokens, self.num_experts)  # vLLM assumes perfect balance
            flops += 2 * D * 3 * MI * tokens * Lm
            read += (tokens * D * act + 2 * D * MI * active * w + 2 * tokens * MI * act) * Lm
            read += (tokens * MI * act + D * MI * active * w) * Lm
            write += (2 * tokens * MI * act + tokens * MI * act + tokens * D * act) * Lm
        if Lm and S:
            flops += 2 * D * 3 * MI * S * T * Lm
            read += (T * D * act + 2 * D * MI * S * w + 2 * T * MI * S * act) * Lm
            read += (T * MI * act + D * MI * S * w) * Lm
            write += (2 * T * S * MI * act + T * S * MI * act + T * S * D * act) * Lm
        return flops, read, write
