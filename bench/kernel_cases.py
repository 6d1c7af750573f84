"""The cases of bench/kernel_bandwidth.py: each kernel's inputs, its minimum traffic, its check.

A `Case` is one Triton kernel (called through its `*_triton` launcher, so the kernel
backend setting does not matter) at one shape and dtype, on fresh random inputs (never
zeros: they hide unwritten outputs and run faster than real data). It carries:

- `bytes`: the fewest bytes the call must move through device memory, every input read
  once and every output written once. The formula sits next to each builder below and
  in FORMULAS, in the notation of `ModelShape` (e = bytes per element of the dtype);
- `flops`: for attention, the useful floating-point operations (causal: a query row at
  position p sees p + 1 keys; 2·D for q·k and 2·D for p·v per visible key and head), for
  a linear layer 2·M·N·K;
- `run`: the call that is timed;
- `check`: compares the Triton output with the kernel's torch reference on the same
  inputs and returns None when they agree, else what differs.

The types these share are in bench/kernel_case_types.py, the cases of the linear layers
(GGUF blocks) in bench/kernel_cases_linear.py, those on AWQ / GPTQ weights in
bench/kernel_cases_int4_group.py, those on FP8 weights in bench/kernel_cases_fp8_linear.py,
the dense GEMM of batch-invariant mode in bench/kernel_cases_dense.py, the rotary fused
with the KV write in bench/kernel_cases_rotary_kv.py, the mixture-of-experts block in
bench/kernel_cases_moe.py, the sampler's kernels in bench/kernel_cases_sampling.py. This module imports triton (through
aioserve's kernels), so TRITON_INTERPRET must be set before it is imported when the
kernels are to be interpreted on the CPU.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from aioserve.kernels.activation import (
    gelu_tanh_and_mul_reference,
    gelu_tanh_and_mul_triton,
    silu_and_mul_reference,
    silu_and_mul_triton,
)
from aioserve.kernels.attention_reference import paged_attention_reference
from aioserve.kernels.attention_triton import paged_attention_triton
from aioserve.kernels.kv_cache import write_kv_cache_reference, write_kv_cache_triton
from aioserve.kernels.rms_norm import rms_norm_reference, rms_norm_triton
from aioserve.kernels.rotary import (
    apply_rotary_reference,
    apply_rotary_triton,
    build_cos_sin_cache,
)
from aioserve.platform import e4m3_dtype, e4m3_missing
from bench.kernel_case_types import (
    Case,
    ModelShape,
    Random,
    TokenBatch,
    cache_slots,
    compare,
    fp8_kv_scales,
    kv_label,
)
from bench.kernel_cases_dense import FORMULAS as DENSE_FORMULAS
from bench.kernel_cases_dense import dense_linear_cases
from bench.kernel_cases_fp8_linear import FORMULAS as FP8_LINEAR_FORMULAS
from bench.kernel_cases_fp8_linear import fp8_linear_cases
from bench.kernel_cases_int4_group import FORMULAS as INT4_GROUP_FORMULAS
from bench.kernel_cases_int4_group import int4_group_linear_cases
from bench.kernel_cases_linear import FORMULAS as LINEAR_FORMULAS
from bench.kernel_cases_linear import gguf_linear_cases
from bench.kernel_cases_moe import FORMULAS as MOE_FORMULAS
from bench.kernel_cases_moe import MIXTRAL_8X7B, QWEN3_30B_A3B, TINY_MOE, MoEShape, moe_cases
from bench.kernel_cases_rotary_kv import FORMULAS as ROTARY_KV_FORMULAS
from bench.kernel_cases_rotary_kv import rotary_kv_write_case
from bench.kernel_cases_sampling import FORMULAS as SAMPLING_FORMULAS
from bench.kernel_cases_sampling import (
    bias_and_penalties_case,
    logprobs_case,
    sample_greedy_case,
    sample_random_case,
)

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
DTYPES_BY_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}

_EPS = 1e-5
_ROPE_BASE = 500_000.0
_MAX_POSITION = 8192

# The minimum bytes of each kernel, as the builders below compute them. N rows or tokens,
# H hidden, I intermediate, Hq/Hkv query/kv heads, D head size, B sequences or sampled
# rows, V vocabulary, T query tokens, L_b a sequence's length (context + new tokens),
# bs block size, e bytes per element.
FORMULAS = (
    {
        "rms_norm": "x read + out written + weight: 2·N·H·e + H·e",
        "rms_norm+residual": "x, residual read + out, residual_out written + weight: 4·N·H·e + H·e",
        "rotary neox": "q, k read and written + positions + a cos/sin row per token: "
        "2·N·(Hq+Hkv)·D·e + 8·N + 4·N·D",
        "rotary gptj": "as rotary neox",
        "silu_and_mul": "gate|up read + out written: 3·N·I·e",
        "gelu_tanh_and_mul": "as silu_and_mul",
        "write_kv_cache": "key, value read + written into the cache + slot ids: 4·N·Hkv·D·e + 8·N",
        "write_kv_cache fp8": "key, value read + written into an fp8 cache (one byte) + slot ids: "
        "2·N·Hkv·D·(e + 1) + 8·N",
        "paged_attention": "q read + out written + each sequence's K and V once + its block table "
        "+ lengths: 2·T·Hq·D·e + Σ_b (2·L_b·Hkv·D·e + 4·⌈L_b/bs⌉) + 4·(2B+1); with a sliding "
        "window W, the K and V of min(L_b, q_len_b - 1 + W) positions",
        "paged_attention fp8": "as paged_attention, K and V one byte an element (e_kv = 1) "
        "+ the two scales",
    }
    | SAMPLING_FORMULAS
    | LINEAR_FORMULAS
    | FP8_LINEAR_FORMULAS
    | DENSE_FORMULAS
    | ROTARY_KV_FORMULAS
    | INT4_GROUP_FORMULAS
    | MOE_FORMULAS
)


SMOLLM2_135M = ModelShape("smollm2-135m", 576, 9, 3, 64, 1536, 49152)
LLAMA3_8B = ModelShape("llama3-8b", 4096, 32, 8, 128, 14336, 128256)
TINY = ModelShape("tiny", 64, 4, 2, 32, 96, 512)


@dataclass(frozen=True)
class Workload:
    """Which shapes to run: serving shapes on a GPU, tiny ones under the interpreter."""

    models: tuple[ModelShape, ...]
    token_batches: tuple[TokenBatch, ...]
    attention_batches: tuple[tuple[str, tuple[tuple[int, int], ...]], ...]  # (label, (q_len, L))
    sample_rows: tuple[int, ...]  # B of the sampling kernels
    block_size: int = 16
    moe_models: tuple[MoEShape, ...] = ()  # MoE layers, over token_batches
    # The sliding windows W every attention batch runs at (0: the whole context).
    attention_windows: tuple[int, ...] = (0,)


def _decodes(batch: int, context: int) -> tuple[str, tuple[tuple[int, int], ...]]:
    return f"decode {batch}x{context}", ((1, context),) * batch


SERVING = Workload(
    models=(SMOLLM2_135M, LLAMA3_8B),
    token_batches=(
        TokenBatch.decode(1),
        TokenBatch.decode(64),
        TokenBatch.decode(256),
        TokenBatch.prefill(2048),
    ),
    attention_batches=(
        _decodes(1, 1024),
        _decodes(64, 1024),
        _decodes(256, 1024),
        _decodes(1, 4096),
        _decodes(64, 4096),
        _decodes(256, 4096),
        ("prefill 2048", ((2048, 2048),)),
        ("chunk 2048 after 2048", ((2048, 4096),)),
        ("prefill 2048 + 64 decodes x1024", ((2048, 2048),) + ((1, 1024),) * 64),
    ),
    sample_rows=(1, 256),
    moe_models=(MIXTRAL_8X7B, QWEN3_30B_A3B),
)

TINY_CHECKS = Workload(
    models=(TINY,),
    token_batches=(TokenBatch.decode(3), TokenBatch.prefill(19)),
    attention_batches=(
        _decodes(3, 40),
        ("prefill 19", ((19, 19),)),
        ("chunk 12 after 20 + 2 decodes", ((12, 32), (1, 17), (1, 5))),
    ),
    sample_rows=(1, 6),
    moe_models=(TINY_MOE,),
)


def _first_failure(*results: str | None) -> str | None:
    return next((r for r in results if r is not None), None)


def rms_norm_case(
    rand: Random, model: ModelShape, batch: TokenBatch, dtype: torch.dtype, with_residual: bool
) -> Case:
    """rms_norm of N rows of H, with or without the fused residual add."""
    n = batch.n
    x = rand.normal(n, model.hidden, dtype=dtype, scale=3.0)
    weight = rand.normal(model.hidden, dtype=dtype)
    residual = rand.normal(n, model.hidden, dtype=dtype) if with_residual else None
    e = x.element_size()
    # 2·N·H·e + H·e, plus 2·N·H·e for the residual read and residual_out written.
    traffic = (4 if with_residual else 2) * n * model.hidden * e + model.hidden * e

    def check() -> str | None:
        out = rms_norm_triton(x, weight, _EPS, residual)
        expected = rms_norm_reference(x, weight, _EPS, residual)
        if not with_residual:
            return compare(out, expected, dtype)
        return _first_failure(
            compare(out[0], expected[0], dtype), compare(out[1], expected[1], dtype)
        )

    return Case(
        "rms_norm+residual" if with_residual else "rms_norm",
        model.name,
        batch.label,
        dtype,
        traffic,
        0,
        lambda: rms_norm_triton(x, weight, _EPS, residual),
        check,
    )


def rotary_case(
    rand: Random, model: ModelShape, batch: TokenBatch, dtype: torch.dtype, is_neox: bool
) -> Case:
    """RoPE over q and k, views into a fused qkv row, full rotary dimension."""
    n, d = batch.n, model.head
    cache = build_cos_sin_cache(d, _MAX_POSITION, _ROPE_BASE, None, torch.float32, rand.device)
    if batch.is_prefill:  # one prompt: consecutive positions
        positions = torch.arange(n, device=rand.device)
    else:  # one token of each of n sequences, at unrelated positions
        positions = rand.integers(0, _MAX_POSITION, n)
    # q and k are views into the fused qkv projection output, as the model passes them.
    q_size, kv_size = model.q_heads * d, model.kv_heads * d
    qkv = rand.normal(n, q_size + 2 * kv_size, dtype=dtype)
    query = qkv[:, :q_size].view(n, model.q_heads, d)
    key = qkv[:, q_size : q_size + kv_size].view(n, model.kv_heads, d)
    # 2·N·(Hq+Hkv)·D·e + 8·N (int64 positions) + 4·N·D (a float32 cos/sin row per token).
    traffic = 2 * n * (model.q_heads + model.kv_heads) * d * qkv.element_size() + 8 * n + 4 * n * d

    def check() -> str | None:
        q, k = apply_rotary_triton(positions, query, key, cache, is_neox)
        expected_q, expected_k = apply_rotary_reference(positions, query, key, cache, is_neox)
        return _first_failure(compare(q, expected_q, dtype), compare(k, expected_k, dtype))

    return Case(
        "rotary neox" if is_neox else "rotary gptj",
        model.name,
        batch.label,
        dtype,
        traffic,
        0,
        lambda: apply_rotary_triton(positions, query, key, cache, is_neox),
        check,
    )


def _gated_activation_case(
    name: str,
    triton_path: Callable[[Tensor], Tensor],
    reference: Callable[[Tensor], Tensor],
    rand: Random,
    model: ModelShape,
    batch: TokenBatch,
    dtype: torch.dtype,
) -> Case:
    """A gated activation of N rows of the gate|up projection (2·I wide)."""
    x = rand.normal(batch.n, 2 * model.intermediate, dtype=dtype, scale=2.0)
    traffic = 3 * batch.n * model.intermediate * x.element_size()  # 3·N·I·e

    def check() -> str | None:
        return compare(triton_path(x), reference(x), dtype)

    return Case(name, model.name, batch.label, dtype, traffic, 0, lambda: triton_path(x), check)


def silu_and_mul_case(
    rand: Random, model: ModelShape, batch: TokenBatch, dtype: torch.dtype
) -> Case:
    """SiLU-and-multiply (Llama's MLP)."""
    return _gated_activation_case(
        "silu_and_mul", silu_and_mul_triton, silu_and_mul_reference, rand, model, batch, dtype
    )


def gelu_tanh_and_mul_case(
    rand: Random, model: ModelShape, batch: TokenBatch, dtype: torch.dtype
) -> Case:
    """GELU(tanh)-and-multiply (Gemma's MLP)."""
    return _gated_activation_case(
        "gelu_tanh_and_mul",
        gelu_tanh_and_mul_triton,
        gelu_tanh_and_mul_reference,
        rand,
        model,
        batch,
        dtype,
    )


def fp8_kv_dtypes() -> tuple[torch.dtype, ...]:
    """The fp8 KV-cache formats of the device (asked of the platform module, so that the
    compile check's stand-in device answers): e4m3 (fnuz on MI300) where it has one, and
    e5m2."""
    if e4m3_missing() is not None:
        return (torch.float8_e5m2,)
    return (e4m3_dtype(), torch.float8_e5m2)


def write_kv_cache_case(
    rand: Random,
    model: ModelShape,
    batch: TokenBatch,
    dtype: torch.dtype,
    block_size: int,
    kv_dtype: torch.dtype | None = None,
) -> Case:
    """N tokens' keys and values written into the paged cache through a slot mapping; with
    `kv_dtype`, into an fp8 cache (quantized by the layer's scales)."""
    n, heads, d = batch.n, model.kv_heads, model.head
    slots, num_blocks = cache_slots(rand, batch, block_size)
    key = rand.normal(n, heads, d, dtype=dtype)
    value = rand.normal(n, heads, d, dtype=dtype)
    key_cache = rand.normal(num_blocks, block_size, heads, d, dtype=dtype)
    value_cache = rand.normal(num_blocks, block_size, heads, d, dtype=dtype)
    # 4·N·Hkv·D·e + 8·N; fp8: 2·N·Hkv·D·(e + 1) + 8·N
    traffic = 2 * n * heads * d * key.element_size() + 8 * n
    traffic += 2 * n * heads * d * (key.element_size() if kv_dtype is None else 1)
    scales = fp8_kv_scales(kv_dtype, rand.device)
    if kv_dtype is not None:
        # fp8 numbers times the scales: the write divides exactly and rounds nothing, so it
        # must match the reference bit for bit (Triton's interpreter misrounds a float that
        # needs rounding where the mantissa carries into the exponent: 1.97 -> 1.0 in e5m2).
        key = key.to(kv_dtype).to(dtype) * scales[0].to(dtype)
        value = value.to(kv_dtype).to(dtype) * scales[1].to(dtype)
        key_cache, value_cache = key_cache.to(kv_dtype), value_cache.to(kv_dtype)

    def check() -> str | None:
        expected_keys, expected_values = key_cache.clone(), value_cache.clone()
        write_kv_cache_reference(key, value, expected_keys, expected_values, slots, True, *scales)
        write_kv_cache_triton(key, value, key_cache, value_cache, slots, *scales)
        pairs = ((key_cache, expected_keys), (value_cache, expected_values))
        if all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in pairs):
            return None
        return "the cache differs from the reference's (the copy must be exact)"

    return Case(
        "write_kv_cache" if kv_dtype is None else "write_kv_cache fp8",
        model.name,
        kv_label(batch.label, kv_dtype),
        dtype,
        traffic,
        0,
        lambda: write_kv_cache_triton(key, value, key_cache, value_cache, slots, *scales),
        check,
    )


