"""Compile every Triton kernel for a member of each GPU family the launch tables tell apart,
on a machine without a GPU: NVIDIA sm_90a (Hopper) and sm_80 (Ampere), AMD gfx942 (MI300,
CDNA3), gfx90a (MI200, CDNA2) and gfx1100 (RDNA3, wave32).

Run as `python -m tests.kernels.gpu_compile [hopper|ampere|cdna3|cdna2|rdna3 ...]` (without
TRITON_INTERPRET: the compiler needs real JIT functions); it prints one JSON object per
launch. tests/kernels/test_gpu_compile.py runs it and checks the results.

Compiling all ~2,000 launches takes ~24 minutes of one core, so the measures of each are
kept in gpu_compile_record.json under Triton's own compile key for the launch (the
kernel's source and every JIT function it calls, types, constexprs, options, the Triton
build, the target, ptxas's version), the line each aioserve JIT function starts on left
out (`key_kernels_on_their_source`): a launch whose key is there is taken from the record,
one launch of each kernel is compiled again to check the record, on one family the kernel's
name picks (`checking_family`), and a launch whose key is not there (a kernel or a launch
table changed, another Triton) is compiled.
`python -m tests.kernels.gpu_compile --write-record` compiles everything (~15 minutes on
two cores) and writes the record afresh; the test fails while the record lacks a launch.

Each kernel is reached through its launcher, as the engine calls it: bench/kernel_cases.py
builds the calls at the shapes of COMPILE_WORKLOAD in the target's dtypes, on CPU tensors, with
the target's launch tables (aioserve.platform is made to answer as the target's device
would), and a few kernels at shapes of their own (`_lora_launches`, `_moe_launches`, ...).
`JITFunction.run` is replaced by a recorder, so nothing is launched: the launch
that would have been made (arguments, constexprs, num_warps, ...) is compiled with
`triton.compile` for the target instead. Reported for each: a compile error, the register
spills (ptxas's spill stores on NVIDIA; the kernel descriptor's vgpr spill count on AMD),
the shared memory (LDS) one program takes, and whether the kernel has both a barrier and an
atomic (the store -> barrier -> atomic pattern that races on ROCm, where a barrier does not
wait for global stores).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import io
import itertools
import json
import multiprocessing
import os
import pkgutil
import re
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import triton
from triton import knobs
from triton._C.libtriton import get_cache_invalidating_env_vars
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.runtime.cache import get_cache_key, triton_key
from triton.runtime.jit import JITFunction

from aioserve import kernels, platform
from aioserve.kernels.encoder_attention import encoder_attention_triton
from aioserve.kernels.int8_linear import int8_linear_triton
from aioserve.kernels.lora import add_lora_triton, lora_token_groups
from aioserve.kernels.moe import fused_moe_triton
from aioserve.kernels.moe_reference import MoeFp8Scales
from aioserve.kernels.sampling.token_bitmask import apply_token_bitmask_triton
from aioserve.platform import PlatformName
from bench.kernel_case_types import Zeros
from bench.kernel_cases import (
    LLAMA3_8B,
    SMOLLM2_135M,
    ModelShape,
    TokenBatch,
    Workload,
    build_cases,
)
from bench.kernel_cases_linear import linear_layers
from bench.kernel_cases_moe import MIXTRAL_8X7B, QWEN3_30B_A3B, SMALL_MOE


@dataclass(frozen=True)
class Target:
    platform: PlatformName
    gpu: str  # as aioserve.platform.gpu_name names it
    target: GPUTarget
    # SMs or CUs of the member compiled for (`platform.compute_units`), which set how
    # finely the GGUF and int4 products split K.
    units: int
    # The most shared memory (LDS) one program may take on the family's smallest member:
    # H100 227 KiB; A100 163 KiB but A10, RTX 30xx and L40S (sm_86/sm_89) 99 KiB; 64 KiB
    # on AMD's CDNA2, CDNA3 (MI300X) and RDNA3.
    shared_bytes: int
    # Kernel modules the family never launches: NVIDIA before sm_89 has no e4m3, and an FP8
    # checkpoint's layers are dequantized at load there (engine/build.py). (fp8_linear's
    # _gemm_kernel still runs there, for int8_linear.py's INT8 products.)
    never_launched: tuple[str, ...] = ()
    # The activation dtypes compiled.
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)


TARGETS = {
    "hopper": Target("cuda", "sm_90", GPUTarget("cuda", 90, 32), 132, 232_448),
    "ampere": Target(
        "cuda",
        "sm_80",
        GPUTarget("cuda", 80, 32),
        108,
        101_376,
        never_launched=("fp8_linear", "fp8_block_linear"),
    ),
    "cdna3": Target("rocm", "gfx942", GPUTarget("hip", "gfx942", 64), 304, 65_536),
    "cdna2": Target("rocm", "gfx90a", GPUTarget("hip", "gfx90a", 64), 110, 65_536),
    "rdna3": Target("rocm", "gfx1100", GPUTarget("hip", "gfx1100", 32), 96, 65_536),
}
# Head sizes 64 (SmolLM2), 128 (Llama-3-8B) and 256, query heads per KV head 3, 4, 1 and 8.
# Token batches of 1, 16 and 64 rows: the GGUF linear layers' GEMV, small and large tiles.
# The attention batches run with full attention and with a sliding window of 48 keys too
# (the kernels' SLIDING variants).
COMPILE_WORKLOAD = Workload(
    models=(
        SMOLLM2_135M,
        LLAMA3_8B,
        ModelShape("head256-gqa1", 2048, 8, 8, 256, 8192, 32000),
        ModelShape("head128-gqa8", 4096, 32, 4, 128, 14336, 32000),
    ),
    token_batches=(TokenBatch.decode(1), TokenBatch.decode(16), TokenBatch.prefill(64)),
    attention_batches=(
        ("decode 2x64", ((1, 64), (1, 64))),
        ("decode 2x600: split into segments", ((1, 600), (1, 600))),
        ("prefill 64", ((64, 64),)),
        ("chunk 32 after 32 + 2 decodes", ((32, 64), (1, 17), (1, 5))),
    ),
    sample_rows=(1, 4),
    attention_windows=(0, 48),
)
# Encoder-only (pooling) models' attention (kernels/encoder_attention.py): (heads, head dim)
# of all-MiniLM-L6-v2, BERT-base and the widest head of the kernel's main launch table,
# over one packed batch of prompts.
ENCODER_SHAPES = ((12, 32), (12, 64), (16, 128))
ENCODER_LENGTHS = (1, 64, 200)
# Multi-LoRA (kernels/lora.py): SmolLM2's and Llama-3-8B's layers at ranks 16 and 64, over
# 1, 64 and 512 tokens in 1, 2 and 4 adapter groups (with tokens of no adapter among the
# 512), 4 adapter slots.
LORA_MODELS = (SMOLLM2_135M, LLAMA3_8B)
LORA_RANKS = (16, 64)
LORA_TOKEN_SLOTS = ([0], [t % 2 for t in range(64)], [t % 5 - 1 for t in range(512)])
# Mixture-of-experts layers (kernels/moe.py): Mixtral-8x7B's (E 8, top_k 2), Qwen3-30B-A3B's
# (E 128, top_k 8) and a small one (H 576, I 256, E 8, top_k 2), over a decode of 1 and 16
# tokens and a prefill of 512.
MOE_MODELS = (MIXTRAL_8X7B, QWEN3_30B_A3B, SMALL_MOE)
MOE_TOKENS = (1, 16, 512)
# What is measured of each compiled launch, and where each launch's measures are recorded
# by its compile key (`compile_key`).
_MEASURES = ("spills", "shared", "barrier_and_atomic")
RECORD = Path(__file__).with_name("gpu_compile_record.json")
_KEY_LENGTH = 32  # hex digits of the key's sha256 kept: 128 bits
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "maxnreg")
_TRITON_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    # 8-bit floats: NVIDIA's e4m3 and AMD MI300's e4m3 "fnuz" (no negative zero, bias 8).
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e4m3fnuz: "fp8e4b8",
    torch.float8_e5m2: "fp8e5",
    torch.float8_e5m2fnuz: "fp8e5b16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
}


@dataclass
class Launch:
    kernel: JITFunction
    values: dict[str, Any]  # every parameter by name
    options: dict[str, Any]

    def key(self) -> str:
        shown = {n: _type_of(v) if not self.is_constexpr(n) else v for n, v in self.values.items()}
        return f"{self.kernel.__name__}|{shown}|{self.options}"

    def is_constexpr(self, name: str) -> bool:
        return self.kernel.params[self.kernel.arg_names.index(name)].is_constexpr

    def source(self) -> ASTSource:
        signature, constexprs = {}, {}
        for name, value in self.values.items():
            if self.is_constexpr(name) or value is None:
                signature[name] = "constexpr"
                constexprs[name] = value
            else:
                signature[name] = _type_of(value)
        return ASTSource(self.kernel, signature, constexprs=constexprs)


def _type_of(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _TRITON_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"cannot type a kernel argument {value!r}")


def record_launches(arch: str) -> list[Launch]:
    """Every distinct launch the launchers make on `arch`'s device across COMPILE_WORKLOAD."""
    launches: dict[str, Launch] = {}

    def record(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        options = {k: kwargs.pop(k) for k in _OPTIONS if k in kwargs}
        values = dict(zip(self.arg_names, args, strict=False)) | kwargs
        for param in self.params[len(args) :]:
            if param.name not in values:
                values[param.name] = param.default
        launch = Launch(self, {n: values[n] for n in self.arg_names}, options)
        launches.setdefault(launch.key(), launch)

    target = TARGETS[arch]
    device_globals = ("_platform", "_arch", "_gpu", "_compute_units")
    originals = [getattr(platform, name) for name in device_globals]
    original_run = JITFunction.run
    JITFunction.run = record
    try:
        platform._platform, platform._arch, platform._gpu = target.platform, arch, target.gpu
        platform._compute_units = target.units
        for case in build_cases(COMPILE_WORKLOAD, target.dtypes, torch.device("cpu"), Zeros):
            case.run()
        for model in COMPILE_WORKLOAD.models:  # not a bench case: structured outputs' mask
            logits = torch.zeros(4, model.vocab)
            bitmask = torch.zeros(2, -(-model.vocab // 32), dtype=torch.int32)
            apply_token_bitmask_triton(logits, bitmask, torch.tensor([0, 3]))
            _int8_linear_launches(model, target.dtypes)
        _encoder_attention_launches(target.dtypes)
        _lora_launches(target.dtypes)
        _moe_launches(target.dtypes)
    finally:
        JITFunction.run = original_run
        for name, original in zip(device_globals, originals, strict=True):
            setattr(platform, name, original)
    return list(launches.values())


def _int8_linear_launches(model: ModelShape, dtypes: tuple[torch.dtype, ...]) -> None:
    """Not a bench case: the INT8 W8A8 products (kernels/int8_linear.py) of `model`'s
    layers at COMPILE_WORKLOAD's token batches, with per-channel weight scales but for the
    attention output's per-tensor one, and a bias on qkv (as Qwen2 has)."""
    for layer, n, k in linear_layers(model):
        weight = torch.zeros(n, k, dtype=torch.int8)
        scale = torch.ones(1 if layer == "o" else n)
        bias = torch.zeros(n) if layer == "qkv" else None
        for batch in COMPILE_WORKLOAD.token_batches:
            for dtype in dtypes:
                x = torch.zeros(batch.n, k, dtype=dtype)
                int8_linear_triton(x, weight, scale, None if bias is None else bias.to(dtype))


def _encoder_attention_launches(dtypes: tuple[torch.dtype, ...]) -> None:
    """Not a bench case: the encoder attention of ENCODER_SHAPES over one packed batch of
    ENCODER_LENGTHS, q, k and v views of one fused projection as the BERT layer has them."""
    cu_seqlens = torch.tensor([0, *itertools.accumulate(ENCODER_LENGTHS)], dtype=torch.int32)
    tokens = int(cu_seqlens[-1])
    for heads, head_dim in ENCODER_SHAPES:
        for dtype in dtypes:
            fused = torch.zeros(tokens, 3, heads, head_dim, dtype=dtype)
            q, k, v = fused.unbind(1)
            encoder_attention_triton(q, k, v, cu_seqlens, max(ENCODER_LENGTHS), head_dim**-0.5)


def _lora_launches(dtypes: tuple[torch.dtype, ...]) -> None:
    """Not a bench case: the LoRA shrink and expand of LORA_MODELS' four layers (qkv in
    three slices, gate/up in two, o and down in one) at LORA_RANKS over LORA_TOKEN_SLOTS."""
    for model in LORA_MODELS:
        q_size, kv_size = model.q_heads * model.head, model.kv_heads * model.head
        layers = (
            (model.hidden, (0, q_size, q_size + kv_size, q_size + 2 * kv_size)),
            (q_size, (0, model.hidden)),
            (model.hidden, (0, model.intermediate, 2 * model.intermediate)),
            (model.intermediate, (0, model.hidden)),
        )
        for (k, bounds), rank, dtype in itertools.product(layers, LORA_RANKS, dtypes):
            a = torch.zeros(4, (len(bounds) - 1) * rank, k, dtype=dtype)
            b = torch.zeros(4, bounds[-1], rank, dtype=dtype)
            for slots in LORA_TOKEN_SLOTS:
                x = torch.zeros(len(slots), k, dtype=dtype)
                out = torch.zeros(len(slots), bounds[-1], dtype=dtype)
                groups = lora_token_groups(slots, "cpu")
                add_lora_triton(out, x, a, b, bounds, groups)


def _moe_launches(dtypes: tuple[torch.dtype, ...]) -> None:
    """Not a bench case (its experts would be zeroed, 2.8 GB at Mixtral's shape): the fused
    MoE of MOE_MODELS over MOE_TOKENS, the experts' weights left unwritten (no kernel
    runs), token t routed to experts t·k .. t·k + k - 1 modulo E; and where the device has
    e4m3, with block-wise FP8 experts (128 × 128 blocks; the small model's w13 with a scale
    row a weight row, as a stacked gate/up whose gate ends inside a block has it)."""
    fp8_dtype = None if platform.e4m3_missing() is not None else platform.e4m3_dtype()
    for moe, dtype in itertools.product(MOE_MODELS, dtypes):
        h, i, e, k = moe.hidden, moe.intermediate, moe.experts, moe.top_k
        experts = [(torch.empty(e, 2 * i, h, dtype=dtype), torch.empty(e, h, i, dtype=dtype), None)]
        if fp8_dtype is not None:
            w13_rows = 1 if moe is SMALL_MOE else 128
            scales = MoeFp8Scales(
                torch.empty(e, -(-2 * i // w13_rows), -(-h // 128)),
                torch.empty(e, -(-h // 128), -(-i // 128)),
                w13_rows,
                128,
                128,
            )
            w13, w2 = (
                torch.empty(e, 2 * i, h, dtype=fp8_dtype),
                torch.empty(e, h, i, dtype=fp8_dtype),
            )
            experts.append((w13, w2, scales))
        for (w13, w2, scales), tokens in itertools.product(experts, MOE_TOKENS):
            x = torch.zeros(tokens, h, dtype=dtype)
            topk_ids = (torch.arange(tokens * k) % e).view(tokens, k).to(torch.int32)
            topk_weights = torch.full((tokens, k), 1 / k)
            fused_moe_triton(x, w13, w2, topk_weights, topk_ids, scales)


def compile_key(launch: Launch, arch: str) -> str:
    """Triton's own cache key for compiling `launch` for `arch` (the start of the compiled
    kernel's metadata hash): it covers the kernel's source and every JIT function it calls,
    the argument types, constexprs and options, the Triton build, the target and ptxas's
    version, so an unchanged key means the compiler would be given the same work."""
    backend = make_backend(TARGETS[arch].target)
    options = backend.parse_options(dict(launch.options))
    env_vars = get_cache_invalidating_env_vars()
    key = get_cache_key(launch.source(), backend, options, env_vars=env_vars)
    return hashlib.sha256(key.encode()).hexdigest()[:_KEY_LENGTH]


def compile_and_measure(launch: Launch, arch: str) -> dict[str, Any]:
    """Compile `launch` for `arch`: its measures (`_MEASURES`), or the compile error."""
    target = TARGETS[arch]
    log = io.StringIO()
    knobs.nvidia.dump_ptxas_log = target.platform == "cuda"
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(launch.source(), target.target, launch.options)
    except Exception as error:  # reported, not raised: the test names each one
        return {"error": f"{type(error).__name__}: {error}"[:2000]}
    # Spills: the vector registers spilled to scratch in AMD's kernel descriptor, or the
    # bytes of spill stores in ptxas's own report of the compile.
    if target.platform == "rocm":
        counts = re.findall(r"\.vgpr_spill_count:\s*(\d+)", compiled.asm["amdgcn"])
    else:
        counts = re.findall(r"(\d+) bytes spill stores", log.getvalue())
    ttir = compiled.asm["ttir"]
    barrier = re.search(r"\b(gpu|ttg)\.barrier\b", ttir) is not None
    return {
        "spills": sum(int(c) for c in counts),
        "shared": compiled.metadata.shared,
        "barrier_and_atomic": barrier and "atomic_rmw" in ttir,
        "hash": compiled.metadata.hash,
    }


def checking_family(module: str, kernel: str) -> str:
    """The family on which one recorded launch of `kernel` is compiled again to check the
    record: picked by a hash of the kernel's name among the families that launch it, so
    that every kernel is checked once a run, each family on a few of them (checking every
    kernel on every family cost ~13 s of compiling a family, more than the rest)."""
    stem = module.rsplit(".", 1)[-1]
    families = [arch for arch, target in TARGETS.items() if stem not in target.never_launched]
    digest = hashlib.sha256(f"{module}.{kernel}".encode()).digest()
    return families[int.from_bytes(digest[:8], "big") % len(families)]


def results(archs: list[str], record: dict[str, dict]) -> Iterator[dict[str, Any]]:
    """One result for each launch on each of `archs`: its measures from `record` where its
    compile key is there, but for one such launch of each kernel on its checking family,
    compiled again to check the record ("recorded" then holds the record's word); compiled
    where the key is not in the record."""
    for arch in archs:
        checked: set[tuple[str, str]] = set()  # (module, kernel): two modules have a _gemm_kernel
        for launch in record_launches(arch):
            kernel = (launch.kernel.fn.__module__, launch.kernel.__name__)
            key = compile_key(launch, arch)
            result: dict[str, Any] = {
                "kernel": kernel[1],
                "module": kernel[0],
                "arch": arch,
                "constexprs": {n: v for n, v in launch.values.items() if launch.is_constexpr(n)},
                "options": launch.options,
                "key": key,
            }
            recorded = record.get(key)
            if recorded is not None and (kernel in checked or checking_family(*kernel) != arch):
                yield result | recorded | {"from_record": True}
                continue
            result |= compile_and_measure(launch, arch)
            if recorded is not None:
                result["recorded"] = recorded
                checked.add(kernel)
            yield result


def compiler_build() -> str:
    """A digest of what every compile key starts from: the Triton build (its sources and
    libtriton's bytes, which differ between wheels of one version) and each target's
    backend (ptxas's version, AMD's code generator revision)."""
    backends = [make_backend(target.target).hash() for target in TARGETS.values()]
    return hashlib.sha256("-".join([triton_key(), *backends]).encode()).hexdigest()[:_KEY_LENGTH]


def read_record() -> dict[str, Any]:
    """RECORD as written: the compiler build it was written with, and each launch's
    measures by compile key (none when there is no record)."""
    if not RECORD.exists():
        return {"compiler": None, "launches": {}}
    return json.loads(RECORD.read_text())


def key_kernels_on_their_source() -> None:
    """Leave out of every compile key the line each aioserve JIT function starts on.

    Triton's key for a function ends with its starting line (`JITFunction.cache_key`), so
    an edit above a kernel in its file changed every key of the kernel and of each kernel
    calling it, and the record had to be written again, though the compiler was given the
    same work. The line is set to 0 on every JIT function of aioserve.kernels (the code
    generator takes the lines it reports from `def_file_line_number`, not from this), and
    the hashes computed so far are dropped; triton.compile then hashes them so too, so the
    key is still the start of the compiled kernel's hash."""
    for info in pkgutil.walk_packages(kernels.__path__, f"{kernels.__name__}."):
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if isinstance(value, JITFunction) and value.fn.__module__ == module.__name__:
                value.starting_line_number = 0
                value.hash = None


def _one_thread_a_process() -> None:
    """One torch thread: the compiles run a process a core already, and each process's
    own threads (building the launches' inputs) fought the others' (two processes on this
    project's 2-core CPUs: 85 s, against 48 s with one thread each)."""
    torch.set_num_threads(1)


def _compile_family(arch: str) -> list[dict[str, Any]]:
    _one_thread_a_process()
    key_kernels_on_their_source()
    knobs.compilation.always_compile = True
    return list(results([arch], record={}))


def write_record() -> None:
    """Compile every launch on every family, a process a core, and write RECORD afresh
    (the launches that compiled; a compile error is never recorded)."""
    spawn = multiprocessing.get_context("spawn")  # not fork: torch's threads have run
    workers = min(len(TARGETS), os.cpu_count() or 1)
    with ProcessPoolExecutor(workers, mp_context=spawn) as pool:
        families = list(pool.map(_compile_family, TARGETS))
    launches = {
        r["key"]: {m: r[m] for m in _MEASURES}
        for family in families
        for r in family
        if "error" not in r
    }
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(launches.items())]
    header = (
        f'{{\n "triton": {json.dumps(triton.__version__)},\n'
        f' "compiler": {json.dumps(compiler_build())},\n "launches": {{\n'
    )
    RECORD.write_text(header + ",\n".join(lines) + "\n }\n}\n")
    print(f"{len(launches)} launches written to {RECORD}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="*", help=f"of {', '.join(TARGETS)} (default: all)")
    parser.add_argument("--write-record", action="store_true", help="compile every launch "
                        "on every family and write the record afresh")  # fmt: skip
    args = parser.parse_args()
    _one_thread_a_process()
    key_kernels_on_their_source()
    os.environ["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9's default, without its warning
    knobs.compilation.always_compile = True  # a cached kernel has no ptxas report
    if args.write_record:
        if sys.argv[1:] != ["--write-record"]:
            parser.error("--write-record compiles every family: name none")
        write_record()
        return
    unknown = set(args.families) - TARGETS.keys()
    if unknown:
        parser.error(f"no family {', '.join(sorted(unknown))}; the families: {', '.join(TARGETS)}")
    for result in results(args.families or list(TARGETS), read_record()["launches"]):
        print(json.dumps(result, default=str), flush=True)


if __name__ == "__main__":
    main()
