"""Weights of a Hugging Face model folder: safetensors files first, PyTorch bins otherwise.

`find_weight_files` picks the files of one format the way transformers saves them (one file,
or shards listed by an index), `iter_weights` yields their tensors one at a time under the
names they were saved with, in their stored dtype, on the CPU. Safetensors are read lazily
tensor by tensor; PyTorch bins are memory-mapped, so neither holds the model in memory.
`weight_names` and `stored_dtype_bytes` say what the files hold (names; bytes per dtype),
from their headers.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open

WeightFormat = Literal["safetensors", "pt"]

_SINGLE_FILE = {"safetensors": "model.safetensors", "pt": "pytorch_model.bin"}
_INDEX_FILE = {"safetensors": "model.safetensors.index.json", "pt": "pytorch_model.bin.index.json"}
_PATTERNS = {"safetensors": ("*.safetensors",), "pt": ("*.bin", "*.pt")}
# safetensors' dtype codes under torch's names
_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
# training leftovers some repositories ship beside the weights
_NOT_WEIGHTS = {
    "training_args.bin",
    "optimizer.bin",
    "optimizer.pt",
    "scheduler.pt",
    "scaler.pt",
    "trainer_state.pt",
}


def detect_format(folder: Path) -> WeightFormat | None:
    """safetensors when the folder has any, else pt when it has PyTorch weights, else None."""
    for fmt in ("safetensors", "pt"):
        if _candidates(folder, fmt):
            return fmt
    return None


def _candidates(folder: Path, fmt: WeightFormat) -> list[Path]:
    files = {p for pattern in _PATTERNS[fmt] for p in folder.glob(pattern)}
    return sorted(
        p for p in files if p.name not in _NOT_WEIGHTS and not p.name.startswith("rng_state")
    )


def find_weight_files(folder: Path, fmt: WeightFormat) -> list[Path]:
    """The files holding the weights in format `fmt`: the index's shards, the single file,
    or every file of that format. Raises ValueError when there are none."""
    index = folder / _INDEX_FILE[fmt]
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    single = folder / _SINGLE_FILE[fmt]
    if single.is_file():
        return [single]
    files = _candidates(folder, fmt)
    if not files:
        raise ValueError(f"load format {fmt!r} found no {fmt} weight files in {folder}")
    return files


def iter_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every file, one tensor read at a time."""
    for path in files:
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            yield from state.items()


def count_weights(files: list[Path]) -> int:
    """How many tensors `iter_weights(files)` yields, read from headers, not data."""
    return sum(1 for _ in weight_names(files))


def weight_names(files: list[Path]) -> Iterator[str]:
    """The names of the tensors `iter_weights(files)` yields, read from headers, not data."""
    for path in files:
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt", device="cpu") as f:
                yield from f.keys()
        else:
            yield from torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def stored_dtype_bytes(files: list[Path]) -> dict[str, int]:
    """Bytes of the tensors of `files` per stored dtype (torch's name), from the safetensors
    headers or the memory-mapped bins: no tensor data is read."""
    sizes: dict[str, int] = {}
    for path in files:
        if path.suffix == ".safetensors":
            for entry in _safetensors_header(path).values():
                dtype = _SAFETENSORS_DTYPES.get(entry["dtype"], entry["dtype"])
                start, end = entry["data_offsets"]
                sizes[dtype] = sizes.get(dtype, 0) + end - start
        else:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            for tensor in state.values():
                dtype = str(tensor.dtype).removeprefix("torch.")
                sizes[dtype] = sizes.get(dtype, 0) + tensor.nbytes
    return sizes


def _safetensors_header(path: Path) -> dict[str, dict]:
    """The tensor entries of a safetensors file: an 8-byte little-endian length, then JSON."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header
