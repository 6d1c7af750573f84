"""AWQ and GPTQ 4-bit weights (group-wise scales and zero points): their published packing,
the kernels' layout, and the float32 product that is the oracle of the Triton kernels and
the CPU's reference.

A weight W [N, K] (N outputs, K inputs) is held as 4-bit codes q, with one scale s and one
integer zero point z per group of G consecutive inputs (G = 32, 64, 128, ...; G = -1 in a
config means one group over all of K) and per output: w[n, k] = (q[n, k] - z[g, n]) * s[g, n]
with g the group of input k. Both formats pack eight 4-bit values into an int32, value i in
bits 4i..4i+3 (the int32 read as unsigned).

AutoAWQ, GEMM version (vLLM's `awq`; the checkpoint's `quantization_config` has
`quant_method` "awq", `version` "gemm"):

- `qweight` int32 [K, N / 8]: word [k, j] holds outputs 8j..8j+7 of input k in AWQ's
  interleaved order, value i being output 8j + AWQ_ORDER[i], AWQ_ORDER = (0, 2, 4, 6, 1, 3,
  5, 7);
- `qzeros` int32 [K / G, N / 8]: the zero points z (0..15), packed as qweight;
- `scales` float16 [K / G, N]; the group of input k is k // G.

AutoGPTQ / GPTQModel (vLLM's `gptq`; `quant_method` "gptq"):

- `qweight` int32 [K / 8, N]: packed along K, value i of word [r, n] being input 8r + i;
- `qzeros` int32 [K / G, N / 8]: packed along N in plain order (value i of word [g, j] is
  output 8j + i). In the original format (`checkpoint_format` "gptq", "v1") a zero point z
  is stored as z - 1, so z = stored + 1 (1..16; a symmetric checkpoint stores 7, z = 8);
  GPTQModel's `gptq_v2` stores z itself. Both are read here;
- `scales` float16 [K / G, N];
- `g_idx` int32 [K]: the group of each input. With act-order (`desc_act`) the inputs were
  quantized in another order, and g_idx[k] is not k // G; without it g_idx[k] = k // G (an
  older checkpoint may lack g_idx then). `sym` says whether every z is 8; it needs no
  treatment of its own, the zero points being stored either way.

`unpack_awq` / `unpack_gptq` read either into one form, `GroupedCodes`: codes uint8 [K, N],
zeros uint8 [groups, N], scales [groups, N] as stored, g_idx int64 [K]; `dequantize` makes
W from it. The kernels' layout (`KernelLayout`, made once at load by `kernel_layout`) is
GPTQ's own, with act-order's inputs sorted by group: codes int32 [K / 8, N] packed along K,
scales [K / G, N] as stored, zeros uint8 [K / G, N], and `perm` int32 [K] (or None), the
input each packed position holds, so that a product reads x[:, perm]. Sorted, every group
is G consecutive positions, and a tile of K within a group has one scale and zero per
output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

PACK = 8  # 4-bit values per int32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output (of eight) that value i of an AWQ word holds


def _shifts(like: Tensor) -> Tensor:
    return torch.arange(0, 32, 4, dtype=like.dtype, device=like.device)


@dataclass(frozen=True)
class GroupedCodes:
    """A 4-bit weight unpacked: w[n, k] = (codes[k, n] - zeros[g, n]) * scales[g, n], with
    g = g_idx[k]."""

    codes: Tensor  # uint8 [K, N], 0..15
    zeros: Tensor  # uint8 [groups, N], 0..16
    scales: Tensor  # [groups, N], float16 (or the checkpoint's dtype)
    g_idx: Tensor  # int64 [K]


@dataclass(frozen=True)
class KernelLayout:
    """What the kernels (and `int4_group_linear_reference`) read: see the module docstring."""

    qweight: Tensor  # int32 [K / 8, N], packed along K, positions in perm order
    scales: Tensor  # float [K / G, N], the checkpoint's dtype
    zeros: Tensor  # uint8 [K / G, N]
    perm: Tensor | None  # int32 [K]: the input at each position; None: position k is input k
    group_size: int  # G, at least 16 and dividing K

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0] * PACK

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]


def unpack_along_rows(words: Tensor) -> Tensor:
    """uint8 [R * 8, C] from int32 words [R, C], value i of word [r, c] becoming row 8r + i."""
    values = (words.unsqueeze(1) >> _shifts(words).view(1, PACK, 1)) & 0xF
    return values.reshape(-1, words.shape[1]).to(torch.uint8)


def unpack_along_columns(words: Tensor, order: tuple[int, ...] | None = None) -> Tensor:
    """uint8 [R, C * 8] from int32 words [R, C], value i of word [r, c] becoming column
    8c + order[i] (8c + i without an order)."""
    values = (words.unsqueeze(2) >> _shifts(words).view(1, 1, PACK)) & 0xF
    if order is not None:
        inverse = [order.index(j) for j in range(PACK)]  # the value holding column j
        values = values[:, :, inverse]
    return values.reshape(words.shape[0], -1).to(torch.uint8)


def pack_along_rows(values: Tensor) -> Tensor:
    """The inverse of `unpack_along_rows`: int32 [R / 8, C] from values [R, C] (0..15)."""
    grouped = values.to(torch.int64).reshape(-1, PACK, values.shape[1])
    unsigned = (grouped << _shifts(grouped).view(1, PACK, 1)).sum(dim=1)
    return torch.where(unsigned >= 2**31, unsigned - 2**32, unsigned).to(torch.int32)


def group_size_of(group_size: int, in_features: int) -> int:
    """G for a config's `group_size` (-1: one group over all inputs)."""
    return in_features if group_size == -1 else group_size


