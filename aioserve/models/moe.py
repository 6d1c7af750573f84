"""The sparse mixture-of-experts block of Mixtral, Qwen2-MoE and Qwen3-MoE decoder layers.

In place of a dense MLP, a router (`gate`, hidden → E logits) picks each token's top_k
experts; each expert is a SiLU-gated MLP, and their outputs are added weighted by the
router's probabilities (kernels/moe_reference.py states the arithmetic). The experts'
weights are stacked as the kernels take them: `w13` [E, 2·I, H] (each expert's gate_proj
then up_proj rows) and `w2` [E, H, I] (its down_proj); the model's loader fills them from
the checkpoint's per-expert tensors (llama.py). A block-wise FP8 checkpoint's experts are
kept so on a GPU, in e4m3 with their block scales (`hold_fp8_experts`,
models/moe_fp8_weights.py), and dequantized at load elsewhere. Qwen2-MoE adds a shared expert, a dense MLP
every token runs, scaled by sigmoid(shared_expert_gate(x)).

Which expert has which tokens changes every step and, on the CPU, is read on the host. So
under torch.compile the experts' products are one opaque custom op, `aioserve::fused_moe`,
as the paged attention is: the compiled graphs keep the router, its softmax and top-k, and
the shared expert, and the op runs the Triton kernels on a GPU (kernels/moe.py, which sync
nothing, so that a decode step can be captured in a CUDA/HIP graph) or the reference on
the CPU. Eagerly, the same function runs directly. Where the CPU's dense products run
oneDNN on packed weights (a bfloat16 model on a CPU with bfloat16 arithmetic,
models/linear.py), so do the experts' (`pack_expert_weights`). Those packed weights are
kept here, in a table the op reaches by a block's integer key, not passed to the op: as
its arguments every packed expert was an input of the compiled graphs, and a model with
Qwen3-30B-A3B's 48 layers of 128 experts (12,288 inputs to the one-row graph) had not
finished compiling after 15 minutes, against 27 s with the table.
"""

from __future__ import annotations

import itertools
import re
import weakref

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from aioserve.kernels.moe import fused_moe
from aioserve.kernels.moe_reference import MoeFp8Scales, pack_expert_weight, select_experts
from aioserve.models.linear import Linear
from aioserve.models.weight_copy import copy_checked

# Each packed block's experts: key -> (packed gate/up weights, packed down weights), one
# tensor per expert (`pack_expert_weights`); an entry leaves with its block.
_PACKED_EXPERTS: dict[int, tuple[list[Tensor], list[Tensor]]] = {}
_NO_PACKED_EXPERTS = -1
_next_packed_key = itertools.count()


def _fused_moe_op(
    x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor, packed_key: int
) -> Tensor:
    packed_w13, packed_w2 = (
        ((), ()) if packed_key == _NO_PACKED_EXPERTS else _PACKED_EXPERTS[packed_key]
    )
    return fused_moe(x, w13, w2, topk_weights, topk_ids, packed_w13, packed_w2)


def _fused_moe_fp8_op(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    w13_scale: Tensor,
    w2_scale: Tensor,
    fp8_block: list[int],
) -> Tensor:
    fp8 = MoeFp8Scales(w13_scale, w2_scale, *fp8_block)
    return fused_moe(x, w13, w2, topk_weights, topk_ids, fp8=fp8)


# Registered through torch.library.Library, as models/lora_op.py's op is: custom_op's Python
# layers cost a few microseconds more a call. The key is a SymInt, as paged attention's
# layer index is: as a plain int, dynamo would compile a layer graph for every block.
# Block-wise FP8 experts take an op of their own, with their scales and `fp8_block` = [w13's
# block rows, w2's, the block columns]: optional arguments on the one op crashed the CPU's
# one-row graph (inductor's C++ wrapper) with a segmentation fault.
_LIBRARY = torch.library.Library("aioserve", "FRAGMENT")
_LIBRARY.define(
    "fused_moe(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, "
    "SymInt packed_key) -> Tensor"
)
_LIBRARY.impl("fused_moe", _fused_moe_op, "CompositeExplicitAutograd")
_LIBRARY.define(
    "fused_moe_fp8(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, "
    "Tensor w13_scale, Tensor w2_scale, int[] fp8_block) -> Tensor"
)
_LIBRARY.impl("fused_moe_fp8", _fused_moe_fp8_op, "CompositeExplicitAutograd")


@torch.library.register_fake("aioserve::fused_moe")
def _(
    x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor, packed_key: int
) -> Tensor:
    return x.new_empty(x.shape)


