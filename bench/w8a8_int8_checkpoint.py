"""Write an INT8 W8A8 copy of a Hugging Face folder, as llm-compressor's W8A8 recipe saves it.

The benchmarks compare aioserve and vLLM-CPU on the same INT8 checkpoint; llm-compressor is
not installed here (it would pull a CUDA torch), so this script writes its output format
itself: every decoder projection (q/k/v/o, gate/up/down) quantized round-to-nearest with
one symmetric scale per output row, as compressed-tensors' min-max observer computes it
(largest magnitude / 127.5, values clamped to [-128, 127]); `<prefix>.weight` int8 beside
`<prefix>.weight_scale` [N, 1] in the checkpoint's dtype; the embedding, norms and output
head as they were; config.json with the `int-quantized` quantization_config (dynamic int8
activations, a scale a token). No calibration: SmoothQuant and GPTQ are not applied, so the
quality is that of plain round-to-nearest, which is not what this measures.

    python bench/w8a8_int8_checkpoint.py SRC_FOLDER OUT_FOLDER
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantization_config(weight_strategy: str = "channel") -> dict:
    """The `quantization_config` of llm-compressor's W8A8 int8 output: weights with one scale
    a row ("channel") or one a tensor ("tensor"), activations one a token, as they come."""
    scheme = {
        "num_bits": 8,
        "type": "int",
        "symmetric": True,
        "group_size": None,
        "block_structure": None,
        "actorder": None,
        "observer_kwargs": {},
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**scheme, "strategy": weight_strategy, "dynamic": False,
                            "observer": "minmax"},
                "input_activations": {**scheme, "strategy": "token", "dynamic": True,
                                      "observer": None},
                "output_activations": None,
            }
        },
    }  # fmt: skip


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values [N, K] and float32 scales [N, 1] of a weight [N, K]."""
    weight = weight.float()
    scale = (weight.abs().amax(dim=1, keepdim=True) / 127.5).clamp(min=1e-12)
    return torch.round(weight / scale).clamp(-128, 127).to(torch.int8), scale


def convert(src: Path, out: Path) -> int:
    """Write the INT8 copy of `src` into `out`; returns how many layers were quantized."""
    out.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and not path.name.endswith((".safetensors", ".json")):
            shutil.copy2(path, out / path.name)
        elif path.name.endswith(".json") and path.name != "config.json":
            shutil.copy2(path, out / path.name)
    tensors: dict[str, torch.Tensor] = {}
    quantized = 0
    for file in sorted(src.glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
                values, scale = quantize_rows(tensor)
                tensors[name] = values.contiguous()
                tensors[name.removesuffix("weight") + "weight_scale"] = scale.to(tensor.dtype)
                quantized += 1
            else:
                tensors[name] = tensor.contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return quantized


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    print(f"{convert(args.src, args.out)} layers quantized into {args.out}")


if __name__ == "__main__":
    main()
