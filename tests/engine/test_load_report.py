"""The load report behind the server's ready line, built from real loaded objects: a tiny
random-weight model in a ModelRunner, its safetensors checkpoint, the default model's GGUF.
Every figure must be the tensors' own bytes, not an estimate."""

from __future__ import annotations

import mmap
import os
import re

import pytest
import torch
from gguf import GGUFReader

from aioserve.config.engine import CacheConfig
from aioserve.engine.load_report import (
    build_load_report,
    format_bytes,
    kv_cache_sized_by,
    resident_memory_bytes,
)
from aioserve.kernels.gguf_linear_reference import fits_int4, pack_int4
from aioserve.models.checkpoint import open_checkpoint
from aioserve.models.linear import INT4_MAX_ROWS, Linear, onednn_packs
from tests.runner.plans import tiny_runner


def _kv_nbytes(runner) -> int:
    return sum(k.nbytes + v.nbytes for k, v in runner.kv_caches)


def test_the_report_counts_the_loaded_tensors_and_the_kv_cache(tmp_path):
    hf, runner = tiny_runner(num_blocks=64, block_size=4)
    hf.save_pretrained(tmp_path)
    checkpoint = open_checkpoint(str(tmp_path))
    report = build_load_report("tiny", checkpoint, runner, "VLLM_CPU_KVCACHE_SPACE (4 GiB)")

    stored = sum(t.nbytes for t in hf.state_dict().values())
    assert report.load_format == "safetensors"
    assert report.stored_types == (("float32", stored),)
    assert report.dtype == "float32"
    assert report.weight_bytes == sum(p.nbytes for p in runner.model.parameters())
    assert (report.row_copy_bytes, report.row_copy_dtype) == (0, None)
    assert report.kv_cache_bytes == _kv_nbytes(runner)
    assert (report.num_blocks, report.block_size, report.kv_cache_dtype) == (64, 4, "float32")

    line = report.describe()
    assert line.startswith(
        f"tiny, safetensors float32 weights ({format_bytes(stored)} on disk) held in float32: "
        f"{format_bytes(report.weight_bytes)}; KV cache {format_bytes(report.kv_cache_bytes)} "
    )
    assert line.endswith("(float32, 64 blocks of 4 tokens), set by VLLM_CPU_KVCACHE_SPACE (4 GiB)")
    assert "copies" not in line


def test_row_weight_copies_are_counted_apart_from_the_weights(smollm2_gguf):
    # A tied head: the copies are every Linear's row_weight and the head's head_row_weight.
    _, runner = tiny_runner(
        "qwen2-tied", compile_model=True, row_weight_dtype=torch.bfloat16, num_blocks=32
    )
    model = runner.model
    copies = [m.row_weight for m in model.modules() if isinstance(m, Linear)]
    copies.append(model.head_row_weight)
    report = build_load_report(
        "SmolLM2", open_checkpoint(str(smollm2_gguf)), runner, "--num-gpu-blocks-override 32"
    )

    assert report.weight_bytes == sum(p.nbytes for p in model.parameters())
    assert report.row_copy_bytes == sum(c.nbytes for c in copies) > 0
    assert report.row_copy_dtype == "bfloat16"
    assert report.kv_cache_bytes == _kv_nbytes(runner)
    assert (report.num_blocks, report.block_size) == (32, 4)
    # What a GGUF checkpoint's weights are on disk, and that they are dequantized.
    assert re.fullmatch(
        r"SmolLM2, GGUF Q4_1( \+ \w+)* weights \(\d+ MiB on disk\) dequantized to float32: "
        r"[\d.]+ [KM]iB, plus [\d.]+ [KM]iB of bfloat16 copies for one-row products; "
        r"KV cache [\d.]+ [KM]iB \(float32, 32 blocks of 4 tokens\), "
        r"set by --num-gpu-blocks-override 32",
        report.describe(),
    ), report.describe()


