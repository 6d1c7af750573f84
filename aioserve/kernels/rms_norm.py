"""RMSNorm, optionally fused with the residual add that sits between decoder layers.

`rms_norm(x, weight, eps)` normalizes each row of `x` [N, H] the way Hugging Face's
LlamaRMSNorm does: the mean square is taken in float32, the normalized row is cast back to
the input dtype, and only then multiplied by `weight`. With `residual`, the kernel first
forms `residual_out = x + residual` (rounded to x's dtype, as a plain torch add would) and
normalizes that, returning both; this is the fused "add & norm" between decoder layers.

Neither path modifies its inputs: results go to freshly allocated tensors. The output dtype
is always x's dtype, whatever the dtype of `weight`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from aioserve.kernels import dispatch
from aioserve.kernels.triton_compat import tl, triton
from aioserve.platform import launch_entry

# Per platform: the widest slice of a row one program holds at a time (longer rows are
# walked in slices), how many row elements one warp/wavefront should cover, and the
# most warps per program. A ROCm wavefront has 64 lanes, so it covers twice as much.
_CONFIG: dict[str, dict[str, int]] = {
    "cuda": {"max_block": 8192, "elements_per_warp": 256, "max_warps": 16},  # 8 spill at 4096
    "rocm": {"max_block": 8192, "elements_per_warp": 512, "max_warps": 8},
    "cpu": {"max_block": 1024, "elements_per_warp": 256, "max_warps": 1},
}


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per row. First pass: the sum of squares. Second pass: normalize and
    # store. The second pass re-reads the inputs rather than its own stores.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    residual_row = residual_ptr + row * stride_residual
    out_dtype = out_ptr.dtype.element_ty

    sum_of_squares = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, hidden_size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < hidden_size
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            residual = tl.load(residual_row + cols, mask=mask, other=0.0).to(tl.float32)
            x = (x + residual).to(out_dtype).to(tl.float32)
        sum_of_squares += x * x
    inverse_rms = tl.rsqrt(tl.sum(sum_of_squares, axis=0) / hidden_size + eps)

    for start in range(0, hidden_size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < hidden_size
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            residual = tl.load(residual_row + cols, mask=mask, other=0.0).to(tl.float32)
            summed = (x + residual).to(out_dtype)
            tl.store(residual_out_ptr + row * stride_residual_out + cols, summed, mask=mask)
            x = summed.to(tl.float32)
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        normed = (x * inverse_rms).to(out_dtype).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, (normed * weight).to(out_dtype), mask=mask)


def _rows(t: Tensor) -> Tensor:
    """`t` with unit stride along its last dimension (rows may be strided)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm_triton(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """The Triton path of `rms_norm`."""
    num_rows, hidden_size = x.shape
    x = _rows(x)
    out = torch.empty((num_rows, hidden_size), dtype=x.dtype, device=x.device)
    residual_out = None
    if residual is not None:
        residual = _rows(residual)
        residual_out = torch.empty_like(out)
    if num_rows > 0:
        config = launch_entry(_CONFIG)
        block = min(triton.next_power_of_2(hidden_size), config["max_block"])
        num_warps = max(1, min(config["max_warps"], block // config["elements_per_warp"]))
        _rms_norm_kernel[(num_rows,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            residual_out if residual_out is not None else out,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            out.stride(0),
            residual_out.stride(0) if residual_out is not None else 0,
            hidden_size,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=num_warps,
        )
    if residual_out is not None:
        return out, residual_out
    return out


def rms_norm_reference(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """The torch path of `rms_norm`: LlamaRMSNorm, plus the optional residual add."""
    residual_out = None
    if residual is not None:
        residual_out = (x + residual).to(x.dtype)
        x = residual_out
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # The same arithmetic in one fused pass (bit-identical in float32): the CPU's path.
        out = F.rms_norm(x, (x.shape[-1],), weight, eps)
        return (out, residual_out) if residual_out is not None else out
    x_f32 = x.float()
    variance = x_f32.pow(2).mean(dim=-1, keepdim=True)
    normed = (x_f32 * torch.rsqrt(variance + eps)).to(x.dtype)
    out = (weight * normed).to(x.dtype)
    if residual_out is not None:
        return out, residual_out
    return out


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """RMS-normalize the rows of `x` [N, H] and scale by `weight` [H].

    Without `residual` returns the normalized rows. With `residual` [N, H] returns
    `(rms_norm(x + residual), x + residual)`. Inputs are left untouched.
    """
    if dispatch.use_triton():
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_reference(x, weight, eps, residual)
