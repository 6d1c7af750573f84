"""The gated activations of the MLPs: SiLU-and-multiply (Llama-style SwiGLU) and
GELU(tanh)-and-multiply (Gemma's GeGLU).

The fused gate/up projection produces x [..., 2*I]; the activation returns
act(x[..., :I]) * x[..., I:], computed in float32 and stored in x's dtype. GELU here is its
tanh approximation (transformers' `gelu_pytorch_tanh`, torch's F.gelu(approximate="tanh")):
0.5 * g * (1 + tanh(sqrt(2/pi) * (g + 0.044715 * g^3))), which the Triton kernel computes
as g * sigmoid(2 * sqrt(2/pi) * (g + 0.044715 * g^3)), the same function (Triton has no
portable tanh).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from aioserve.kernels import dispatch
from aioserve.kernels.triton_compat import tl, triton
from aioserve.platform import launch_entry

# Per platform: output columns one program computes, and its warps.
_CONFIG: dict[str, dict[str, int]] = {
    "cuda": {"block": 1024, "num_warps": 4},
    "rocm": {"block": 1024, "num_warps": 4},
    "cpu": {"block": 1024, "num_warps": 1},
}


@triton.jit
def _gate_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_out, intermediate_size, BLOCK: tl.constexpr, GELU: tl.constexpr
):
    # One program per (row, BLOCK output columns): g * sigmoid(a) * up, where a is g for
    # SiLU and 2 * sqrt(2 / pi) * (g + 0.044715 g^3) for GELU(tanh), as
    # 0.5 * (1 + tanh(y)) = sigmoid(2y).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate_size
    x_row = x_ptr + row * stride_x
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + intermediate_size + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        inner = 1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)
    else:
        inner = gate
    out = gate / (1.0 + tl.exp(-inner)) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _gate_and_mul_triton(x: Tensor, gelu: bool) -> Tensor:
    """The Triton path of `silu_and_mul` (gelu False) and `gelu_tanh_and_mul` (True)."""
    intermediate_size = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], intermediate_size), dtype=x.dtype, device=x.device)
    if rows.shape[0] > 0 and intermediate_size > 0:
        config = launch_entry(_CONFIG)
        block = min(triton.next_power_of_2(intermediate_size), config["block"])
        grid = (rows.shape[0], triton.cdiv(intermediate_size, block))
        _gate_and_mul_kernel[grid](
            rows,
            out,
            rows.stride(0),
            out.stride(0),
            intermediate_size,
            BLOCK=block,
            GELU=gelu,
            num_warps=config["num_warps"],
        )
    return out.reshape(*x.shape[:-1], intermediate_size)


def _check_even(x: Tensor, name: str) -> None:
    if x.shape[-1] % 2:
        raise ValueError(f"{name} needs an even last dimension, got {x.shape[-1]}")


def silu_and_mul_triton(x: Tensor) -> Tensor:
    """The Triton path of `silu_and_mul`."""
    return _gate_and_mul_triton(x, gelu=False)


def silu_and_mul_reference(x: Tensor) -> Tensor:
    """The torch path of `silu_and_mul`."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def silu_and_mul(x: Tensor) -> Tensor:
    """x [..., 2*I] -> silu(x[..., :I]) * x[..., I:], shape [..., I]."""
    _check_even(x, "silu_and_mul")
    if dispatch.use_triton():
        return silu_and_mul_triton(x)
    return silu_and_mul_reference(x)


def gelu_tanh_and_mul_triton(x: Tensor) -> Tensor:
    """The Triton path of `gelu_tanh_and_mul`."""
    return _gate_and_mul_triton(x, gelu=True)


def gelu_tanh_and_mul_reference(x: Tensor) -> Tensor:
    """The torch path of `gelu_tanh_and_mul`."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") * up).to(x.dtype)


def gelu_tanh_and_mul(x: Tensor) -> Tensor:
    """x [..., 2*I] -> gelu_tanh(x[..., :I]) * x[..., I:], shape [..., I]."""
    _check_even(x, "gelu_tanh_and_mul")
    if dispatch.use_triton():
        return gelu_tanh_and_mul_triton(x)
    return gelu_tanh_and_mul_reference(x)
