"""aioserve side by side with its peers, on one workload, through the user-facing bench tools.

One run measures, on random prompts of --input-len tokens with --output-len new tokens each
(--num-prompts of them, EOS ignored):

1. offline: `aioserve bench throughput` on aioserve's engine, then with `--backend hf`
   (transformers' batched generate on the same weights and dtype);
2. online: `aioserve serve` started on a free local port, then `aioserve bench serve`
   against it twice: every request at once (--request-rate inf) and one at a time
   (--max-concurrency 1); the same two runs against every --server-url given (any
   OpenAI-compatible server already running, e.g. vLLM or llama.cpp).

Each command runs in its own process, so no run inherits another's memory or threads. The
JSON of every run, a markdown table and a PNG plot go to --out-dir (default
bench/results/); --write-results also puts the table into bench/RESULTS.md, between the
`<!-- side-by-side -->` markers.

    python bench/side_by_side.py --num-prompts 64 --input-len 256 --output-len 128 --write-results

The plot needs matplotlib (`pip install -e .[bench]`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
RESULTS_MD = BENCH / "RESULTS.md"
MARKER = "<!-- side-by-side -->"
SERVER_STARTUP_S = 600
# name -> extra `bench serve` options. Each setting draws its own prompts (its own seed):
# with the same prompts, the second run would find them all in the server's prefix cache.
SERVE_SETTINGS = {
    "rate inf": ["--request-rate", "inf", "--seed", "0"],
    "concurrency 1": ["--max-concurrency", "1", "--seed", "1"],
}


@dataclass
class Row:
    """One measured run: what ran, and its figures (latencies only for served runs)."""

    engine: str
    mode: str  # "offline" or the serve setting
    seconds: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    median_ttft_ms: float | None = None
    median_tpot_ms: float | None = None
    median_itl_ms: float | None = None
    p99_ttft_ms: float | None = None


def run(command: list[str]) -> str:
    """Run an aioserve command, echoing it; return its stdout, fail loudly on error."""
    print("$", shlex.join(command), flush=True)
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    sys.stdout.write(done.stdout)
    if done.returncode != 0:
        raise SystemExit(f"command failed with status {done.returncode}: {shlex.join(command)}")
    return done.stdout


def offline(engine: str, args: argparse.Namespace, out_dir: Path, extra: list[str]) -> Row:
    """`aioserve bench throughput` on the workload, with `extra` options (the backend)."""
    path = out_dir / f"offline-{engine}.json"
    stdout = run(
        [
            sys.executable,
            "-m",
            "aioserve",
            "bench",
            "throughput",
            "--model",
            args.model,
            "--dataset-name",
            "random",
            "--input-len",
            str(args.input_len),
            "--output-len",
            str(args.output_len),
            "--num-prompts",
            str(args.num_prompts),
            "--output-json",
            str(path),
            *extra,
        ]  # fmt: skip
    )
    result = json.loads(path.read_text())
    output_tokens = int(re.search(r"Total num output tokens:\s+(\d+)", stdout).group(1))
    seconds = result["elapsed_time"]
    return Row(
        engine,
        "offline",
        seconds,
        result["requests_per_second"],
        output_tokens / seconds,
        result["tokens_per_second"],
    )


def served(engine: str, url: str, args: argparse.Namespace, out_dir: Path) -> list[Row]:
    """`aioserve bench serve` against `url` in each of SERVE_SETTINGS."""
    rows = []
    for setting, options in SERVE_SETTINGS.items():
        name = f"serve-{engine}-{setting.replace(' ', '-')}.json"
        run(
            [
                sys.executable,
                "-m",
                "aioserve",
                "bench",
                "serve",
                "--base-url",
                url,
                "--tokenizer",
                args.model,
                "--dataset-name",
                "random",
                "--random-input-len",
                str(args.input_len),
                "--random-output-len",
                str(args.output_len),
                "--num-prompts",
                str(args.num_prompts),
                "--percentile-metrics",
                "ttft,tpot,itl,e2el",
                "--disable-tqdm",
                "--save-result",
                "--result-dir",
                str(out_dir),
                "--result-filename",
                name,
                *options,
            ]  # fmt: skip
        )
        result = json.loads((out_dir / name).read_text())
        if result["failed"]:
            raise SystemExit(f"{result['failed']} requests failed against {url} ({setting})")
        rows.append(
            Row(
                engine,
                f"serve, {setting}",
                result["duration"],
                result["request_throughput"],
                result["output_throughput"],
                result["total_token_throughput"],
                result["median_ttft_ms"],
                result["median_tpot_ms"],
                result["median_itl_ms"],
                result["p99_ttft_ms"],
            )
        )
    return rows


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_aioserve(args: argparse.Namespace, out_dir: Path, extra: list[str]) -> list[Row]:
    """Start `aioserve serve`, benchmark it, stop it."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "aioserve", "serve", args.model,
               "--host", "127.0.0.1", "--port", str(port), *extra]  # fmt: skip
    print("$", shlex.join(command), flush=True)
    with open(out_dir / "aioserve-server.log", "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + SERVER_STARTUP_S
        while True:
            if server.poll() is not None:
                raise SystemExit(f"aioserve serve exited with status {server.returncode}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    raise SystemExit("aioserve serve did not become healthy in time") from None
                time.sleep(1)
        return served("aioserve", url, args, out_dir)
    finally:
        server.terminate()
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _cell(value: float | None, digits: int) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def markdown_table(rows: list[Row]) -> str:
    """The rows as a markdown table; latency cells stay empty for offline runs."""
    lines = [
        "| engine | mode | seconds | requests/s | output tok/s | total tok/s "
        "| median TTFT ms | p99 TTFT ms | median TPOT ms | median ITL ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [
            r.engine,
            r.mode,
            _cell(r.seconds, 1),
            _cell(r.requests_per_s, 2),
            _cell(r.output_tokens_per_s, 1),
            _cell(r.total_tokens_per_s, 1),
            _cell(r.median_ttft_ms, 0),
            _cell(r.p99_ttft_ms, 0),
            _cell(r.median_tpot_ms, 1),
            _cell(r.median_itl_ms, 1),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[Row], title: str, path: Path) -> None:
    """Output throughput of every run; TTFT and TPOT of the served ones."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.engine}\n{r.mode}" for r in rows]
    served_rows = [r for r in rows if r.median_ttft_ms is not None]
    figure, axes = plt.subplots(1, 2 if served_rows else 1, figsize=(13, 4.8), squeeze=False)
    left = axes[0][0]
    left.bar(range(len(rows)), [r.output_tokens_per_s for r in rows], color="tab:blue")
    left.set_xticks(range(len(rows)), labels, fontsize=8)
    left.set_ylabel("output tokens/s (higher is better)")
    left.set_title("Throughput")
    if served_rows:
        right = axes[0][1]
        positions = range(len(served_rows))
        width = 0.4
        right.bar([p - width / 2 for p in positions], [r.median_ttft_ms for r in served_rows],
                  width, label="median TTFT")  # fmt: skip
        right.bar([p + width / 2 for p in positions], [r.median_tpot_ms for r in served_rows],
                  width, label="median TPOT")  # fmt: skip
        right.set_xticks(
            list(positions), [f"{r.engine}\n{r.mode}" for r in served_rows], fontsize=8
        )
        right.set_yscale("log")
        right.set_ylabel("milliseconds (lower is better)")
        right.set_title("Latency of served requests")
        right.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def machine() -> str:
    """The device the figures come from, in words."""
    import torch

    if torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
    else:
        device = f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()})"
    return f"{device}, torch {torch.__version__}"


def write_results_md(section: str, path: Path) -> None:
    """Put `section` between the MARKER lines of `path`, or append it with them."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    block = f"{MARKER}\n{section}\n{MARKER}"
    if MARKER in text:
        head, _, rest = text.partition(MARKER)
        _, _, tail = rest.partition(MARKER)
        text = head + block + tail
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


def main() -> None:
    # A SIGTERM (e.g. `pkill -f side_by_side.py`) unwinds like Ctrl-C, so the `finally`
    # that stops the aioserve server it started still runs.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-max-batch-size", type=int, default=64)
    parser.add_argument(
        "--engine-args",
        default="",
        help="More aioserve engine options, for `bench throughput` and `serve` alike "
        '(e.g. "--max-num-batched-tokens 4096").',
    )
    parser.add_argument(
        "--server-url",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="Also benchmark this running OpenAI-compatible server (repeatable).",
    )
    parser.add_argument("--skip-hf", action="store_true", help="No transformers run.")
    parser.add_argument("--skip-serve", action="store_true", help="No `aioserve serve` runs.")
    parser.add_argument("--out-dir", type=Path, default=BENCH / "results")
    parser.add_argument("--results-md", type=Path, default=RESULTS_MD)
    parser.add_argument(
        "--write-results", action="store_true", help="Put the table into --results-md."
    )
    args = parser.parse_args()
    peers = []
    for item in args.server_url:
        name, sep, url = item.partition("=")
        if not (sep and name and url.startswith(("http://", "https://"))):
            parser.error(f"--server-url takes NAME=http://host:port, got {item!r}")
        peers.append((name, url.rstrip("/")))

    today = datetime.date.today().isoformat()
    out_dir = args.out_dir / f"side-by-side-{today}"
    out_dir.mkdir(parents=True, exist_ok=True)
    engine_args = shlex.split(args.engine_args)
    rows = [offline("aioserve", args, out_dir, engine_args)]
    if not args.skip_hf:
        rows.append(
            offline("transformers", args, out_dir,
                    ["--backend", "hf", "--hf-max-batch-size", str(args.hf_max_batch_size)])
        )  # fmt: skip
    if not args.skip_serve:
        rows += serve_aioserve(args, out_dir, engine_args)
    for name, url in peers:
        rows += served(name, url, args, out_dir)

    workload = (
        f"random {args.input_len}-token prompts, {args.output_len} new tokens each, "
        f"{args.num_prompts} prompts, EOS ignored"
    )
    table = markdown_table(rows)
    command = "python bench/side_by_side.py " + shlex.join(sys.argv[1:])
    root = BENCH.parent
    shown_dir = (
        out_dir.resolve().relative_to(root) if out_dir.resolve().is_relative_to(root) else out_dir
    )
    plot(rows, f"{args.model}: {workload}", out_dir / "side-by-side.png")
    summary = "\n".join(
        [
            f"## Side by side, {args.model}",
            "",
            f"Measured {today} on {machine()}; {workload}. Offline: `aioserve bench "
            "throughput` (aioserve, and `--backend hf` for transformers); served: "
            "`aioserve bench serve` against each server, all requests at once (rate inf) "
            "and one at a time (concurrency 1).",
            "",
            f"Command: `{command}`",
            "",
            table,
            "",
            f"Plot and per-run JSON: `{shown_dir}/`",
        ]
    )
    (out_dir / "side-by-side.md").write_text(summary + "\n")
    print(table)
    if args.write_results:
        write_results_md(summary, args.results_md)
        print(f"updated {args.results_md}")


if __name__ == "__main__":
    main()
