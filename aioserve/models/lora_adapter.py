"""LoRA adapters read from PEFT folders, checked against the model they will run on.

A PEFT folder holds `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`, per-module
`rank_pattern` / `alpha_pattern`, ...) and `adapter_model.safetensors` (or `.bin`), whose
tensors are named after the HF modules they adapt: `base_model.model.model.layers.0.
self_attn.q_proj.lora_A.weight` [r, in] and `...lora_B.weight` [out, r]. A layer's output
then gains (x Aᵀ) Bᵀ · scaling, where scaling is alpha / r (alpha / √r with rsLoRA).

The model stacks some HF modules into one layer (q/k/v into `qkv_proj`, gate/up into
`gate_up_proj`); an adapter's module is one slice of such a layer, found with the model's
own `parameter_for`. What comes out (`LoRAAdapter`) is per layer of the model, per slice,
the pair (A, B · scaling) in the LoRA dtype, or None for a slice the adapter leaves alone.

The checks are vLLM 0.32's (vllm/lora/peft_helper.py): DoRA, LoRA biases, aLoRA, layer
replication, modules_to_save and inits that change the base weights are refused, as are a
rank above --max-lora-rank and modules the model cannot adapt.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from aioserve.models.linear import Linear

# The model layers an adapter may reach: attention's and the MLP's dense layers.
LORA_LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

_TENSOR_NAME = re.compile(
    r"base_model\.model\.(?P<module>.+)\.lora_(?P<kind>[AB])(?:\.default)?\.weight"
)
_EXPERTS = re.compile(r"\.experts(\.|$)")
_EMBEDDINGS_OR_HEAD = re.compile(r"(^|\.)(embed_tokens|lm_head)(\.|$)")
# PEFT's inits that only set starting values; the others change the base weights.
_PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served: its folder, its config or its tensors."""


class NoAdapterError(LoRAAdapterError):
    """No adapter at the path: no folder, or no adapter_config.json in it."""


@dataclass(frozen=True)
class LoRATarget:
    """A model layer that takes LoRA: its input width and its slices' output columns."""

    in_features: int
    slice_bounds: tuple[int, ...]  # slice i is output columns bounds[i]..bounds[i+1]


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter's weights, per model layer, per slice: (A [r, in], B · scaling [out, r])."""

    path: str
    rank: int  # its largest rank
    layers: dict[str, tuple[tuple[Tensor, Tensor] | None, ...]]

    @property
    def nbytes(self) -> int:
        return sum(
            a.nbytes + b.nbytes for pairs in self.layers.values() for a, b in filter(None, pairs)
        )


def lora_targets(model: nn.Module) -> dict[str, LoRATarget]:
    """The model's layers an adapter may reach, by module name ("layers.0.self_attn.qkv_proj")."""
    targets = {}
    for name, module in model.named_modules():
        if isinstance(module, Linear) and name.rsplit(".", 1)[-1] in LORA_LAYERS:
            shards = model.shard_count(name + ".weight")
            if shards == 1:
                bounds = (0, module.out_features)
            else:
                rows = [model.shard_rows(name + ".weight", i) for i in range(shards)]
                bounds = tuple(start for start, _ in rows) + (module.out_features,)
            targets[name] = LoRATarget(module.in_features, bounds)
    return targets


def read_lora_adapter(
    path: str, model: nn.Module, max_rank: int, dtype: torch.dtype
) -> LoRAAdapter:
    """The adapter of the PEFT folder `path`, fit for `model`; LoRAAdapterError if not."""
    folder = Path(path)
    config = _read_config(folder)
    rank_of = _rank_and_scaling(config)
    largest = max([config["r"], *config.get("rank_pattern", {}).values()])
    if largest > max_rank:
        raise LoRAAdapterError(f"LoRA rank {largest} is greater than max_lora_rank {max_rank}.")
    tensors = _read_tensors(folder)
    targets = lora_targets(model)
    pairs: dict[str, dict[str, Tensor]] = {}
    unexpected = []
    for tensor_name, tensor in tensors.items():
        match = _TENSOR_NAME.fullmatch(tensor_name)
        place = model.parameter_for(match["module"] + ".weight") if match else None
        layer = place[0].removesuffix(".weight") if place else None
        if layer not in targets:
            unexpected.append(match["module"] if match else tensor_name)
            continue
        pairs.setdefault(match["module"], {})[match["kind"]] = tensor
    head_or_embeddings = sorted({m for m in unexpected if _EMBEDDINGS_OR_HEAD.search(m)})
    if head_or_embeddings:
        raise LoRAAdapterError(
            f"{path} adapts {head_or_embeddings}: LoRA on the embeddings or the output head "
            f"is not supported by aioserve yet (it adapts {sorted(_hf_module_names(model))})"
        )
    experts = sorted({m for m in unexpected if _EXPERTS.search(m)})
    if experts:
        raise LoRAAdapterError(
            f"{path} adapts a mixture-of-experts model's experts ({experts[0]}, ...): LoRA on "
            "experts is not supported by aioserve yet (attention and shared layers are)"
        )
    if unexpected:
        raise LoRAAdapterError(
            f"While loading {path}, expected target modules in "
            f"{sorted(_hf_module_names(model))} but received {sorted(set(unexpected))}. "
            "Please verify that the loaded LoRA module is correct"
        )
    layers: dict[str, list[tuple[Tensor, Tensor] | None]] = {}
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise LoRAAdapterError(f"{path}: {module} has no {missing} weight")
        layer, shard = model.parameter_for(module + ".weight")
        layer = layer.removesuffix(".weight")
        target = targets[layer]
        shard = shard or 0
        out = target.slice_bounds[shard + 1] - target.slice_bounds[shard]
        rank, scaling = rank_of(module)
        a, b = pair["A"], pair["B"]
        if tuple(a.shape) != (rank, target.in_features) or tuple(b.shape) != (out, rank):
            raise LoRAAdapterError(
                f"{path}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                f"rank {rank} on this model wants {(rank, target.in_features)} and {(out, rank)}"
            )
        slices = layers.setdefault(layer, [None] * (len(target.slice_bounds) - 1))
        slices[shard] = (a.to(dtype).contiguous(), (b.float() * scaling).to(dtype).contiguous())
    if not layers:
        raise LoRAAdapterError(f"{path}: the adapter has no LoRA weights")
    return LoRAAdapter(str(folder), largest, {k: tuple(v) for k, v in layers.items()})


