"""Our GGUF header reader against gguf-py's GGUFReader, the package's own reading of the format.

Every metadata value and every tensor (name, type, shape, bytes) must read the same, on
the default model's file and on a file written by gguf-py's GGUFWriter with a value of
each type, arrays of numbers and of strings, and a data alignment other than the default.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf.quants import quantize as gguf_quantize

from aioserve.models.loaders.gguf_header import GGUFHeader


def gguf_py_value(field: gguf.ReaderField) -> object:
    """A field as gguf-py reads it, in Python values (float32 as its shortest decimal)."""
    kind = field.types[-1]

    def convert(part: np.ndarray) -> object:
        if kind == gguf.GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        if kind == gguf.GGUFValueType.FLOAT32:
            return float(str(part[0]))
        return part[0].item()

    values = [convert(field.parts[i]) for i in field.data]
    return values if field.types[0] == gguf.GGUFValueType.ARRAY else values[0]


def assert_reads_as_gguf_py(path) -> GGUFHeader:
    ours = GGUFHeader(path)
    theirs = gguf.GGUFReader(path)
    expected = {
        key: gguf_py_value(field)
        for key, field in theirs.fields.items()
        if not key.startswith("GGUF.")  # gguf-py's own entries for the file's counts
    }
    assert ours.metadata.keys() == expected.keys()
    for key, value in expected.items():
        assert ours.metadata[key] == value, key
        assert type(ours.metadata[key]) is type(value), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.qtype == reference.tensor_type, mine.name
        assert mine.shape == tuple(reversed(reference.shape.tolist())), mine.name
        assert mine.n_bytes == reference.n_bytes, mine.name
        assert np.array_equal(mine.raw.reshape(-1), reference.data.view(np.uint8).reshape(-1))
    return ours


def test_the_default_model_reads_as_gguf_py_reads_it(smollm2_gguf):
    header = assert_reads_as_gguf_py(smollm2_gguf)
    assert len(header.metadata["tokenizer.ggml.tokens"]) == 49152
    assert len(header.tensors) == 272


def test_every_value_type_and_an_unusual_alignment(tmp_path):
    path = tmp_path / "types.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 65000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 1e-5)
    writer.add_uint64("t.u64", 2**60)
    writer.add_int64("t.i64", -(2**60))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "ünïcödé ✓")
    writer.add_array("t.ints", [3, 1, 4, 1, 5])
    writer.add_array("t.floats", [0.5, 1e-6])
    writer.add_array("t.strings", ["a", "", "ß"])
    writer.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    writer.add_tensor("odd", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("half", rng.standard_normal((2, 7)).astype(np.float16))
    quantized = gguf_quantize(
        rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0
    )
    writer.add_tensor("q8", quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    header = assert_reads_as_gguf_py(path)
    assert header.metadata["t.f32"] == 1e-5 and header.metadata["t.strings"] == ["a", "", "ß"]
    assert header.tensors[2].raw.shape == (4, 2 * 34)  # two Q8_0 blocks of 34 bytes a row


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "not.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFHeader(path)
