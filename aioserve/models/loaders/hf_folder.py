"""Weights of a Hugging Face model folder: safetensors files first, PyTorch bins otherwise.

`find_weight_files` picks the files of one format the way transformers saves them (one file,
or shards listed by an index), `iter_weights` yields their tensors one at a time under the
names they were saved with, in their stored dtype, on the CPU. Safetensors are read lazily
tensor by tensor; PyTorch bins are memory-mapped, so neither holds the model in memory.
`weight_names` and `stored_dtype_bytes` say what the files hold (names; bytes per dtype),
from their headers.

`--ignore-patterns` leaves files out of both the format detection and the listing: a file
whose path in the folder matches a pattern is treated as absent (`ignored`: the rule
huggingface_hub applies to the files it downloads). `--pt-load-map-location` is the
map_location of the torch.load that reads PyTorch bins' tensors.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Iterator, Sequence
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open

logger = logging.getLogger("aioserve")

WeightFormat = Literal["safetensors", "pt"]
MapLocation = str | dict[str, str]

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


def ignored(relative: str, patterns: Sequence[str]) -> bool:
    """Whether the file at `relative` (its /-separated path in the model's folder) matches
    one of `patterns`: fnmatch's globs, case-sensitive, * matching / too, a pattern that ends
    in / standing for everything under that folder; huggingface_hub's rule for
    snapshot_download's ignore_patterns, through which vLLM applies --ignore-patterns."""
    return any(fnmatchcase(relative, p + "*" if p.endswith("/") else p) for p in patterns)


def detect_format(folder: Path, ignore_patterns: Sequence[str] = ()) -> WeightFormat | None:
    """safetensors when the folder has any, else pt when it has PyTorch weights, else None;
    ignored files do not count."""
    for fmt in ("safetensors", "pt"):
        if _candidates(folder, fmt, ignore_patterns):
            return fmt
    return None


def weight_files(folder: Path) -> list[Path]:
    """Every safetensors and PyTorch weight file at the top of `folder`, none ignored."""
    return [*_candidates(folder, "safetensors"), *_candidates(folder, "pt")]


def _candidates(folder: Path, fmt: WeightFormat, ignore_patterns: Sequence[str] = ()) -> list[Path]:
    files = {p for pattern in _PATTERNS[fmt] for p in folder.glob(pattern)}
    return sorted(
        p
        for p in files
        if p.name not in _NOT_WEIGHTS
        and not p.name.startswith("rng_state")
        and not ignored(p.name, ignore_patterns)
    )


def find_weight_files(
    folder: Path, fmt: WeightFormat, ignore_patterns: Sequence[str] = ()
) -> list[Path]:
    """The files holding the weights in format `fmt`: the index's shards, the single file,
    or every file of that format; those `ignore_patterns` match left out. Raises ValueError
    when none is left, naming --ignore-patterns when it left out every one."""
    index = folder / _INDEX_FILE[fmt]
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        present = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        present = _candidates(folder, fmt)
    kept = [p for p in present if not ignored(p.relative_to(folder).as_posix(), ignore_patterns)]
    if present and not kept:
        raise ignored_everything(folder, ignore_patterns, present)
    if not kept:
        raise ValueError(f"load format {fmt!r} found no {fmt} weight files in {folder}")
    skipped = [p.relative_to(folder).as_posix() for p in present if p not in kept]
    if skipped:
        log = logger.warning if index.is_file() else logger.info
        where = f"of the shards {index.name} lists" if index.is_file() else "weight files"
        log("--ignore-patterns skips %d %s: %s", len(skipped), where, ", ".join(skipped))
    single = folder / _SINGLE_FILE[fmt]
    return [single] if not index.is_file() and single in kept else kept


def ignored_everything(
    folder: Path, ignore_patterns: Sequence[str], files: list[Path]
) -> ValueError:
    """The error for a folder whose weight files `ignore_patterns` all match."""
    shown = ", ".join(p.relative_to(folder).as_posix() for p in files[:5])
    more = f" and {len(files) - 5} more" if len(files) > 5 else ""
    patterns = " ".join(repr(p) for p in ignore_patterns)
    return ValueError(
        f"--ignore-patterns {patterns} skips every weight file in {folder} ({shown}{more}): "
        "nothing is left to load"
    )


def iter_weights(
    files: list[Path], map_location: MapLocation = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every file, one tensor read at a time: on the CPU
    from safetensors, where torch.load's `map_location` puts them from PyTorch bins."""
    for path in files:
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        else:
            state = torch.load(path, map_location=map_location, weights_only=True, mmap=True)
            yield from state.items()


def check_map_location(map_location: MapLocation) -> None:
    """ValueError naming --pt-load-map-location when it sends tensors to a GPU that this
    machine does not have ("cuda" is the current one, cuda:0 unless set otherwise)."""
    targets = [map_location] if isinstance(map_location, str) else list(map_location.values())
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for target in targets:
        if target != "cpu" and int(target.partition(":")[2] or 0) >= gpus:
            have = f"GPUs cuda:0 to cuda:{gpus - 1}" if gpus else "no GPU"
            raise ValueError(
                f"--pt-load-map-location sends tensors to {target}, but this machine has {have}"
            )


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