@pytest.mark.skipif(
    not onednn_packs(torch.bfloat16), reason="this CPU's oneDNN has no bfloat16 packed products"
)
def test_packed_weights_count_once_and_the_heads_packed_copy_apart(smollm2_gguf):
    # Each Linear's packed weight replaces its plain one (counted once, by its parameter's
    # shape); the tied head's packed copy of the embedding table is memory of its own.
    _, runner = tiny_runner("qwen2-tied", dtype=torch.bfloat16, packed_weights=True, num_blocks=32)
    model = runner.model
    report = build_load_report(
        "SmolLM2", open_checkpoint(str(smollm2_gguf)), runner, "--num-gpu-blocks-override 32"
    )
    assert report.weight_bytes == sum(p.nbytes for p in model.parameters())
    assert report.packed
    assert report.packed_copy_bytes == model.embed_tokens.weight.nbytes
    assert f"dequantized to bfloat16: {format_bytes(report.weight_bytes)}, the dense " in (
        report.describe()
    )
    assert (
        f"layers' packed for oneDNN, plus {format_bytes(report.packed_copy_bytes)} of the "
        "head's packed copy; KV cache" in report.describe()
    ), report.describe()


@pytest.mark.skipif(
    not onednn_packs(torch.bfloat16), reason="this CPU's oneDNN has no bfloat16 packed products"
)
def test_4bit_weights_kept_as_stored_are_counted_apart(smollm2_gguf):
    _, runner = tiny_runner("qwen2-tied", dtype=torch.bfloat16, packed_weights=True, num_blocks=32)
    model = runner.model
    kept = [m for m in model.modules() if isinstance(m, Linear) and fits_int4(*m.weight.shape)]
    assert kept
    for module in kept:  # as models/gguf_weights.py leaves them
        rows, cols = module.weight.shape
        codes = torch.zeros(rows, cols, dtype=torch.uint8)
        scale = torch.ones(rows, cols // 32)
        module.int4_weight, module.int4_scales_and_zeros = pack_int4(codes, scale, scale)
    report = build_load_report(
        "SmolLM2", open_checkpoint(str(smollm2_gguf)), runner, "--num-gpu-blocks-override 32"
    )
    int4_bytes = sum(m.int4_weight.nbytes + m.int4_scales_and_zeros.nbytes for m in kept)
    assert report.int4_bytes == int4_bytes
    assert report.weight_bytes == sum(p.nbytes for p in model.parameters())
    assert (
        f", plus {format_bytes(int4_bytes)} of the 4-bit layers as stored, for steps of up "
        f"to {INT4_MAX_ROWS} rows; KV cache" in report.describe()
    ), report.describe()


def test_blocks_kept_in_place_of_weights_are_counted_instead_of_them(smollm2_gguf):
    # On a GPU (models/gguf_weights.py `keep_gguf_blocks`): the float weight is released.
    _, runner = tiny_runner("qwen2-tied", num_blocks=32)
    model = runner.model
    all_params = sum(p.nbytes for p in model.parameters())
    kept = [m for m in model.modules() if isinstance(m, Linear) and m.in_features % 32 == 0]
    assert kept
    released = sum(m.weight.nbytes for m in kept)
    for module in kept:
        rows, cols = module.weight.shape
        module.gguf_blocks = torch.zeros(rows, cols // 32 * 20, dtype=torch.uint8)
        module.gguf_qtype = "q4_1"
        module.weight.data = module.weight.new_zeros(()).expand(rows, cols)
    report = build_load_report(
        "SmolLM2", open_checkpoint(str(smollm2_gguf)), runner, "--num-gpu-blocks-override 32"
    )
    blocks = sum(m.gguf_blocks.nbytes for m in kept)
    assert report.kept_blocks_bytes == blocks
    assert report.weight_bytes == all_params - released
    assert (
        f"weights ({format_bytes(sum(size for _, size in report.stored_types))} on disk), the "
        f"quantized layers kept as stored ({format_bytes(blocks)}), the rest dequantized to "
        f"float32: {format_bytes(report.weight_bytes)}; KV cache" in report.describe()
    ), report.describe()


def test_a_gguf_checkpoint_names_its_stored_types_with_their_bytes(smollm2_gguf):
    expected: dict[str, int] = {}
    for tensor in GGUFReader(smollm2_gguf).tensors:
        name = tensor.tensor_type.name
        expected[name] = expected.get(name, 0) + int(tensor.n_bytes)
    stored = open_checkpoint(str(smollm2_gguf)).stored_weight_types()
    assert stored == expected
    assert next(iter(stored)) == "Q4_1"  # largest first: the default model is a Q4_1 GGUF
    assert list(stored.values()) == sorted(stored.values(), reverse=True)


def test_folder_checkpoints_name_their_stored_dtypes(tmp_path):
    hf, _ = tiny_runner(num_blocks=8)
    state = hf.to(torch.bfloat16).state_dict()
    hf.save_pretrained(tmp_path / "st")
    hf.config.save_pretrained(tmp_path / "pt")
    torch.save(state, tmp_path / "pt" / "pytorch_model.bin")
    stored = sum(t.nbytes for t in state.values())
    for folder, load_format in (("st", "safetensors"), ("pt", "pt")):
        checkpoint = open_checkpoint(str(tmp_path / folder))
        assert checkpoint.load_format == load_format
        assert checkpoint.stored_weight_types() == {"bfloat16": stored}
    dummy = open_checkpoint(str(tmp_path / "st"), load_format="dummy")
    assert dummy.stored_weight_types() == {}


def _cache(**changes) -> CacheConfig:
    values = dict(
        block_size=16,
        gpu_memory_utilization=0.9,
        num_gpu_blocks_override=None,
        enable_prefix_caching=True,
        cpu_kvcache_space_bytes=4 * 2**30,
    )
    return CacheConfig(**{**values, **changes})


@pytest.mark.parametrize(
    ("cache", "platform", "knob"),
    [
        (_cache(), "cpu", "VLLM_CPU_KVCACHE_SPACE (4 GiB, the default)"),
        (_cache(cpu_kvcache_space_bytes=2**29), "cpu", "VLLM_CPU_KVCACHE_SPACE (0.5 GiB)"),
        (_cache(num_gpu_blocks_override=100), "cpu", "--num-gpu-blocks-override 100"),
        (_cache(num_gpu_blocks_override=100), "cuda", "--num-gpu-blocks-override 100"),
        (_cache(gpu_memory_utilization=0.5), "cuda", "--gpu-memory-utilization 0.5"),
        (_cache(), "rocm", "--gpu-memory-utilization 0.9"),
        (_cache(kv_cache_memory_bytes=2**30), "cuda", "--kv-cache-memory-bytes (1.00 GiB)"),
        (
            _cache(kv_cache_memory_bytes=2**29, cpu_kvcache_space_bytes=2**29),
            "cpu",
            "--kv-cache-memory-bytes (512 MiB)",
        ),
        # VLLM_CPU_KVCACHE_SPACE set beside the flag wins on the CPU (vLLM 0.32's rule).
        (_cache(kv_cache_memory_bytes=2**29), "cpu", "VLLM_CPU_KVCACHE_SPACE (4 GiB, the default)"),
    ],
)
def test_the_knob_that_sized_the_kv_cache_is_named(cache, platform, knob):
    assert kv_cache_sized_by(cache, platform) == knob


def _statm_resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux's /proc")
def test_resident_memory_is_the_process_rss_and_follows_allocations():
    rss = resident_memory_bytes()
    assert rss is not None and rss > 0
    assert abs(rss - _statm_resident_bytes()) < 16 * 2**20
    # Fresh pages from the kernel, every one written: a malloc'd array (np.ones) may reuse
    # heap pages already resident, and then the RSS does not move (it failed so in CI).
    size = 64 * 2**20
    held = mmap.mmap(-1, size)
    held.write(b"\x01" * size)
    grown = resident_memory_bytes()
    assert grown - rss > 60 * 2**20
    assert abs(grown - _statm_resident_bytes()) < 16 * 2**20
    held.close()


@pytest.mark.parametrize(
    ("size", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1536, "1.5 KiB"),
        (538 * 2**20 + 1000, "538 MiB"),
        (4 * 2**30 - 2**20, "4.00 GiB"),
        (5 * 2**30 + 2**29, "5.50 GiB"),
    ],
)
def test_sizes_are_written_in_binary_units(size, text):
    assert format_bytes(size) == text