@torch.library.register_fake("aioserve::fused_moe_fp8")
def _(x: Tensor, *_: object) -> Tensor:
    return x.new_empty(x.shape)


def run_experts(
    x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor, packed_key: int
) -> Tensor:
    """The routed experts' weighted sum [T, H] (kernels/moe.py), an opaque op when compiled;
    `packed_key` names the experts' packed weights (`pack_expert_weights`), if any."""
    if torch.compiler.is_compiling():
        return torch.ops.aioserve.fused_moe(x, w13, w2, topk_weights, topk_ids, packed_key)
    return _fused_moe_op(x, w13, w2, topk_weights, topk_ids, packed_key)


def run_fp8_experts(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    w13_scale: Tensor,
    w2_scale: Tensor,
    fp8_block: tuple[int, ...],
) -> Tensor:
    """`run_experts` for block-wise FP8 experts, with their scales and `fp8_block` (the
    op's comment)."""
    args = (x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, list(fp8_block))
    if torch.compiler.is_compiling():
        return torch.ops.aioserve.fused_moe_fp8(*args)
    return _fused_moe_fp8_op(*args)


def num_experts(config: PretrainedConfig) -> int:
    """The config's expert count: Mixtral's num_local_experts, Qwen-MoE's num_experts; 0 for
    a dense model."""
    return int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0) or 0)


def is_sparse_layer(config: PretrainedConfig, layer_index: int) -> bool:
    """Whether decoder layer `layer_index` has a MoE block rather than a dense MLP: every
    layer of Mixtral; Qwen-MoE's every decoder_sparse_step-th layer not in mlp_only_layers."""
    if num_experts(config) == 0:
        return False
    if layer_index in (getattr(config, "mlp_only_layers", None) or []):
        return False
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_index + 1) % step == 0


class SparseMoeBlock(nn.Module):
    """Router, experts and, for Qwen2-MoE, the gated shared expert (`shared_expert`, a dense
    MLP the model builds)."""

    def __init__(self, config: PretrainedConfig, shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(
                f"unsupported activation {config.hidden_act!r}: only silu is implemented"
            )
        self.num_experts = num_experts(config)
        self.top_k = int(config.num_experts_per_tok)
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok {self.top_k} must be between 1 and the "
                f"{self.num_experts} experts"
            )
        # Mixtral and GraniteMoe (a softmax over the chosen experts' logits) always
        # renormalize the chosen experts' probabilities; Qwen-MoE as norm_topk_prob says.
        self.renormalize = config.model_type in ("mixtral", "granitemoe") or bool(
            getattr(config, "norm_topk_prob", False)
        )
        hidden = config.hidden_size
        intermediate = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        self.intermediate_size = intermediate
        self.gate = Linear(hidden, self.num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(self.num_experts, 2 * intermediate, hidden))
        self.w2 = nn.Parameter(torch.empty(self.num_experts, hidden, intermediate))
        # The key of its experts' weights in oneDNN's layout once `pack_expert_weights` has
        # run (a bfloat16 model on a CPU with bfloat16 arithmetic); until then, none.
        self.packed_key = _NO_PACKED_EXPERTS
        # Block-wise FP8 experts kept as stored in place of w13 / w2 (`hold_fp8_experts`).
        self.register_buffer("fp8_w13", None, persistent=False)
        self.register_buffer("fp8_w13_scale", None, persistent=False)
        self.register_buffer("fp8_w2", None, persistent=False)
        self.register_buffer("fp8_w2_scale", None, persistent=False)
        self.fp8_block: tuple[int, ...] = ()  # (w13's block rows, w2's, block columns)
        self.shared_expert = shared_expert
        if shared_expert is not None:
            self.shared_expert_gate = Linear(hidden, 1, bias=False)

    def hold_fp8_experts(
        self,
        w13: Tensor,
        w13_scale: Tensor,
        w2: Tensor,
        w2_scale: Tensor,
        fp8_block: tuple[int, ...],
    ) -> int:
        """Keep the experts as block-wise FP8 (models/moe_fp8_weights.py) and release the
        16-bit w13 / w2; returns the bytes held."""
        if w13.shape != self.w13.shape or w2.shape != self.w2.shape:
            raise ValueError(
                f"FP8 experts {tuple(w13.shape)} / {tuple(w2.shape)} for a block of "
                f"{tuple(self.w13.shape)} / {tuple(self.w2.shape)}"
            )
        device = self.w13.device
        self.fp8_w13, self.fp8_w2 = w13.contiguous().to(device), w2.contiguous().to(device)
        self.fp8_w13_scale = w13_scale.float().contiguous().to(device)
        self.fp8_w2_scale = w2_scale.float().contiguous().to(device)
        self.fp8_block = fp8_block
        for param in (self.w13, self.w2):
            param.data = param.new_zeros(()).expand(param.shape)
        held = (self.fp8_w13, self.fp8_w2, self.fp8_w13_scale, self.fp8_w2_scale)
        return sum(t.nbytes for t in held)

    def forward(self, x: Tensor) -> Tensor:
        topk_weights, topk_ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        if self.fp8_w13 is not None:
            out = run_fp8_experts(
                x,
                self.fp8_w13,
                self.fp8_w2,
                topk_weights,
                topk_ids,
                self.fp8_w13_scale,
                self.fp8_w2_scale,
                self.fp8_block,
            )
        else:
            out = run_experts(x, self.w13, self.w2, topk_weights, topk_ids, self.packed_key)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