def unpack_awq(qweight: Tensor, qzeros: Tensor, scales: Tensor, group_size: int) -> GroupedCodes:
    """An AutoAWQ GEMM weight unpacked."""
    codes = unpack_along_columns(qweight, AWQ_ORDER)
    g = group_size_of(group_size, codes.shape[0])
    g_idx = torch.arange(codes.shape[0]) // g
    return GroupedCodes(codes, unpack_along_columns(qzeros, AWQ_ORDER), scales, g_idx)


def unpack_gptq(
    qweight: Tensor,
    qzeros: Tensor,
    scales: Tensor,
    g_idx: Tensor | None,
    group_size: int,
    v2: bool = False,
) -> GroupedCodes:
    """A GPTQ weight unpacked; without `g_idx`, input k is in group k // G. `v2`: zero
    points stored as they are (gptq_v2), else as z - 1."""
    codes = unpack_along_rows(qweight)
    zeros = unpack_along_columns(qzeros)
    if not v2:
        zeros = zeros + 1
    if g_idx is None:
        g_idx = torch.arange(codes.shape[0]) // group_size_of(group_size, codes.shape[0])
    return GroupedCodes(codes, zeros, scales, g_idx.long())


def dequantize(grouped: GroupedCodes) -> Tensor:
    """W float32 [N, K]."""
    zeros = grouped.zeros[grouped.g_idx].float()  # [K, N]
    scales = grouped.scales.float()[grouped.g_idx]
    return ((grouped.codes.float() - zeros) * scales).t().contiguous()


def sorted_groups(g_idx: Tensor, group_size: int) -> Tensor | None:
    """The inputs in group order (a stable sort of g_idx) when that makes every group G
    consecutive positions, else None. The identity (no act-order) gives arange(K)."""
    perm = torch.argsort(g_idx, stable=True)
    expected = torch.arange(g_idx.numel()) // group_size
    return perm if torch.equal(g_idx[perm], expected) else None


def fits_kernels(in_features: int, group_size: int) -> bool:
    """Whether the kernels take a weight of `in_features` inputs in groups of `group_size`
    (G a multiple of 16, the least tile depth, dividing K)."""
    return group_size % 16 == 0 and in_features % group_size == 0


def kernel_layout(grouped: GroupedCodes, group_size: int) -> KernelLayout:
    """The kernels' layout of `grouped`, whose config said `group_size` (-1: one group).

    Raises ValueError when the kernels cannot take it: a group size they do not tile, or an
    act-order g_idx whose groups are not G inputs each.
    """
    k = grouped.codes.shape[0]
    g = group_size_of(group_size, k)
    if not fits_kernels(k, g):
        raise ValueError(
            f"the int4 kernels need the group size to be a multiple of 16 dividing the "
            f"inputs; got groups of {g} over {k} inputs"
        )
    perm = sorted_groups(grouped.g_idx, g)
    if perm is None:
        raise ValueError("the g_idx of this weight does not make groups of equal size")
    identity = torch.equal(perm, torch.arange(k))
    codes = grouped.codes if identity else grouped.codes[perm]
    return KernelLayout(
        qweight=pack_along_rows(codes),
        scales=grouped.scales.contiguous(),
        zeros=grouped.zeros.contiguous(),
        perm=None if identity else perm.to(torch.int32),
        group_size=g,
    )


def concat_layouts(layouts: list[KernelLayout]) -> KernelLayout | None:
    """One layout of the stacked outputs of `layouts` (q/k/v, gate/up), or None when their
    inputs are not in one order (act-order permutations that differ) or group size."""
    first = layouts[0]
    for other in layouts[1:]:
        same_perm = (first.perm is None and other.perm is None) or (
            first.perm is not None
            and other.perm is not None
            and torch.equal(first.perm, other.perm)
        )
        if not same_perm or other.group_size != first.group_size:
            return None
    if len(layouts) == 1:
        return first
    return KernelLayout(
        qweight=torch.cat([layout.qweight for layout in layouts], dim=1),
        scales=torch.cat([layout.scales for layout in layouts], dim=1),
        zeros=torch.cat([layout.zeros for layout in layouts], dim=1),
        perm=first.perm,
        group_size=first.group_size,
    )


def dequantize_layout(
    qweight: Tensor, scales: Tensor, zeros: Tensor, perm: Tensor | None, group_size: int
) -> Tensor:
    """W float32 [N, K] from the kernels' layout."""
    codes = unpack_along_rows(qweight)  # [K, N], positions in perm order
    groups = torch.arange(codes.shape[0], device=codes.device) // group_size
    values = (codes.float() - zeros[groups].float()) * scales[groups].float()
    if perm is not None:
        values = torch.empty_like(values).index_copy_(0, perm.long(), values)
    return values.t()


def int4_group_linear_reference(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    zeros: Tensor,
    perm: Tensor | None,
    group_size: int,
    bias: Tensor | None = None,
) -> Tensor:
    """x [M, K] @ Wᵀ (+ bias) in float32, cast to x's dtype; W in the kernels' layout."""
    weight = dequantize_layout(qweight, scales, zeros, perm, group_size)
    out = x.float() @ weight.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
