"""Achieved bandwidth of every Triton kernel in aioserve/kernels/, at serving shapes.

For each case of bench/kernel_cases.py (rms_norm with and without the residual, rotary
neox and GPT-J, silu_and_mul, write_kv_cache with float and fp8 caches, paged attention
over decode-only, prefill and mixed batches and over fp8 caches, the sampling kernels, and
the linear layers on GGUF, AWQ/GPTQ int4 and FP8 weights; SmolLM2-135M and Llama-3-8B
shapes; the MoE layers of Mixtral-8x7B and Qwen3-30B-A3B; bf16 and fp16), it first checks
the Triton output against the kernel's torch reference on fresh random inputs (a row that
does not match is marked FAILED), then times the call with `triton.testing.do_bench` (CUDA
events, L2 flushed before each run, the median kept; `--cuda-graphs` replays it from a
CUDA graph instead) and reports the minimum bytes the call must move, the achieved GB/s,
that as a share of a device-to-device copy measured first (the practical bandwidth
ceiling), and for attention the achieved TFLOP/s.
Progress goes to stderr; the report (device, formulas, a markdown table) to stdout, the
table last. `--json PATH` writes every row.

    python3 bench/kernel_bandwidth.py --json kernel_bandwidth.json      # on a GPU
    python3 bench/kernel_bandwidth.py --only 'llama3-8b .*decode 1 '     # a subset of cases
    python3 bench/kernel_bandwidth.py --cuda-graphs    # without the host's launch cost

Timing needs a GPU: Triton has no CPU compiler, and its interpreter's times mean
nothing. Without one, only `--check-only` runs: the correctness checks at tiny shapes,
with the kernels interpreted (TRITON_INTERPRET=1 is set when no GPU is visible):

    python3 bench/kernel_bandwidth.py --check-only

The kernels are called through their `*_triton` launchers, so AIOSERVE_KERNEL_BACKEND
does not change what runs. Exit status: 0 when every check passed, 1 when one failed or
raised or the run was stopped early (SIGTERM, e.g. from `timeout`: the cases done so far
are still reported), 2 when the machine cannot run the requested mode.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import signal
import sys
import traceback
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kernel_cases import Case

# Run as `python3 bench/kernel_bandwidth.py`: the repository root holds the aioserve package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

COPY_BYTES = 1 << 30  # each side of the device-to-device copy that sets the ceiling
L2_FLUSH_BYTES = 256 << 20  # over the L2 of an H100 (50 MB), H200 (60 MB) or MI300X (256 MB)
WARMUP_MS = 25
REPEAT_MS = 100
MAX_FAILURES_LISTED = 10  # in the report; the JSON has them all

# triton.testing.do_bench: (fn, warmup ms, repeat ms, return_mode=...) -> milliseconds
Timer = Callable[..., float]


class Stopped(BaseException):
    """SIGTERM arrived (a time limit): report the cases done so far. Not an Exception, so
    that the per-case `except Exception` does not swallow it."""


def _stop(signum: int, frame: object) -> None:
    raise Stopped


@dataclass
class Row:
    """One case's outcome, as the JSON lists it."""

    kernel: str
    model: str
    shape: str
    dtype: str
    status: str  # "ok", "FAILED" (differs from the reference) or "ERROR" (raised)
    detail: str  # what differed, or the exception
    bytes: int
    flops: int
    formula: str
    median_us: float | None = None
    gb_per_s: float | None = None
    tflop_per_s: float | None = None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line: --check-only, --json PATH, --dtypes, --cuda-graphs, --only REGEX."""
    parser = argparse.ArgumentParser(
        description="Check every Triton kernel against its torch reference and time it "
        "at serving shapes (needs a GPU, except with --check-only).",
    )
    parser.add_argument(
        "--check-only",
        action="store_true",
        help="only the correctness checks, at tiny shapes; runs on the CPU under Triton's "
        "interpreter when no GPU is visible",
    )
    parser.add_argument("--json", metavar="PATH", help="write every row to this JSON file")
    parser.add_argument(
        "--dtypes",
        help="comma-separated dtypes of the per-token and attention kernels: bf16, fp16, "
        "fp32 (default bf16,fp16 on a GPU; fp16,fp32 under the interpreter, whose bf16 "
        "tl.dot is wrong)",
    )
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="time each call replayed from a CUDA graph, each call after a write that "
        "flushes L2, less that write's own time: the device's time without the host's "
        "launch cost, as a served decode step replays it",
    )
    parser.add_argument(
        "--only",
        metavar="REGEX",
        type=re.compile,
        help="run only the cases whose 'kernel | model | shape | dtype' line this regular "
        "expression matches (searched, not anchored), e.g. 'llama3-8b.*decode 1 ' to fit a "
        "short GPU lease",
    )
    return parser.parse_args(argv)


def case_line(case: Case, dtype_name: str) -> str:
    """The line `--only` is matched against."""
    return f"{case.kernel} | {case.model} | {case.shape} | {dtype_name}"


def refusal(args: argparse.Namespace, has_gpu: bool) -> str | None:
    """Why this machine cannot run the requested mode, or None when it can."""
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    if args.check_only and args.cuda_graphs:
        return "--cuda-graphs is a way of timing, and --check-only times nothing: drop one"
    if args.check_only:
        return None
    if not has_gpu:
        return (
            "timing compiled Triton kernels needs a CUDA or ROCm GPU, but torch sees none. "
            "On this machine only the correctness checks can run, interpreted: "
            "python3 bench/kernel_bandwidth.py --check-only"
        )
    if interpreting:
        return (
            "TRITON_INTERPRET=1 would time Triton's interpreter, not the GPU: unset it, or "
            "add --check-only"
        )
    return None


def graph_timer() -> Timer:
    """A Timer with do_bench's signature that replays the call from a CUDA graph.

    do_bench launches each call from Python, so a call of a few microseconds is timed at
    the host's launch cost (the int4 GEMV at one row: 28 µs in one run, 96 µs in another).
    `triton.testing.do_bench_cudagraph` captures many calls in one graph instead, but
    repeated calls would find a small weight in L2; each call here comes after a write of
    L2_FLUSH_BYTES, whose own time (measured once, the same way) is taken off. Its warm-up
    is one call before the capture, so `warmup` is unused."""
    from triton.testing import do_bench_cudagraph

    flush_buffer = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    flush_ms = do_bench_cudagraph(flush_buffer.zero_, rep=REPEAT_MS, return_mode="median")

    def timer(fn: Callable[[], object], warmup: int, rep: int, return_mode: str) -> float:
        def flushed_call() -> None:
            flush_buffer.zero_()
            fn()

        replayed = do_bench_cudagraph(flushed_call, rep=rep, return_mode=return_mode)
        return max(replayed - flush_ms, 0.0)

    return timer


def copy_bandwidth(do_bench: Timer) -> float:
    """GB/s of a large device-to-device copy, bytes read plus bytes written."""
    source = torch.randn(COPY_BYTES // 4, device="cuda")
    target = torch.empty_like(source)
    milliseconds = do_bench(
        lambda: target.copy_(source), WARMUP_MS, REPEAT_MS, return_mode="median"
    )
    return 2 * COPY_BYTES / (milliseconds * 1e-3) / 1e9


def run_case(case: Case, dtype_name: str, formula: str, do_bench: Timer | None) -> Row:
    """Check one case against its reference, then time it unless `do_bench` is None."""
    row = Row(
        case.kernel,
        case.model,
        case.shape,
        dtype_name,
        "ok",
        "",
        case.bytes,
        case.flops,
        formula,
    )
    try:
        failure = case.check()
        if failure is not None:
            row.status, row.detail = "FAILED", failure
        if do_bench is not None:
            milliseconds = do_bench(case.run, WARMUP_MS, REPEAT_MS, return_mode="median")
            seconds = milliseconds * 1e-3
            row.median_us = milliseconds * 1e3
            row.gb_per_s = case.bytes / seconds / 1e9
            if case.flops:
                row.tflop_per_s = case.flops / seconds / 1e12
    except Exception as error:  # one broken case must not end the run
        row.status = "ERROR"
        row.detail = f"{type(error).__name__}: {error}".splitlines()[0][:300]
        traceback.print_exc(file=sys.stderr)
    return row


def progress_line(row: Row) -> str:
    """One case's outcome in a line, for stderr."""
    timing = "" if row.median_us is None else f" {row.median_us:.1f} µs {row.gb_per_s:.0f} GB/s"
    detail = f" ({row.detail})" if row.detail else ""
    return f"{row.kernel} {row.model} {row.shape} {row.dtype}: {row.status}{timing}{detail}"