def _hf_module_names(model: nn.Module) -> set[str]:
    """The HF modules (q_proj, ...) of the layers LoRA reaches, stacked or not."""
    stacked = getattr(model, "stacked_params", {})
    stacked_layers = {layer.strip(".") for layer, _ in stacked.values()}
    return {fragment.strip(".") for fragment in stacked} | (set(LORA_LAYERS) - stacked_layers)


def _read_config(folder: Path) -> dict[str, Any]:
    config_path = folder / "adapter_config.json"
    try:
        config = json.loads(config_path.read_text())
    except (FileNotFoundError, NotADirectoryError):
        raise NoAdapterError(f"No adapter found for {folder}") from None
    except (OSError, json.JSONDecodeError) as error:
        raise LoRAAdapterError(f"{config_path} cannot be read: {error}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{config_path} does not hold a JSON object")
    missing = {"r", "lora_alpha", "target_modules"} - set(config)
    if missing:
        raise LoRAAdapterError(f"Missing required configuration fields: {missing}")
    problems = _unsupported_features(config)
    if problems:
        raise LoRAAdapterError(" ".join(problems))
    if not isinstance(config["r"], int) or config["r"] <= 0:
        raise LoRAAdapterError(f"LoRA rank `r` must be a positive integer, got {config['r']}.")
    for key, rank in (config.get("rank_pattern") or {}).items():
        if not isinstance(rank, int) or rank <= 0:
            raise LoRAAdapterError(
                f"LoRA rank for `{key}` in `rank_pattern` must be a positive integer, got {rank}."
            )
    return config


def _unsupported_features(config: dict[str, Any]) -> list[str]:
    """vLLM's refusals of PEFT features that change what an adapter computes."""
    problems = []
    saved = [m for m in config.get("modules_to_save") or () if m not in ("classifier", "score")]
    if saved:
        problems.append(
            "vLLM only supports modules_to_save being either None or "
            f'["classifier", "score"] for classification models. Unsupported '
            f"modules_to_save: {saved}"
        )
    if config.get("use_dora"):
        problems.append("vLLM does not yet support DoRA.")
    if config.get("lora_bias"):
        problems.append("vLLM does not support LoRA bias (lora_bias).")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in _PLAIN_INITS:
        problems.append(
            f"vLLM does not support init_lora_weights={init!r}: it modifies the base "
            "model weights when PEFT loads the adapter."
        )
    if config.get("alora_invocation_tokens"):
        problems.append("vLLM does not support Activated LoRA (aLoRA).")
    if config.get("layer_replication"):
        problems.append("vLLM does not support layer_replication.")
    if config.get("use_bdlora"):
        problems.append("vLLM does not support block-diagonal LoRA (BD-LoRA).")
    if config.get("use_qalora"):
        problems.append("vLLM does not support QALoRA.")
    if config.get("bias", "none") != "none":
        problems.append("Adapter bias is not supported.")
    return problems


def _rank_and_scaling(config: dict[str, Any]):
    """module name -> (its rank, its scaling), PEFT's rule: a pattern key matches a name
    ending in it at a "." boundary, the first match wins."""
    rslora = bool(config.get("use_rslora"))
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}

    def matching(pattern: dict[str, Any], name: str) -> Any:
        for key, value in pattern.items():
            if re.match(rf"(.*\.)?({key})$", name):
                return value
        return None

    def rank_and_scaling(module: str) -> tuple[int, float]:
        name = module.removeprefix("base_model.model.")
        rank = matching(rank_pattern, name) or config["r"]
        alpha = matching(alpha_pattern, name) or config["lora_alpha"]
        return rank, alpha / (math.sqrt(rank) if rslora else rank)

    return rank_and_scaling


def _read_tensors(folder: Path) -> dict[str, Tensor]:
    safetensors_file = folder / "adapter_model.safetensors"
    bin_file = folder / "adapter_model.bin"
    try:
        if safetensors_file.is_file():
            from safetensors.torch import load_file

            return load_file(safetensors_file)
        if bin_file.is_file():
            return torch.load(bin_file, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - any unreadable file is the adapter's fault
        raise LoRAAdapterError(f"{folder}: the adapter's weights cannot be read: {error}") from None
    raise LoRAAdapterError(f"{folder} has no adapter_model.safetensors nor adapter_model.bin")
