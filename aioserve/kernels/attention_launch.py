"""The launch tables of the paged-attention Triton kernels (attention_triton.py): tile sizes,
warps, pipeline stages and decode segments per platform and GPU family
(platform.launch_entry), fixed, never tuned at run time.
"""

from __future__ import annotations

from aioserve.platform import launch_entry

# Per platform, for head sizes up to 128: rows (query tokens x GQA group) of a prefill
# tile, keys per step of the prefill and decode loops, warps, pipeline stages and the keys
# of one decode segment (a fixed size: how a decode splits depends on its length only,
# never on its batch); wider
# heads take the smaller tiles of _WIDE_HEAD_CONFIG. These must not depend on the batch,
# or batch invariance is lost. The GPU entries are the largest tiles that compile without
# a register spill at head sizes 64, 128 and 256 and GQA groups 1 to 8 for a member of
# each family (tests/kernels/test_gpu_compile.py checks it): "cuda" for sm_90a and sm_80,
# "rocm" for gfx942 and gfx90a (whose fp8 prefills at head size 256 take smaller tiles).
# On RDNA3 (gfx1100, wavefronts of 32 lanes) "rocm"'s tiles spilled up to 484 bytes at
# head size 128; its row spills nothing up to head size 128 in 16 bits, but head size 256
# and fp8 keys spill at every tile tried (16 x 16 rows and keys, 4 to 16 warps: 66-260
# bytes), which the compile test records as known. Timed on an H100 (bench/RESULTS.md,
# GPU), not yet tuned there; the other families have not run.
_CONFIG: dict[str, dict[str, int]] = {
    "cuda": {"block_m": 64, "block_n": 32, "decode_block_n": 64, "num_warps": 8, "num_stages": 2,
             "decode_segment": 256},
    "rocm": {"block_m": 64, "block_n": 32, "decode_block_n": 64, "num_warps": 4, "num_stages": 1,
             "decode_segment": 256},
    "rdna3": {"block_m": 64, "block_n": 16, "decode_block_n": 16, "num_warps": 8, "num_stages": 1,
              "decode_segment": 256},
    "cpu": {"block_m": 16, "block_n": 16, "decode_block_n": 16, "num_warps": 1, "num_stages": 1,
            "decode_segment": 32},
}  # fmt: skip
_WIDE_HEAD_CONFIG: dict[str, dict[str, int]] = {
    "cuda": {"block_m": 32, "block_n": 16, "decode_block_n": 32, "num_warps": 8, "num_stages": 2,
             "decode_segment": 256},
    "rocm": {"block_m": 64, "block_n": 16, "decode_block_n": 32, "num_warps": 8, "num_stages": 1,
             "decode_segment": 256},
    "cdna2": {"block_m": 32, "block_n": 16, "decode_block_n": 32, "num_warps": 8, "num_stages": 1,
              "decode_segment": 256},
    "rdna3": {"block_m": 16, "block_n": 16, "decode_block_n": 16, "num_warps": 8, "num_stages": 1,
              "decode_segment": 256},
    "cpu": {"block_m": 16, "block_n": 16, "decode_block_n": 16, "num_warps": 2, "num_stages": 1,
            "decode_segment": 32},
}  # fmt: skip
# tl.dot needs at least 16 rows, columns and reduction depth on every GPU target.
MIN_DOT = 16


def launch_config(head_block: int, kv_fp8: bool) -> dict[str, int]:
    """The launch table entry for a head of `head_block` lanes (a power of two), on this
    platform, for a bfloat16/float16 or an fp8 KV cache."""
    table = _WIDE_HEAD_CONFIG if head_block > 128 else _CONFIG
    config = dict(launch_entry(table))
    if kv_fp8 and head_block > 128:
        # fp8 keys converted in registers: the decode's tiles of 32 keys spilled (sm_90a).
        config["decode_block_n"] = min(config["decode_block_n"], 16)
    return config