def _cell(value: float | None, digits: int = 1) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def markdown_tables(rows: list[Row], copy_gb_per_s: float | None) -> str:
    """The rows as markdown: one line per (kernel, model, shape), a column group per dtype.

    Kernels that ran in the same dtypes share a table (the sampling kernels run on float32
    logits only, so they get their own).
    """
    groups: dict[tuple[str, str, str], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.kernel, row.model, row.shape), []).append(row)
    tables: dict[tuple[str, ...], list[list[Row]]] = {}
    for group in groups.values():
        tables.setdefault(tuple(r.dtype for r in group), []).append(group)

    timed = any(r.median_us is not None for r in rows)
    out = []
    for dtypes, members in tables.items():
        has_flops = any(group[0].flops for group in members)
        header = ["kernel", "model", "shape", "MB"]
        for dtype in dtypes:
            if timed:
                header += [f"{dtype} µs", f"{dtype} GB/s"]
                if copy_gb_per_s:
                    header.append(f"{dtype} % copy")
            else:
                header.append(dtype)
        if timed and has_flops:
            header.append("TFLOP/s " + "/".join(dtypes))
        if timed:
            header.append("check")
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for group in members:
            first = group[0]
            cells = [first.kernel, first.model, first.shape, _cell(first.bytes / 1e6, 2)]
            for row in group:
                if not timed:
                    cells.append(row.status)
                    continue
                cells += [_cell(row.median_us), _cell(row.gb_per_s, 0)]
                if copy_gb_per_s:
                    share = None if row.gb_per_s is None else 100 * row.gb_per_s / copy_gb_per_s
                    cells.append(_cell(share, 0))
            if timed and has_flops:
                flops = [_cell(r.tflop_per_s) for r in group]
                cells.append("/".join(flops) if first.flops else "")
            if timed:
                bad = [f"{r.status} {r.dtype}" for r in group if r.status != "ok"]
                cells.append(", ".join(bad) or "ok")
            lines.append("| " + " | ".join(cells) + " |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def report(
    rows: list[Row],
    device_name: str,
    copy_gb_per_s: float | None,
    formulas: dict[str, str],
    timing: str,
) -> str:
    """What stdout gets: the device, the ceiling, the byte formulas, then the table."""
    failed = [r for r in rows if r.status != "ok"]
    lines = [
        f"# Triton kernels on {device_name}",
        "",
        f"torch {torch.__version__}, triton {_triton_version()}, "
        f"{datetime.date.today().isoformat()}; {len(rows)} cases, {len(failed)} not ok.",
    ]
    if copy_gb_per_s:
        lines.append(
            f"Device-to-device copy (the practical ceiling): {copy_gb_per_s:.0f} GB/s, "
            f"bytes read plus written. Times are medians of {timing}."
        )
    lines += ["", "Minimum bytes (MB column), per kernel:"]
    lines += [f"- {kernel}: {formula}" for kernel, formula in formulas.items()]
    for row in failed[:MAX_FAILURES_LISTED]:
        lines.append(
            f"- {row.status}: {row.kernel} {row.model} {row.shape} {row.dtype}: {row.detail}"
        )
    if len(failed) > MAX_FAILURES_LISTED:
        lines.append(f"- ... {len(failed) - MAX_FAILURES_LISTED} more not ok (see the JSON)")
    lines += ["", markdown_tables(rows, copy_gb_per_s)]
    return "\n".join(lines)


