"""Soak test of `aioserve serve`: thousands of mixed requests, then the server must be clean.

Starts `python -m aioserve serve` on the default model (127.0.0.1, a free port) with a short
context, a KV pool of 1.25 contexts and a small step budget (long prompts are prefilled in
chunks), so that requests preempt each other, and drives it over real HTTP with aiohttp,
`--concurrency` requests at a time, from a seeded mix (bench/soak_requests.py):

    finished     completions and chat, streamed or not, with `ignore_eos`: the full output
    n>1          the same with n = 2 or 3
    near-limit   token-id prompts a few tokens short of --max-model-len, max_tokens filling
                 the rest (half share a prefix, for the prefix cache); these preempt
    timeout      a client timeout far shorter than the generation (max_tokens to the limit)
    dropped      a stream closed by the client after a few events
    invalid      bad JSON, wrong types, max_tokens too large, unknown model, bad API key

After a warm-up of `--warmup` requests and an idle wait it reads the server's resident
memory (VmRSS of /proc/<pid>/status), again every `--sample-every` requests, and at the end
once the server is idle. The end checks: no request running or waiting and the KV cache
empty within `--settle` seconds, no 5xx, every invalid request answered with an
OpenAI-shaped 4xx, every finished request with its whole output (finish_reason "length",
n * max_tokens tokens), no other client failure, no "error" or "stop" finish in
vllm:request_success_total and as many "length" finishes as answers the clients read in
full (a request whose client left must be aborted, which vLLM counts under no finish
reason: the timeouts are 0.1 to 1 s, far shorter than max_tokens' generation on a CPU),
and a preemption at least. A summary is
printed (and written with `--json`); the exit status is 1 if a check failed.

    python bench/soak.py --requests 2000 --concurrency 16 --json bench/results/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ctypes
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from soak_requests import API_KEY, MODEL_NAME, Outcome, Planned, drive, plan_requests

START_LIMIT_S = 600
ENGINE_COUNTERS = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "aioserve:engine_step_duration_seconds_count",
    "aioserve:engine_step_duration_seconds_sum",
)
TRIM_TUNABLES = "glibc.malloc.mmap_threshold=65536:glibc.malloc.trim_threshold=131072"
"""glibc settings under which freed memory leaves the resident set at once: blocks of 64 KiB
and more (every tensor of a step) are mapped and unmapped one by one, and the heap's top is
trimmed past 128 KiB. By default glibc keeps what a large step freed and moves its mmap
threshold up, so the idle resident set of a healthy eager server lands anywhere in a band
of about 13 MiB, by the batches it happened to run; with these, within 1 MiB, and what
remains is what the server still holds. Steps are about a third slower, so the bench runs
without them (the memory of a real server) unless `--eager-free`."""
IDLE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


@dataclass
class SoakConfig:
    """What to run: the server's settings and the request mix's size."""

    requests: int = 2000
    concurrency: int = 16
    warmup: int = 200
    sample_every: int = 100
    seed: int = 0
    max_model_len: int = 512
    num_blocks: int = 40  # 1.25 contexts: two long requests cannot coexist
    block_size: int = 16
    max_num_batched_tokens: int | None = 256  # long prompts are prefilled in chunks
    enforce_eager: bool = False
    eager_free: bool = False  # the server's glibc gives freed memory back at once (TRIM_TUNABLES)
    settle_s: float = 10.0
    model: str | None = None  # None: the default model's GGUF
    dtype: str = "auto"  # the server's --dtype


# --- the server process --------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def default_model_path() -> str:
    from aioserve.models.resolve import DEFAULT_MODEL, resolve_model

    return str(resolve_model(DEFAULT_MODEL).path)


def serve_argv(config: SoakConfig, port: int) -> list[str]:
    argv = [sys.executable, "-m", "aioserve", "serve", config.model or default_model_path()]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--seed", str(config.seed)]
    argv += ["--max-model-len", str(config.max_model_len), "--dtype", config.dtype]
    argv += ["--num-gpu-blocks-override", str(config.num_blocks)]
    argv += ["--block-size", str(config.block_size)]
    argv += ["--served-model-name", MODEL_NAME, "--api-key", API_KEY]
    if config.max_num_batched_tokens:
        argv += ["--max-num-batched-tokens", str(config.max_num_batched_tokens)]
    if config.enforce_eager:
        argv.append("--enforce-eager")
    return argv


def start_server(config: SoakConfig, log: Path) -> tuple[subprocess.Popen, str]:
    """The server process, healthy, and its base URL; raises with the log's tail if not."""
    port = free_port()
    environment = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    if config.eager_free:
        tunables = [environment.get("GLIBC_TUNABLES", ""), TRIM_TUNABLES]
        environment["GLIBC_TUNABLES"] = ":".join(t for t in tunables if t)
    with open(log, "wb") as output:
        process = subprocess.Popen(
            serve_argv(config, port),
            stdout=output,
            stderr=subprocess.STDOUT,
            env=environment,
            preexec_fn=die_with_driver,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_LIMIT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        if health(url) == 200:
            return process, url
        time.sleep(0.5)
    stop_server(process)
    tail = log.read_text(errors="replace")[-3000:]
    raise RuntimeError(f"the server did not become healthy (log {log}):\n{tail}")


def die_with_driver() -> None:
    """In the server's process: the kernel kills it if this script dies without stopping it."""
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def health(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            return response.status
    except OSError:  # not listening yet, or not healthy (HTTPError)
        return None


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


def resident_memory_kib(pid: int) -> int:
    """VmRSS of `pid`, in KiB, from /proc/<pid>/status."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0])


async def read_metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """GET /metrics as {name{label=value,...}: value}; names alone for unlabelled use."""
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k not in ("engine", "model_name")}
            key = sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(labels.items()))
            values[key] = sample.value
    return values


async def wait_until_idle(url: str, limit_s: float) -> tuple[dict[str, float], float | None]:
    """/metrics once nothing runs or waits and the KV cache is empty, and how long it took;
    after `limit_s` the last read and None."""
    start = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        while True:
            values = await read_metrics(session, url)
            if not any(values[name] for name in IDLE_GAUGES):
                return values, time.monotonic() - start
            if time.monotonic() - start > limit_s:
                return values, None
            await asyncio.sleep(0.1)


# --- one soak run ----------------------------------------------------------------------------


def run_soak(config: SoakConfig, log: Path) -> dict[str, Any]:
    """Start the server, run the mix, check the end state; the summary (with its failures)."""
    rng = random.Random(config.seed)
    plans = plan_requests(config.max_model_len, config.requests, rng)
    warmup = min(config.warmup, config.requests)
    started = time.monotonic()
    process, url = start_server(config, log)
    try:
        start_s = time.monotonic() - started
        return asyncio.run(soak(config, process.pid, url, plans, warmup, start_s))
    finally:
        stop_server(process)


async def soak(
    config: SoakConfig, pid: int, url: str, plans: list[Planned], warmup: int, start_s: float
) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        before = await read_metrics(session, url)
    began = time.monotonic()
    outcomes = await drive(url, plans[:warmup], config.concurrency)
    _, warm_idle_s = await wait_until_idle(url, config.settle_s)
    samples = [(warmup, resident_memory_kib(pid))]

    def sample(count: int) -> None:
        if count % config.sample_every == 0:
            samples.append((warmup + count, resident_memory_kib(pid)))

    outcomes += await drive(url, plans[warmup:], config.concurrency, sample)
    driven_s = time.monotonic() - began
    after, settle_s = await wait_until_idle(url, config.settle_s)
    samples.append((len(plans), resident_memory_kib(pid)))
    timing = {"server start s": round(start_s, 1), "requests s": round(driven_s, 1)}
    timing["settle s"] = None if settle_s is None else round(settle_s, 2)
    timing["warm-up settle s"] = None if warm_idle_s is None else round(warm_idle_s, 2)
    return summarize(config, outcomes, before, after, samples, timing)


def summarize(
    config: SoakConfig,
    outcomes: list[Outcome],
    before: dict[str, float],
    after: dict[str, float],
    samples: list[tuple[int, int]],
    timing: dict[str, Any],
) -> dict[str, Any]:
    """Counts, metrics, memory growth and the list of failed checks."""
    kinds: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for outcome in outcomes:
        kinds[outcome.kind][f"{outcome.status} {outcome.result}"] += 1
    success = "vllm:request_success_total{{finished_reason={}}}".format
    reasons = ("length", "stop", "abort", "error")
    finish = {r: after[success(r)] - before[success(r)] for r in reasons}
    (warmup, warm_kib), (_, end_kib) = samples[0], samples[-1]
    growth_mib = (end_kib - warm_kib) / 1024
    summary: dict[str, Any] = {
        "config": asdict(config),
        "requests": len(outcomes),
        "kinds": {kind: dict(sorted(c.items())) for kind, c in sorted(kinds.items())},
        "preemptions": after["vllm:num_preemptions_total"] - before["vllm:num_preemptions_total"],
        "engine finish reasons": finish,
        "end gauges": {name: after[name] for name in IDLE_GAUGES},
        "engine": engine_figures(before, after),
        "rss MiB": {
            "warm-up": round(warm_kib / 1024, 1),
            "end": round(end_kib / 1024, 1),
            "growth": round(growth_mib, 1),
            "growth per 1000 requests": round(
                growth_mib / max(len(outcomes) - warmup, 1) * 1000, 2
            ),
            "slope per 1000 requests": round(rss_slope(samples) / 1024 * 1000, 2),
        },
        "rss samples (requests, KiB)": samples,
        "timing": timing,
    }
    summary["failures"] = failures(summary, outcomes)
    return summary


def rss_slope(samples: list[tuple[int, int]]) -> float:
    """KiB per request, least squares over every reading from the warm-up on."""
    counts, rss = [s[0] for s in samples], [s[1] for s in samples]
    return statistics.linear_regression(counts, rss).slope if len(set(counts)) > 1 else 0.0


def engine_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Tokens and steps the engine did between two reads of /metrics."""
    moved = {name: after[name] - before[name] for name in ENGINE_COUNTERS}
    steps = moved["aioserve:engine_step_duration_seconds_count"]
    step_s = moved["aioserve:engine_step_duration_seconds_sum"]
    return {
        "prompt tokens": moved["vllm:prompt_tokens_total"],
        "generation tokens": moved["vllm:generation_tokens_total"],
        "steps": steps,
        "mean step ms": round(step_s / steps * 1000, 1) if steps else 0.0,
    }


def failures(summary: dict[str, Any], outcomes: list[Outcome]) -> list[str]:
    """The end checks that did not hold, each as a sentence."""
    found = []
    if None in (summary["timing"]["settle s"], summary["timing"]["warm-up settle s"]):
        found.append(f"not idle {summary['config']['settle_s']} s after the last answer")
    server_errors = [o for o in outcomes if o.status is not None and o.status >= 500]
    if server_errors:
        found.append(f"{len(server_errors)} answers were 5xx, e.g. {server_errors[0]}")
    failed = [o for o in outcomes if o.result == "failed"]
    if failed:
        found.append(f"{len(failed)} requests failed, e.g. {failed[0]}")
    invalid = [o for o in outcomes if o.kind == "invalid"]
    if any(o.result != "refused" for o in invalid):
        found.append("an invalid request was not refused with its 4xx")
    reasons = summary["engine finish reasons"]
    if reasons["error"] or reasons["stop"]:
        found.append(f"the engine ended requests with {reasons}; only length and abort expected")
    finished = sum(o.result == "finished" for o in outcomes)
    if reasons["length"] < finished:
        found.append(f"{finished} requests finished but the engine counted {reasons['length']}")
    elif reasons["length"] > finished:
        found.append(
            f"{reasons['length'] - finished} requests whose client left ran to their end "
            "instead of being aborted"
        )
    if summary["preemptions"] == 0:
        found.append("no preemption: the KV pool was never short")
    return found


def print_summary(summary: dict[str, Any]) -> None:
    print(f"{summary['requests']} requests, config {summary['config']}")
    print(f"{'kind':<12} {'count':>6}  status and result")
    for kind, counts in summary["kinds"].items():
        detail = ", ".join(f"{k}: {v}" for k, v in counts.items())
        print(f"{kind:<12} {sum(counts.values()):>6}  {detail}")
    for key in ("preemptions", "engine finish reasons", "end gauges", "engine", "rss MiB"):
        print(f"{key}: {summary[key]}")
    print(f"timing: {summary['timing']}")
    for failure in summary["failures"]:
        print(f"FAILED: {failure}")
    print("all checks passed" if not summary["failures"] else "SOME CHECKS FAILED")


INTEGER_OPTIONS = {
    "requests": "requests in all",
    "concurrency": "requests in flight at once",
    "warmup": "requests before the first memory reading",
    "sample_every": "requests between two memory readings",
    "seed": "seed of the mix and of the server",
    "max_model_len": "the server's --max-model-len",
    "num_blocks": "KV blocks (the server's --num-gpu-blocks-override)",
    "block_size": "tokens a KV block (the server's --block-size)",
    "max_num_batched_tokens": "the server's --max-num-batched-tokens",
}


def parse_args(argv: list[str] | None) -> tuple[SoakConfig, argparse.Namespace]:
    defaults = SoakConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, help in INTEGER_OPTIONS.items():
        option = "--" + name.replace("_", "-")
        parser.add_argument(option, type=int, default=getattr(defaults, name), help=help)
    parser.add_argument("--enforce-eager", action="store_true", help="no torch.compile")
    parser.add_argument("--eager-free", action="store_true",
                        help="run the server with glibc returning freed memory at once, for a "
                        "steadier resident set (GLIBC_TUNABLES, see TRIM_TUNABLES)")  # fmt: skip
    parser.add_argument("--settle", dest="settle_s", type=float, default=defaults.settle_s,
                        help="seconds the server may take to be idle after the last answer")  # fmt: skip
    parser.add_argument("--model", default=None, help="default: the default model's GGUF")
    parser.add_argument("--dtype", default=defaults.dtype, help="the server's --dtype")
    parser.add_argument("--log", type=Path, default=None, help="the server's output")
    parser.add_argument("--json", type=Path, default=None, help="write the summary here")
    args = parser.parse_args(argv)
    return SoakConfig(**{f.name: getattr(args, f.name) for f in fields(SoakConfig)}), args


def main(argv: list[str] | None = None) -> int:
    config, args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the server is stopped
    with tempfile.TemporaryDirectory() as scratch:
        log = args.log or Path(scratch) / "serve.log"
        summary = run_soak(config, log)
    print_summary(summary)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
