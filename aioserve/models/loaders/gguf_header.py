"""A GGUF file's header read in one pass: its metadata as Python values, its tensors' directory.

gguf-py's GGUFReader builds a numpy view for every element of every metadata array, and a
tokenizer's vocabulary and merges are arrays of some 100,000 strings: 2.5–4 s on a 2-core
CPU before a model can even be sized. This reader walks the same layout with `struct`
(little-endian files, GGUF versions 2 and 3) and reads number arrays with numpy at once:
a few tens of milliseconds. Tensor data stays in the file: each tensor's bytes are a
copy-on-write memory map (writable for torch; the file is never touched), shaped as
`gguf.quants.dequantize` takes them.

Layout (llama.cpp's gguf.md): magic "GGUF", version (u32), tensor count (u64), metadata
count (u64); each metadata entry a key (string: u64 length + UTF-8 bytes), a value type
(u32) and a value (an array: element type u32, count u64, elements); each tensor a name,
its number of dimensions (u32), its dimensions (u64 each, innermost first), its type (u32)
and its offset (u64) from the data section, which starts at the next multiple of
`general.alignment` (32 unless set) after the directory.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
_FLOAT32 = 6
# GGUF value types of fixed size, as numpy dtypes (little-endian).
_NUMBERS: dict[int, np.dtype] = {
    0: np.dtype("<u1"),
    1: np.dtype("<i1"),
    2: np.dtype("<u2"),
    3: np.dtype("<i2"),
    4: np.dtype("<u4"),
    5: np.dtype("<i4"),
    6: np.dtype("<f4"),
    7: np.dtype("?"),
    10: np.dtype("<u8"),
    11: np.dtype("<i8"),
    12: np.dtype("<f8"),
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: its type, its shape (outermost first) and its bytes."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    raw: np.ndarray
    """uint8 [*shape[:-1], bytes per row]: a copy-on-write map of the file's bytes."""

    @property
    def n_bytes(self) -> int:
        return self.raw.nbytes


class GGUFHeader:
    """`metadata` (key → str, int, float, bool or a list of those) and `tensors`, in file order."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = np.memmap(self.path, dtype=np.uint8, mode="c")
        self._view = memoryview(self._file)
        self._pos = 0
        if bytes(self._view[:4]) != _MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (no GGUF magic)")
        self._pos = 4
        version = self._unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        num_tensors, num_metadata = self._unpack("<Q"), self._unpack("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(num_metadata):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("<I"))
        directory = [self._tensor_entry() for _ in range(num_tensors)]
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(data_start, *entry) for entry in directory]

    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._view, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._unpack("<Q")
        text = bytes(self._view[self._pos : self._pos + length]).decode("utf-8")
        self._pos += length
        return text

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            return self._array()
        if kind not in _NUMBERS:
            raise ValueError(f"{self.path}: unknown GGUF value type {kind}")
        dtype = _NUMBERS[kind]
        value = np.frombuffer(self._view, dtype, 1, self._pos)[0]
        self._pos += dtype.itemsize
        return _python(value, kind)

    def _array(self) -> list[Any]:
        kind, count = self._unpack("<I"), self._unpack("<Q")
        if kind == _STRING:
            return [self._string() for _ in range(count)]
        if kind not in _NUMBERS:
            raise ValueError(f"{self.path}: GGUF arrays of value type {kind} are not supported")
        dtype = _NUMBERS[kind]
        values = np.frombuffer(self._view, dtype, count, self._pos)
        self._pos += dtype.itemsize * count
        if kind == _FLOAT32:
            return [_python(v, kind) for v in values]
        return values.tolist()

    def _tensor_entry(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        num_dims = self._unpack("<I")
        dims = struct.unpack_from(f"<{num_dims}Q", self._view, self._pos)
        self._pos += 8 * num_dims
        qtype, offset = self._unpack("<I"), self._unpack("<Q")
        return name, tuple(reversed(dims)), qtype, offset

    def _tensor(
        self, data_start: int, name: str, shape: tuple[int, ...], qtype: int, offset: int
    ) -> TensorInfo:
        kind = GGMLQuantizationType(qtype)
        block_size, type_size = GGML_QUANT_SIZES[kind]
        row_bytes = shape[-1] // block_size * type_size
        rows = int(np.prod(shape[:-1], dtype=np.int64))
        start = data_start + offset
        raw = self._file[start : start + rows * row_bytes]
        if raw.nbytes != rows * row_bytes:
            raise ValueError(f"{self.path}: tensor {name} runs past the end of the file")
        return TensorInfo(name, kind, shape, raw.reshape(*shape[:-1], row_bytes))


def _python(value: np.generic, kind: int) -> Any:
    """A numpy scalar as Python; float32 as the shortest decimal that round-trips, so that
    an rms_norm_eps written from 1e-05 reads as 1e-05, not 9.999999747378752e-06."""
    if kind == _FLOAT32:
        return float(str(value))
    return value.item()