def attention_case(
    rand: Random,
    model: ModelShape,
    label: str,
    seqs: tuple[tuple[int, int], ...],
    dtype: torch.dtype,
    block_size: int,
    kv_dtype: torch.dtype | None = None,
    window: int = 0,
) -> Case:
    """Paged attention over `seqs`, (q_len, seq_len) pairs, in shuffled physical blocks; with
    `kv_dtype`, over an fp8 cache; with `window` W > 0, each row over its last W positions."""
    device, d = rand.device, model.head
    query_lens = [q for q, _ in seqs]
    seq_lens = [s for _, s in seqs]
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    physical = rand.permutation(num_blocks).to(torch.int32)
    block_tables = torch.zeros(len(seqs), max(blocks_per_seq), dtype=torch.int32, device=device)
    first = 0
    for b, count in enumerate(blocks_per_seq):
        block_tables[b, :count] = physical[first : first + count]
        first += count
    cache_shape = (num_blocks, block_size, model.kv_heads, d)
    key_cache = rand.normal(*cache_shape, dtype=dtype)
    value_cache = rand.normal(*cache_shape, dtype=dtype)
    if kv_dtype is not None:
        key_cache, value_cache = key_cache.to(kv_dtype), value_cache.to(kv_dtype)
    scales = fp8_kv_scales(kv_dtype, device)
    num_tokens = sum(query_lens)
    query = rand.normal(num_tokens, model.q_heads, d, dtype=dtype)
    query_start_loc = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    args = (
        query,
        key_cache,
        value_cache,
        query_start_loc.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables,
        d**-0.5,
        max(query_lens),
        max(seq_lens),
    )
    e, kv_e = query.element_size(), key_cache.element_size()
    # The keys read: all L of a sequence, or with a window those of its first row's window
    # on, min(L, q_len - 1 + W).
    read = [min(s, q - 1 + window) if window else s for q, s in seqs]
    # 2·T·Hq·D·e + Σ_b (2·L_b·Hkv·D·e_kv + 4·⌈L_b/bs⌉) + 4·(2B+1); e_kv is 1 for fp8
    traffic = (
        2 * num_tokens * model.q_heads * d * e
        + sum(2 * r * model.kv_heads * d * kv_e + 4 * math.ceil(r / block_size) for r in read)
        + 4 * (2 * len(seqs) + 1)
    )
    # Query row i of a sequence sits at position p = L - q_len + i and sees p + 1 keys, or
    # min(p + 1, W) with a window: Σ over rows is q_len·(L - q_len) + q_len·(q_len + 1)/2
    # without one.
    if window:
        visible = sum(min(p + 1, window) for q, s in seqs for p in range(s - q, s))
    else:
        visible = sum(q * (s - q) + q * (q + 1) // 2 for q, s in seqs)
    flops = 4 * d * model.q_heads * visible

    def check() -> str | None:
        # Poisoned output: a row the kernels do not write stays NaN and fails the check.
        out = torch.full_like(query, float("nan"))
        paged_attention_triton(*args, out, *scales, sliding_window=window)
        expected = paged_attention_reference(*args, None, None, *scales, sliding_window=window)
        return compare(out, expected, dtype)

    return Case(
        "paged_attention" if kv_dtype is None else "paged_attention fp8",
        model.name,
        kv_label(f"{label}, window {window}" if window else label, kv_dtype),
        dtype,
        traffic,
        flops,
        lambda: paged_attention_triton(*args, None, *scales, sliding_window=window),
        check,
    )


def build_cases(
    workload: Workload,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device,
    inputs: type[Random] = Random,
) -> Iterator[Case]:
    """Every case of `workload`, built one at a time (each one's inputs freed after it),
    its inputs drawn from `inputs` (`Zeros` where no kernel will run).

    The per-token kernels, attention, the linear layers and the MoE layers (after the
    dense models') run in each of `dtypes`; the sampling kernels run once, on float32
    logits, as the engine calls them.
    """
    seeds = itertools.count(1)

    def rand() -> Random:
        return inputs(device, next(seeds))

    per_token = [
        functools.partial(rms_norm_case, with_residual=False),
        functools.partial(rms_norm_case, with_residual=True),
        functools.partial(rotary_case, is_neox=True),
        functools.partial(rotary_case, is_neox=False),
        silu_and_mul_case,
        gelu_tanh_and_mul_case,
        functools.partial(write_kv_cache_case, block_size=workload.block_size),
        functools.partial(rotary_kv_write_case, block_size=workload.block_size),
    ]
    sampling = [sample_greedy_case, sample_random_case, bias_and_penalties_case, logprobs_case]
    for model in workload.models:
        for build in per_token:
            for batch in workload.token_batches:
                for dtype in dtypes:
                    yield build(rand(), model, batch, dtype)
        attention = list(itertools.product(workload.attention_batches, workload.attention_windows))
        for (label, seqs), window in attention:
            for dtype in dtypes:
                yield attention_case(
                    rand(), model, label, seqs, dtype, workload.block_size, None, window
                )
        # The fp8 KV cache (--kv-cache-dtype fp8): its write and the attention reading it.
        for kv_dtype in fp8_kv_dtypes():
            for dtype in dtypes:
                for batch in workload.token_batches:
                    yield write_kv_cache_case(
                        rand(), model, batch, dtype, workload.block_size, kv_dtype
                    )
                    yield rotary_kv_write_case(
                        rand(), model, batch, dtype, workload.block_size, kv_dtype
                    )
                for (label, seqs), window in attention:
                    yield attention_case(
                        rand(), model, label, seqs, dtype, workload.block_size, kv_dtype, window
                    )
        for build_sampling in sampling:
            for rows in workload.sample_rows:
                yield build_sampling(rand(), model, rows)
        yield from gguf_linear_cases(rand(), model, workload.token_batches, dtypes)
        yield from fp8_linear_cases(rand(), model, workload.token_batches, dtypes)
        yield from dense_linear_cases(rand(), model, workload.token_batches, dtypes)
        yield from int4_group_linear_cases(rand(), model, workload.token_batches, dtypes)
    for moe in workload.moe_models:
        yield from moe_cases(rand(), moe, workload.token_batches, dtypes)
