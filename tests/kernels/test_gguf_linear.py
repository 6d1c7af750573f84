"""gguf_linear: the torch reference against a float64 product of the weights that gguf-py's
own dequantizer reads (an independent oracle), and the Triton kernels against the
reference, for every GGUF type they take. The blocks of Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 are
gguf-py's quantization of random weights; gguf-py cannot quantize the k-quants, whose blocks
are random bytes with sane fp16 scales (tests/models/tiny_gguf.py `random_blocks`).
tests/models/test_gguf_weights.py checks each type's unpacked form against gguf-py.

Under the interpreter the kernels take the CPU launch table, whose small tiles and splits
let small shapes reach every path: the GEMV with one and several rows, the small and the
large tile, each with K whole and split, K tails and partial column and row tiles
(`test_cases_reach_every_path` checks that each type's cases do). Each type meets both
float16 and float32, with and without a bias; K spans several blocks (k-quants: several
super-blocks, split in the middle of one).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from aioserve import platform
from aioserve.kernels import dispatch
from aioserve.kernels.gguf_linear import _plan, gguf_linear, gguf_linear_triton
from aioserve.kernels.gguf_linear_reference import (
    BLOCK_LAYOUT,
    GGUF_TYPES,
    gguf_linear_reference,
)
from tests.models.tiny_gguf import K_QUANTS, random_blocks

_GGML_TYPES = {qtype: GGMLQuantizationType[qtype.upper()] for qtype in GGUF_TYPES}
# Triton against the reference (float32 sums of float32 weights). float32: the sums'
# order, and the kernels' (q - offset) * scale + zero fused into one rounding on a GPU
# (outputs here up to ~10, float32's step 1e-6). float16: the output's rounding and, on the
# tiled path, each weight's, cast to float16 for tl.dot (one float16 step is 2⁻¹¹ of a
# value).
_TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}
# (N, K) per block size. 32: one block along K; three, so the CPU table's 64-deep steps end
# in a half step; five, split in two. 256 (a super-block of 8 groups): one, whole for 136
# columns; two, split inside a super-block. N = 24, 40 and 136 end in a partial column tile.
_SHAPES = {32: [(40, 32), (24, 96), (40, 160)], 256: [(136, 256), (40, 512)]}
# The GEMV at one row and at three, the small tile, the large one with a partial row tile.
_ROWS = [1, 3, 8, 40]


def _shapes(qtype: str) -> list[tuple[int, int]]:
    return _SHAPES[256 if _GGML_TYPES[qtype] in K_QUANTS else 32]


def _cases() -> list[tuple[str, int, int, int, torch.dtype, bool]]:
    """(qtype, rows, N, K, dtype, with bias): every rows and shape of each type, the dtype
    and the bias alternating so that each type meets both of each."""
    cases = []
    for qtype in GGUF_TYPES:
        combos = itertools.product(_ROWS, _shapes(qtype))
        for i, (rows, (n, k)) in enumerate(combos):
            dtype = (torch.float32, torch.float16)[i % 2]
            cases.append((qtype, rows, n, k, dtype, (i // 2) % 2 == 1))
    return cases


def _blocks(n: int, k: int, qtype: str, seed: int) -> torch.Tensor:
    """`qtype` blocks of a weight [N, K]: gguf-py's quantization of random weights (the
    first block of row 0 all zeros, d = 0), or random k-quant blocks."""
    if _GGML_TYPES[qtype] in K_QUANTS:
        return torch.from_numpy(random_blocks(n, k, _GGML_TYPES[qtype], seed))
    weights = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    weights[0, :32] = 0.0
    return torch.from_numpy(quantize(weights, _GGML_TYPES[qtype]))


def _inputs(rows: int, n: int, k: int, qtype: str, dtype: torch.dtype, with_bias: bool):
    blocks = _blocks(n, k, qtype, seed=rows * 1000 + n + k)
    generator = torch.Generator().manual_seed(rows + k)
    # x is a strided view (rows of a wider tensor), as a slice of a fused projection is.
    x = torch.randn(rows, k + 8, generator=generator).to(dtype)[:, :k]
    bias = torch.randn(n, generator=generator) if with_bias else None
    return x, blocks, bias


@pytest.mark.parametrize("qtype", GGUF_TYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_reference_matches_float64_product_of_gguf_weights(qtype, with_bias):
    n, k = _shapes(qtype)[-1]
    blocks = _blocks(n, k, qtype, seed=2)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(4)) if with_bias else None
    weights = dequantize(blocks.numpy(), _GGML_TYPES[qtype]).astype(np.float64)
    expected = x.double().numpy() @ weights.T
    if bias is not None:
        expected += bias.double().numpy()
    result = gguf_linear_reference(x, blocks, qtype, bias)
    assert result.dtype == torch.float32
    # float32 sums of ~k products, against float64 ones
    torch.testing.assert_close(result.double(), torch.from_numpy(expected), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_cases_reach_every_path(qtype):
    plans = [
        _plan(rows, n, k // 32, dtype)
        for case_type, rows, n, k, dtype, _ in _cases()
        if case_type == qtype
    ]
    tiles = sorted({plan.block_m for plan in plans})  # 1 (the GEMV), small, large
    assert len(tiles) == 3
    paths = {(plan.block_m, plan.splits > 1) for plan in plans}
    assert paths == {(tile, split) for tile in tiles for split in (False, True)}
    cases = [case for case in _cases() if case[0] == qtype]
    assert {case[4] for case in cases} == {torch.float16, torch.float32}
    assert {case[5] for case in cases} == {False, True}


@pytest.mark.parametrize("qtype, rows, n, k, dtype, with_bias", _cases())
def test_triton_matches_reference(triton_backend, qtype, rows, n, k, dtype, with_bias):
    x, blocks, bias = _inputs(rows, n, k, qtype, dtype, with_bias)
    result = gguf_linear(x, blocks, qtype, bias)
    assert result.shape == (rows, n) and result.dtype == dtype
    expected = gguf_linear_reference(x, blocks, qtype, bias)
    torch.testing.assert_close(result, expected, **_TOLERANCE[dtype])


def _interpreted_dot_keeps_a_rows_bits_anywhere_in_its_tile() -> bool:
    """Under Triton's interpreter `tl.dot` is numpy's matmul, and some BLAS kernels give a
    row other bits at another place in the tile: OpenBLAS's AVX2 sgemm, which it picks on a
    Zen 5 EPYC, does (its AVX-512 one does not). The test below then cannot tell the
    kernel's order from the BLAS's. A tile of the CPU's float32 launch (32 rows, 2 groups
    of 32 along K, 32 columns): each row alone at row 0 against the same row in place."""
    if torch.cuda.is_available():
        return True  # compiled: no numpy in the dot
    rng = np.random.default_rng(0)
    for _ in range(5):
        a = rng.standard_normal((32, 64), dtype=np.float32)
        b = rng.standard_normal((64, 32), dtype=np.float32)
        in_place = a @ b
        for row in range(32):
            alone = np.zeros_like(a)
            alone[0] = a[row]
            if not np.array_equal((alone @ b)[0], in_place[row]):
                return False
    return True


@pytest.mark.skipif(
    not _interpreted_dot_keeps_a_rows_bits_anywhere_in_its_tile(),
    reason="numpy's BLAS gives a row other bits elsewhere in an interpreted tile on this CPU",
)
@pytest.mark.parametrize("qtype", ["q4_1", "q6_k"])
def test_batch_invariant_mode_gives_a_row_the_same_bits_in_any_batch(triton_backend, qtype):
    n, k = _shapes(qtype)[-1]
    x, blocks, _ = _inputs(40, n, k, qtype, torch.float32, with_bias=False)
    dispatch.set_batch_invariant(True)
    try:
        alone = [gguf_linear(x[i : i + 1], blocks, qtype) for i in (0, 17, 39)]
        batched = gguf_linear(x, blocks, qtype)
    finally:
        dispatch.set_batch_invariant(False)
    for i, row in zip((0, 17, 39), alone, strict=True):
        assert torch.equal(row[0], batched[i])
    expected = gguf_linear_reference(x, blocks, qtype)
    torch.testing.assert_close(batched, expected, **_TOLERANCE[torch.float32])


def test_k_is_split_for_the_devices_own_number_of_sms(monkeypatch):
    """A GEMV of Llama-3-8B's key/value projection (1,024 columns, 256 tiles of 4, K 4,096)
    on NVIDIA, 7 programs an SM: split 4 ways on an H100 SXM's 132 SMs (924 programs),
    2 on an A10's 72 (504)."""
    monkeypatch.setattr(platform, "_platform", "cuda")
    monkeypatch.setattr(platform, "_arch", "hopper")
    splits = {}
    for units in (132, 72):
        monkeypatch.setattr(platform, "_compute_units", units)
        plan = _plan(1, 1024, 4096 // 32, torch.bfloat16)
        assert plan.gemv and plan.splits * plan.groups_per_split >= 4096 // 32
        splits[units] = plan.splits
    assert splits == {132: 4, 72: 2}


@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_reference_makes_every_tensor_on_the_blocks_device(qtype):
    # The first H100 run of the GPU tests failed for six types: constants made on the CPU
    # beside blocks on cuda:0. The meta device, like a GPU, refuses to mix with the CPU.
    weights, block_bytes = BLOCK_LAYOUT[qtype]
    blocks = torch.zeros(3, 256 // weights * block_bytes, dtype=torch.uint8, device="meta")
    x = torch.zeros(2, 256, device="meta")
    assert gguf_linear_reference(x, blocks, qtype).device.type == "meta"


def test_reference_runs_without_the_triton_backend():
    x, blocks, bias = _inputs(3, 24, 96, "q4_0", torch.float32, with_bias=True)
    assert torch.equal(
        gguf_linear(x, blocks, "q4_0", bias), gguf_linear_reference(x, blocks, "q4_0", bias)
    )


def test_triton_no_rows(triton_backend):
    blocks = _blocks(24, 64, "q4_0", seed=5)
    assert gguf_linear(torch.empty(0, 64), blocks, "q4_0").shape == (0, 24)


@pytest.mark.parametrize(
    "x_shape, qtype, blocks_shape, dtype",
    [
        ((2, 64), "q2_k", (4, 36), torch.float32),  # not a supported type
        ((2, 64), "q4_0", (4, 40), torch.float32),  # q4_1's width
        ((2, 48), "q4_0", (4, 18), torch.float32),  # K not a multiple of 32
        ((2, 96), "q4_k", (4, 54), torch.float32),  # K not a multiple of 256
        ((2, 256), "q6_k", (4, 144), torch.float32),  # q4_k's width
        ((2, 64), "q4_0", (4, 36), torch.int32),  # x not floating point
    ],
)
def test_triton_rejects_bad_inputs(x_shape, qtype, blocks_shape, dtype):
    x = torch.zeros(x_shape, dtype=dtype)
    with pytest.raises(ValueError):
        gguf_linear_triton(x, torch.zeros(blocks_shape, dtype=torch.uint8), qtype)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", GGUF_TYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("n, k", [(960, 768), (576, 1536), (6144, 4096), (4096, 14336)])
def test_gpu_triton_matches_reference(triton_backend, device, qtype, dtype, rows, n, k):
    from bench.kernel_case_types import Random
    from bench.kernel_cases_linear import random_blocks as bench_blocks

    rand = Random(device, rows + n + k)
    blocks = bench_blocks(rand, n, k, qtype)
    x = rand.normal(rows, k, dtype=dtype)
    bias = rand.normal(n, dtype=dtype)
    result = gguf_linear(x, blocks, qtype, bias).double()
    expected = gguf_linear_reference(x, blocks, qtype, bias).double()
    # Relative to the whole output, as bench/kernel_cases.py compares (bf16 keeps 8 bits).
    error = ((result - expected).norm() / expected.norm()).item()
    assert error <= {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 2e-5}[dtype]