@torch.no_grad()
def pack_expert_weights(model: nn.Module) -> None:
    """Hand each expert's weights of `model` to oneDNN in its blocked layout and release the
    plain w13 / w2, of which a block then keeps only the shapes (as models/linear.py's
    pack_weights does for the dense layers, on the same condition)."""
    for module in model.modules():
        if isinstance(module, SparseMoeBlock) and module.packed_key == _NO_PACKED_EXPERTS:
            packed = (
                [pack_expert_weight(w) for w in module.w13],
                [pack_expert_weight(w) for w in module.w2],
            )
            module.packed_key = next(_next_packed_key)
            _PACKED_EXPERTS[module.packed_key] = packed
            weakref.finalize(module, _PACKED_EXPERTS.pop, module.packed_key, None)
            for param in (module.w13, module.w2):
                param.data = param.new_zeros(()).expand(param.shape)


# A checkpoint's per-expert tensor: Mixtral's block_sparse_moe.experts.N.w1/w3/w2 (gate, up,
# down), Qwen-MoE's mlp.experts.N.gate_proj/up_proj/down_proj.
EXPERT_NAME = re.compile(
    r"(?:model\.)?layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)"
    r"\.(?P<part>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight"
)
# part -> (the stacked parameter, which half of its rows: 0 gate, 1 up, None the whole)
EXPERT_PARTS = {
    "w1": ("w13", 0),
    "gate_proj": ("w13", 0),
    "w3": ("w13", 1),
    "up_proj": ("w13", 1),
    "w2": ("w2", None),
    "down_proj": ("w2", None),
}


class ExpertWeightCopy:
    """Copies a checkpoint's per-expert tensors into the MoE blocks' stacked `w13` / `w2`,
    shape-checked, and says which of those parameters every expert has filled."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._filled: dict[str, set[tuple[int, int | None]]] = {}

    def copy(self, hf_name: str, tensor: Tensor) -> bool:
        """Whether `hf_name` is an expert's tensor, then copied into its place."""
        match = EXPERT_NAME.fullmatch(hf_name)
        if match is None:
            return False
        layer, expert = int(match["layer"]), int(match["expert"])
        stacked, half = EXPERT_PARTS[match["part"]]
        layers = self._model.layers
        if layer >= len(layers):
            raise ValueError(f"checkpoint tensor {hf_name!r}: the model has {len(layers)} layers")
        block = layers[layer].mlp
        if not isinstance(block, SparseMoeBlock):
            raise ValueError(f"checkpoint tensor {hf_name!r}: layer {layer} has no experts")
        if expert >= block.num_experts:
            raise ValueError(
                f"checkpoint tensor {hf_name!r}: the model has {block.num_experts} experts"
            )
        target = getattr(block, stacked).data[expert]
        if half is not None:
            size = block.intermediate_size
            target = target[half * size : (half + 1) * size]
        copy_checked(target, tensor, hf_name)
        self._filled.setdefault(f"layers.{layer}.mlp.{stacked}", set()).add((expert, half))
        return True

    def complete(self) -> set[str]:
        """The stacked parameters whose every expert's every part was copied; ValueError
        naming the first missing one where a checkpoint holds only some of a block's."""
        for name, parts in self._filled.items():
            block = self._model.get_submodule(name.rsplit(".", 1)[0])
            halves = (0, 1) if name.endswith("w13") else (None,)
            for expert in range(block.num_experts):
                for half in halves:
                    if (expert, half) not in parts:
                        part = {0: "gate_proj", 1: "up_proj", None: "down_proj"}[half]
                        raise ValueError(
                            f"the checkpoint lacks {name.rsplit('.', 1)[0]}.experts.{expert}"
                            f".{part} (or its w1/w3/w2 name)"
                        )
        return set(self._filled)
