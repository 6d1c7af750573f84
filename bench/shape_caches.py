"""What torch's bfloat16 kernels keep per shape on this CPU: resident memory over many shapes.

On CPUs with bfloat16 instructions (AVX-512-BF16, AMX), torch runs bfloat16 matmuls through
oneDNN primitives and SDPA through oneDNN micro-kernels, each built for one shape and cached.
This script measures, in fresh interpreters, how much resident memory (VmRSS) a process
gains over many shapes:

    products    F.linear with one SmolLM2 weight (3,072 x 576) at --shapes row counts,
                with oneDNN's caches at their defaults and as aioserve/host_memory.py sets them
    prefill     causal SDPA of SmolLM2's heads at every prompt length up to --max-len, and
                at those lengths rounded up to PREFILL_ALIGN as the torch attention path does

    python bench/shape_caches.py --shapes 256 --max-len 1024
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_PROBE = """
import json, sys
from aioserve import host_memory
kind, tuned, count = sys.argv[1], sys.argv[2] == "tuned", int(sys.argv[3])
if tuned:
    host_memory.keep_host_memory()
import torch
import torch.nn.functional as F
from aioserve.kernels.attention_reference import PREFILL_ALIGN
torch.set_num_threads(1)
def resident_mib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024
def shapes():
    if kind == "products":
        weight = torch.randn(3072, 576, dtype=torch.bfloat16)
        for rows in range(1, count + 1):
            F.linear(torch.randn(rows, 576, dtype=torch.bfloat16), weight)
    else:
        align = PREFILL_ALIGN if tuned else 1
        for length in range(align, count + 1, align):
            query = torch.randn(1, 9, length, 64, dtype=torch.bfloat16)
            keys = torch.randn(1, 3, length, 64, dtype=torch.bfloat16)
            F.scaled_dot_product_attention(query, keys, keys, is_causal=True, enable_gqa=True)
with torch.inference_mode():
    start = resident_mib()
    shapes()
    print(json.dumps({"growth MiB": round(resident_mib() - start, 1)}))
"""

_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def probe(kind: str, tuned: bool, count: int) -> float:
    """Resident growth of a fresh interpreter over `count` shapes of `kind`."""
    env = {k: v for k, v in os.environ.items() if k not in _CACHE_VARIABLES}
    mode = "tuned" if tuned else "default"
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, kind, mode, str(count)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.splitlines()[-1])["growth MiB"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=int, default=256, help="row counts of the products")
    parser.add_argument("--max-len", type=int, default=1024, help="longest prefill length")
    args = parser.parse_args()
    print(f"products, {args.shapes} row counts: growth MiB")
    print(f"  oneDNN's default caches   {probe('products', False, args.shapes)}")
    print(f"  aioserve's bound          {probe('products', True, args.shapes)}")
    print(f"prefill SDPA, lengths up to {args.max_len}: growth MiB")
    print(f"  every length              {probe('prefill', False, args.max_len)}")
    print(f"  padded to PREFILL_ALIGN   {probe('prefill', True, args.max_len)}")


if __name__ == "__main__":
    main()