def _triton_version() -> str:
    import triton

    return triton.__version__


def write_json(
    path: str, rows: Iterable[Row], device_name: str, copy_gb_per_s: float | None
) -> None:
    """Every row, with the device and versions they were measured with."""
    document = {
        "device": device_name,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": sys.argv,
        "copy_gb_per_s": copy_gb_per_s,
        "rows": [asdict(row) for row in rows],
    }
    Path(path).write_text(json.dumps(document, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Check and time every case; the exit status of the module docstring."""
    args = parse_args(argv)
    has_gpu = torch.cuda.is_available()
    why_not = refusal(args, has_gpu)
    if why_not is not None:
        print(f"kernel_bandwidth.py: {why_not}", file=sys.stderr)
        return 2
    if not has_gpu:
        # Before the first import of triton (kernel_cases imports it through aioserve).
        os.environ["TRITON_INTERPRET"] = "1"
    import kernel_cases
    from triton.testing import do_bench

    if args.dtypes:
        try:
            dtypes = tuple(kernel_cases.DTYPES_BY_NAME[name] for name in args.dtypes.split(","))
        except KeyError as error:
            print(
                f"kernel_bandwidth.py: unknown dtype {error}; use bf16, fp16 or fp32",
                file=sys.stderr,
            )
            return 2
    elif has_gpu:
        dtypes = (torch.bfloat16, torch.float16)
    else:
        dtypes = (torch.float16, torch.float32)
    device = torch.device("cuda" if has_gpu else "cpu")
    device_name = (
        torch.cuda.get_device_name()
        if has_gpu
        else f"CPU ({platform.machine()}), Triton interpreter"
    )
    workload = kernel_cases.TINY_CHECKS if args.check_only else kernel_cases.SERVING
    if args.check_only:
        timer, timing = None, ""
    elif args.cuda_graphs:
        timer = graph_timer()
        timing = "calls replayed from a CUDA graph, L2 flushed before each (--cuda-graphs)"
    else:
        timer, timing = do_bench, "triton.testing.do_bench"

    signal.signal(signal.SIGTERM, _stop)
    rows: list[Row] = []
    copy_gb_per_s = None
    stopped = False
    try:
        copy_gb_per_s = None if timer is None else copy_bandwidth(timer)
        for case in kernel_cases.build_cases(workload, dtypes, device):
            dtype_name = kernel_cases.DTYPE_NAMES[case.dtype]
            if args.only is not None and not args.only.search(case_line(case, dtype_name)):
                continue
            row = run_case(case, dtype_name, kernel_cases.FORMULAS[case.kernel], timer)
            del case  # its inputs go before the next case's are made
            rows.append(row)
            print(progress_line(row), file=sys.stderr, flush=True)
    except Stopped:
        stopped = True
        print(f"stopped by SIGTERM after {len(rows)} cases", file=sys.stderr, flush=True)

    if args.json:
        write_json(args.json, rows, device_name, copy_gb_per_s)
    text = report(rows, device_name, copy_gb_per_s, kernel_cases.FORMULAS, timing)
    if stopped:
        text = f"STOPPED EARLY (SIGTERM): only the first {len(rows)} cases ran.\n\n{text}"
    print(text)
    return 0 if rows and not stopped and all(r.status == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
