"""The cases of the rotary embedding fused with the KV-cache write
(aioserve/kernels/rotary_kv_write.py), built for bench/kernel_cases.py.

Per model, for each token batch and dtype, into a cache of the model's dtype and into each
fp8 cache the device takes: the queries and keys rotated (views into a fused qkv row, as
the model passes them) and the keys and values written through a slot mapping, in one
launch, against `apply_rotary_reference` then `write_kv_cache_reference`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from aioserve.kernels.kv_cache import write_kv_cache_reference
from aioserve.kernels.rotary import apply_rotary_reference, build_cos_sin_cache
from aioserve.kernels.rotary_kv_write import rotary_and_write_kv_triton
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

# In the notation of kernel_cases.FORMULAS (e bytes per element of the model's dtype, e_kv
# of the cache's): q and k read and written, v read, k and v written into the cache, the
# positions and slots (int64) and a float32 cos/sin row a token.
FORMULAS = {
    "rotary_kv_write": "2·N·(Hq+Hkv)·D·e + N·Hkv·D·e + 2·N·Hkv·D·e + 16·N + 4·N·D",
    "rotary_kv_write fp8": "2·N·(Hq+Hkv)·D·e + N·Hkv·D·e + 2·N·Hkv·D·e_kv + 16·N + 4·N·D",
}
_MAX_POSITION = 8192


def rotary_kv_write_case(
    rand: Random,
    model: ModelShape,
    batch: TokenBatch,
    dtype: torch.dtype,
    block_size: int,
    kv_dtype: torch.dtype | None = None,
) -> Case:
    """One launch's rotary and KV write for `batch`, into a `kv_dtype` cache (fp8, with
    scales) or one of the model's dtype."""
    n, d = batch.n, model.head
    cos_sin = build_cos_sin_cache(d, _MAX_POSITION, 500_000.0, None, torch.float32, rand.device)
    positions = rand.integers(0, _MAX_POSITION, n)
    q_size, kv_size = model.q_heads * d, model.kv_heads * d
    qkv = rand.normal(n, q_size + 2 * kv_size, dtype=dtype)
    query = qkv[:, :q_size].view(n, model.q_heads, d)
    key = qkv[:, q_size : q_size + kv_size].view(n, model.kv_heads, d)
    value = qkv[:, q_size + kv_size :].view(n, model.kv_heads, d)
    slots, num_blocks = cache_slots(rand, batch, block_size)
    cache_dtype = dtype if kv_dtype is None else kv_dtype
    caches = [
        rand.normal(num_blocks, block_size, model.kv_heads, d, dtype=dtype).to(cache_dtype)
        for _ in range(2)
    ]
    scales = fp8_kv_scales(kv_dtype, rand.device)
    e, e_kv = qkv.element_size(), caches[0].element_size()
    traffic = 2 * n * (q_size + kv_size) * e + n * kv_size * e + 2 * n * kv_size * e_kv
    traffic += 16 * n + 4 * n * d

    def run() -> tuple[Tensor, Tensor]:
        return rotary_and_write_kv_triton(
            positions, query, key, value, cos_sin, *caches, slots, True, *scales
        )

    def check() -> str | None:
        expected_caches = [cache.clone() for cache in caches]
        expected_q, expected_k = apply_rotary_reference(positions, query, key, cos_sin, True)
        write_kv_cache_reference(expected_k, value, *expected_caches, slots, True, *scales)
        q, k = run()
        results = [compare(q, expected_q, dtype), compare(k, expected_k, dtype)]
        for cache, expected in zip(caches, expected_caches, strict=True):
            if kv_dtype is None:
                results.append(compare(cache, expected, dtype))
            else:
                results.append(_fp8_codes_agree(cache, expected))
        return next((result for result in results if result is not None), None)

    name = "rotary_kv_write" if kv_dtype is None else "rotary_kv_write fp8"
    return Case(name, model.name, kv_label(batch.label, kv_dtype), dtype, traffic, 0, run, check)


def _fp8_codes_agree(cache: Tensor, expected: Tensor) -> str | None:
    """None when every fp8 code is within one step of the reference's: the rotated keys
    agree to the model dtype's rounding, so a key on a rounding boundary may take the next
    code. Triton's interpreter also loses the carry of a cast that rounds up to a power of
    two (a code half the reference's value there: fp8_linear.py)."""
    got_codes = cache.view(torch.uint8).int()
    expected_codes = expected.view(torch.uint8).int()
    got, wanted = cache.float(), expected.float()
    near = (got_codes - expected_codes).abs() <= 1
    carry_lost = (got * 2 == wanted) & (torch.frexp(wanted).mantissa.abs() == 0.5)
    far = int((~(near | carry_lost)).sum())
    return None if far == 0 else f"{far} fp8 codes more than a step from the reference's"
