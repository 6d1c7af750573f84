"""AWQ and GPTQ 4-bit checkpoints (a Hugging Face folder whose config.json has a
`quantization_config`): the scheme read from that config, the float weights of the
quantized layers, and, on a GPU, those layers kept as stored.

`Int4GroupScheme.from_config` accepts what the kernels of kernels/int4_group_linear*.py
implement and refuses the rest by name: 4 bits only, AWQ in its GEMM packing with zero
points, GPTQ in its v1 ("gptq") or v2 ("gptq_v2") format, with or without act-order.

A quantized layer's tensors (`<prefix>.qweight`, `.qzeros`, `.scales`, GPTQ's `.g_idx`)
come out of `grouped_weights` as one `GroupedCodes` under `<prefix>.weight`, the name of the
float weight they replace; `dequantized_weights` turns them into that float32 weight, which
is what the model loads (on the CPU it computes on it, in the model's dtype).

On a GPU (`keep_int4_group_weights`) each Linear whose checkpoint tensors are all
quantized then holds them in the kernels' layout (stacked q/k/v and gate/up shards side by
side, in `load_weights`' order) and its float weight is released (it keeps only its
shape), as models/gguf_weights.py does for GGUF. A layer stays in float where the kernels'
layout does not take it: a group size that is not a multiple of 16 dividing the inputs,
act-order groups of unequal size, or stacked shards whose act-order permutations differ.

On a CPU with bfloat16 arithmetic, where the dense products run on packed bfloat16 weights
(models/linear.py), `keep_int4_cpu_weights` gives each such Linear without act-order a copy
of its codes in the layout of torch's int4 CPU matmul as well, read by steps of up to
linear.INT4_MAX_ROWS rows, as models/gguf_weights.py does for GGUF's Q4_0 / Q4_1: that op
takes groups of 32 inputs, so a group's scale is repeated for each 32 of its inputs, and a
zero point z becomes the op's additive zero (8 - z) * s. Act-order layers, whose groups
are not runs of consecutive inputs, keep the bfloat16 weights only.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from aioserve.kernels.gguf_linear_reference import GROUP_SIZE, fits_int4, pack_int4
from aioserve.kernels.int4_group_linear_reference import (
    GroupedCodes,
    KernelLayout,
    concat_layouts,
    dequantize,
    kernel_layout,
    unpack_along_rows,
    unpack_awq,
    unpack_gptq,
)
from aioserve.models.linear import Linear

METHODS = ("awq", "gptq")
_GPTQ_FORMATS = {"gptq": False, "gptq_v1": False, "gptq_v2": True}  # format -> zeros as stored
_PARTS = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class Int4GroupScheme:
    """How a folder's layers are quantized, from its `quantization_config`."""

    method: str  # "awq" or "gptq"
    group_size: int  # -1: one group over all inputs
    desc_act: bool = False  # GPTQ act-order
    v2: bool = False  # GPTQ zero points stored as they are (gptq_v2)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Int4GroupScheme:
        """The scheme of a `quantization_config`; ValueError naming what is not supported."""
        method = str(config.get("quant_method", "unknown")).lower()
        if method not in METHODS:
            raise ValueError(
                f"quantization method {method!r} is not supported yet (supported in a "
                f"Hugging Face folder: {', '.join(METHODS)}, fp8 and compressed-tensors' FP8)"
            )
        bits = config.get("bits", config.get("w_bit"))
        if bits != 4:
            raise ValueError(f"{method} with {bits} bits is not supported: only 4 bits are")
        group_size = int(config.get("group_size", config.get("q_group_size", 128)))
        if group_size != -1 and group_size <= 0:
            raise ValueError(f"{method} group size {group_size} is not valid")
        if method == "awq":
            version = str(config.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(
                    f"AWQ version {version!r} is not supported: only 'gemm' (AutoAWQ's "
                    "default packing) is"
                )
            if not config.get("zero_point", True):
                raise ValueError("AWQ without zero points (zero_point false) is not supported")
            return cls("awq", group_size)
        fmt = str(config.get("checkpoint_format", config.get("format", "gptq"))).lower()
        if fmt not in _GPTQ_FORMATS:
            raise ValueError(
                f"GPTQ checkpoint format {fmt!r} is not supported: only "
                f"{', '.join(_GPTQ_FORMATS)} are"
            )
        if config.get("dynamic"):
            raise ValueError("GPTQ per-module overrides (`dynamic`) are not supported")
        return cls("gptq", group_size, bool(config.get("desc_act", False)), _GPTQ_FORMATS[fmt])

    def describe(self) -> str:
        """In words, for the load report: "GPTQ 4-bit, groups of 128, act-order"."""
        groups = (
            "one group of all inputs" if self.group_size == -1 else f"groups of {self.group_size}"
        )
        return f"{self.method.upper()} 4-bit, {groups}" + (", act-order" if self.desc_act else "")

    def unpack(self, prefix: str, parts: dict[str, Tensor]) -> GroupedCodes:
        """The layer `prefix`'s tensors (by suffix) unpacked, their shapes checked."""
        qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
        if self.method == "awq":
            k, n = qweight.shape[0], qweight.shape[1] * 8
        else:
            k, n = qweight.shape[0] * 8, qweight.shape[1]
        groups = 1 if self.group_size == -1 else -(-k // self.group_size)
        g_idx = parts.get("g_idx")
        expected = {
            "qzeros": (groups, n // 8),
            "scales": (groups, n),
            "g_idx": (k,),
        }
        for name, shape in expected.items():
            if name in parts and tuple(parts[name].shape) != shape:
                raise ValueError(
                    f"{prefix}.{name} has shape {tuple(parts[name].shape)}; a {self.method} "
                    f"layer of {k} inputs and {n} outputs in groups of {self.group_size} "
                    f"needs {shape}"
                )
        if self.method == "awq":
            return unpack_awq(qweight, qzeros, scales, self.group_size)
        return unpack_gptq(qweight, qzeros, scales, g_idx, self.group_size, self.v2)


def _required_parts(scheme: Int4GroupScheme) -> set[str]:
    # A GPTQ layer without act-order may lack g_idx (older checkpoints): it is then known
    # complete only at the end.
    return {"qweight", "qzeros", "scales"} | ({"g_idx"} if scheme.desc_act else set())


def grouped_weights(
    tensors: Iterable[tuple[str, Tensor]], scheme: Int4GroupScheme
) -> Iterator[tuple[str, Tensor | GroupedCodes]]:
    """(name, tensor) for each plain tensor and (`<prefix>.weight`, GroupedCodes) for each
    quantized layer, from a folder's tensors in any order."""
    pending: dict[str, dict[str, Tensor]] = {}
    required = _required_parts(scheme)
    for name, tensor in tensors:
        prefix, _, suffix = name.rpartition(".")
        if suffix not in _PARTS:
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[suffix] = tensor
        complete = required <= parts.keys() and (scheme.method == "awq" or "g_idx" in parts)
        if complete:
            yield f"{prefix}.weight", scheme.unpack(prefix, pending.pop(prefix))
    for prefix, parts in pending.items():
        missing = sorted(required - parts.keys())
        if missing:
            raise ValueError(f"the checkpoint's layer {prefix} lacks {', '.join(missing)}")
        yield f"{prefix}.weight", scheme.unpack(prefix, parts)


def dequantized_weights(
    tensors: Iterable[tuple[str, Tensor]], scheme: Int4GroupScheme
) -> Iterator[tuple[str, Tensor]]:
    """The folder's tensors with each quantized layer as its float32 weight [N, K]."""
    for name, value in grouped_weights(tensors, scheme):
        yield name, dequantize(value) if isinstance(value, GroupedCodes) else value


def count_layers(names: Iterable[str]) -> int:
    """How many tensors `dequantized_weights` yields for tensors named `names`."""
    plain, prefixes = 0, set()
    for name in names:
        prefix, _, suffix = name.rpartition(".")
        if suffix in _PARTS:
            prefixes.add(prefix)
        else:
            plain += 1
    return plain + len(prefixes)


def _kept_layouts(
    model: nn.Module, layers: Iterable[tuple[str, GroupedCodes]], scheme: Int4GroupScheme
) -> Iterator[tuple[nn.Module, KernelLayout]]:
    """Each Linear of `model` whose checkpoint tensors are all quantized and fit the kernels'
    layout, with its shards' layouts stacked."""
    shards: dict[str, dict[int, KernelLayout | None]] = {}
    for hf_name, grouped in layers:
        target = model.parameter_for(hf_name)
        if target is None:
            continue
        name, shard = target
        try:
            layout = kernel_layout(grouped, scheme.group_size)
        except ValueError:
            layout = None
        shards.setdefault(name, {})[shard or 0] = layout
    for module_name, module in model.named_modules():
        parts = shards.get(f"{module_name}.weight", {})
        if not isinstance(module, Linear) or len(parts) != model.shard_count(
            f"{module_name}.weight"
        ):
            continue
        layouts = [parts[i] for i in sorted(parts)]
        if any(layout is None for layout in layouts):
            continue
        stacked = concat_layouts(layouts)
        if stacked is not None:
            yield module, stacked


@torch.no_grad()
def keep_int4_group_weights(
    model: nn.Module, layers: Iterable[tuple[str, GroupedCodes]], scheme: Int4GroupScheme
) -> int:
    """Give each Linear of `model` whose checkpoint tensors (`layers`, as `grouped_weights`
    yields them) are all quantized those tensors in the kernels' layout, and release its
    float weight; returns the bytes kept."""
    kept = 0
    for module, layout in _kept_layouts(model, layers, scheme):
        device = module.weight.device
        module.quant_qweight = layout.qweight.to(device)
        module.quant_scales = layout.scales.to(device)
        module.quant_zeros = layout.zeros.to(device)
        module.quant_perm = None if layout.perm is None else layout.perm.to(device)
        module.quant_group_size = layout.group_size
        module.weight.data = module.weight.new_zeros(()).expand(module.weight.shape)
        kept += sum(
            t.nbytes
            for t in (module.quant_qweight, module.quant_scales, module.quant_zeros)
            + ((module.quant_perm,) if module.quant_perm is not None else ())
        )
    return kept


@torch.no_grad()
def keep_int4_cpu_weights(
    model: nn.Module,
    layers: Iterable[tuple[str, GroupedCodes]],
    scheme: Int4GroupScheme,
    dtype: torch.dtype,
) -> int:
    """Give each Linear of `model` whose checkpoint tensors are all quantized, without
    act-order, its weights in torch's int4 CPU layout, scales in `dtype` (the model's);
    returns the bytes they take."""
    added = 0
    for module, layout in _kept_layouts(model, layers, scheme):
        fits = fits_int4(module.out_features, module.in_features)
        if layout.perm is not None or layout.group_size % GROUP_SIZE or not fits:
            continue
        codes = unpack_along_rows(layout.qweight).t()  # [N, K]
        repeat = layout.group_size // GROUP_SIZE
        scales = layout.scales.float().repeat_interleave(repeat, dim=0)  # [K / 32, N]
        zeros = layout.zeros.float().repeat_interleave(repeat, dim=0)
        # the op computes (q - 8) * scale + zero
        packed, scales_and_zeros = pack_int4(codes, scales.t(), ((8 - zeros) * scales).t(), dtype)
        module.int4_weight = packed.to(module.weight.device)
        module.int4_scales_and_zeros = scales_and_zeros.to(module.weight.device)
        added += packed.nbytes + scales_and_zeros.nbytes
    return added
