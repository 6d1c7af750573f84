"""Block-wise FP8 experts kept as stored: a mixture-of-experts checkpoint in DeepSeek's and
Qwen3's `-FP8` format (models/fp8_weights.py reads its scheme) on a GPU.

`keep_fp8_experts` gathers each MoE block's per-expert FP8 layers (gate, up and down, with
their block scales) into the stacked layout the fused MoE kernels take (kernels/moe.py,
moe_reference.py `MoeFp8Scales`): w13 [E, 2·I, H] and w2 [E, H, I] in e4m3, scales
[E, ⌈rows / block rows⌉, ⌈columns / block columns⌉]. Each expert's gate and up are stacked
as a dense gate_up layer's are (models/w8a8_layers.py): where gate's rows do not end on a
block boundary, w13's scales are spread to one a weight row. The block's 16-bit w13 / w2
are released (a shape only). On the CPU, FP8 experts are dequantized at load as the dense
layers are, and nothing here runs.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from aioserve.kernels.fp8_linear_reference import to_e4m3fnuz
from aioserve.models.moe import EXPERT_NAME, EXPERT_PARTS, SparseMoeBlock
from aioserve.models.w8a8_layers import W8A8Layer, stacked_scales


def _expert_layers(
    model: nn.Module, layers: Iterable[tuple[str, W8A8Layer]]
) -> dict[int, dict[int, dict[int | None, W8A8Layer]]]:
    """layer index -> expert -> part (0 gate, 1 up, None down) -> its FP8 layer."""
    found: dict[int, dict[int, dict[int | None, W8A8Layer]]] = {}
    for hf_name, layer in layers:
        match = EXPERT_NAME.fullmatch(hf_name)
        if match is None:
            continue
        if layer.block is None:
            raise ValueError(
                f"{hf_name}: FP8 experts are kept as stored with block-wise scales only"
            )
        _, part = EXPERT_PARTS[match["part"]]
        experts = found.setdefault(int(match["layer"]), {})
        experts.setdefault(int(match["expert"]), {})[part] = layer
    return found


def _stacked(block: SparseMoeBlock, experts: dict[int, dict[int | None, W8A8Layer]], where: str):
    """(w13 values, w13 scales, w13's block rows, w2 values, w2 scales, w2's block rows,
    the block columns) of one MoE block's experts."""
    missing = [e for e in range(block.num_experts) if experts.get(e, {}).keys() != {0, 1, None}]
    if missing:
        raise ValueError(f"{where}: the checkpoint lacks FP8 parts of expert {missing[0]}")
    gate_up = [stacked_scales([experts[e][0], experts[e][1]]) for e in range(block.num_experts)]
    downs = [experts[e][None] for e in range(block.num_experts)]
    blocks = {b for _, b in gate_up} | {layer.block for layer in downs}
    columns = {b[1] for b in blocks}
    if len(columns) != 1 or len({b for _, b in gate_up}) != 1:
        raise ValueError(f"{where}: the experts' FP8 blocks differ: {sorted(blocks)}")
    w13 = torch.stack(
        [torch.cat([experts[e][0].weight, experts[e][1].weight]) for e in range(block.num_experts)]
    )
    w13_scale = torch.stack([scale for scale, _ in gate_up])
    w2 = torch.stack([layer.weight for layer in downs])
    w2_scale = torch.stack([layer.scale for layer in downs])
    return w13, w13_scale, gate_up[0][1][0], w2, w2_scale, downs[0].block[0], columns.pop()


@torch.no_grad()
def keep_fp8_experts(
    model: nn.Module, layers: Iterable[tuple[str, W8A8Layer]], fp8_dtype: torch.dtype
) -> int:
    """Give each MoE block of `model` its experts' block-wise FP8 weights and scales from
    the checkpoint's FP8 `layers` (moved to `fp8_dtype`), and release its 16-bit experts;
    returns the bytes kept."""
    kept = 0
    for index, experts in sorted(_expert_layers(model, layers).items()):
        block = model.layers[index].mlp
        if not isinstance(block, SparseMoeBlock):
            raise ValueError(f"the checkpoint's layer {index} has experts; the model's has none")
        w13, w13_scale, w13_rows, w2, w2_scale, w2_rows, group = _stacked(
            block, experts, f"layers.{index}.mlp"
        )
        if fp8_dtype == torch.float8_e4m3fnuz:
            w13, w13_scale = to_e4m3fnuz(w13, w13_scale)
            w2, w2_scale = to_e4m3fnuz(w2, w2_scale)
        kept += block.hold_fp8_experts(w13, w13_scale, w2, w2_scale, (w13_rows, w2_rows, group))
    return kept
