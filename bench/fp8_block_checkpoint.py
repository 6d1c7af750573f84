"""Write a 16-bit Hugging Face folder's block-wise FP8 copy, as Qwen3's `-FP8` checkpoints
are: every decoder projection (attention, MLP, each expert's gate/up/down; not the
embeddings, the output head, the norms or a MoE router) in float8_e4m3fn with a float32
`weight_scale_inv` a 128 × 128 block, `quantization_config` {"quant_method": "fp8",
"fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}, the other
tensors and files as they were. For side-by-side runs of FP8 checkpoints:

    python bench/fp8_block_checkpoint.py SOURCE_FOLDER OUT_FOLDER

Then, from the checkout: bash bench/side_by_side_checkpoint.sh bench/results/NAME OUT_FOLDER
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from aioserve.kernels.fp8_block_linear_reference import quantize_weight_blocks

BLOCK = (128, 128)
# A decoder projection's weight: q/k/v/o, gate/up/down (an expert's too), Mixtral's w1/w2/w3.
_PROJECTION = re.compile(
    r".*\.(q|k|v|o|gate|up|down)_proj\.weight|.*\.experts\.\d+\.w[123]\.weight"
)


def quantized_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` with each projection's weight as e4m3 values beside its block scales."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if _PROJECTION.fullmatch(name) and tensor.dim() == 2:
            values, scales = quantize_weight_blocks(tensor, BLOCK, torch.float8_e4m3fn)
            out[name] = values
            out[name.removesuffix("weight") + "weight_scale_inv"] = scales
        else:
            out[name] = tensor
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for path in args.source.iterdir():
        if path.suffix == ".safetensors":
            save_file(quantized_tensors(load_file(str(path))), str(args.out / path.name))
        elif path.name == "model.safetensors.index.json":
            index = json.loads(path.read_text())
            weight_map = index["weight_map"]
            for name, file in list(weight_map.items()):
                if _PROJECTION.fullmatch(name):
                    weight_map[name.removesuffix("weight") + "weight_scale_inv"] = file
            (args.out / path.name).write_text(json.dumps(index, indent=2))
        elif path.is_file():
            shutil.copy(path, args.out / path.name)
    config_path = args.out / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
    }
    config_path.write_text(json.dumps(config, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
