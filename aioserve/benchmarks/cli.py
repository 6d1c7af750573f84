"""The `aioserve bench` command line: `throughput`, `latency` and `serve`, with vLLM's options.

`throughput` and `latency` start an engine, so their parsers carry every engine argument
(from aioserve.config.parser.build_engine_parser, without the HTTP server's) besides their own.
`serve` is a client of a running server and takes no engine argument. The benchmarks
themselves load on demand, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from aioserve.benchmarks.datasets import DATASET_NAMES
from aioserve.config.parser import build_engine_parser


def _run_throughput(args: argparse.Namespace) -> int:
    from aioserve.benchmarks.throughput import main

    main(args)
    return 0


def _run_latency(args: argparse.Namespace) -> int:
    from aioserve.benchmarks.latency import main

    main(args)
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    from aioserve.benchmarks.serve import main

    main(args)
    return 0


def _engine_command(
    commands: argparse._SubParsersAction,
    name: str,
    help: str,
    description: str,
    defaults: dict[str, Any] | None = None,
) -> argparse.ArgumentParser:
    """A bench subcommand whose parser starts with every engine argument (`defaults`: its
    own defaults for some of them)."""
    prog = f"aioserve bench {name}"
    return commands.add_parser(
        name,
        parents=[build_engine_parser(prog, frontend=False, defaults=defaults)],
        add_help=False,
        usage=f"{prog} [options]",
        help=help,
        description=description,
        epilog=f"Show part of this help with {prog} --help=<group|argument|keyword|listgroup>.",
    )


RANGE_RATIO_HELP = (
    "Spread of the random dataset's lengths: each is drawn from "
    "[len * (1 - ratio), len * (1 + ratio)], ratio in [0, 1). One number for both, or a "
    'JSON object such as \'{"input": 0.3, "output": 0.5}\' for each.'
)


def _add_prefix_repetition_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("prefix repetition dataset options")
    group.add_argument(
        "--prefix-repetition-prefix-len",
        type=int,
        help="Prefix tokens per request (default: 256).",
    )
    group.add_argument(
        "--prefix-repetition-suffix-len",
        type=int,
        help="Suffix tokens per request; the input is prefix + suffix (default: 256).",
    )
    group.add_argument(
        "--prefix-repetition-num-prefixes",
        type=int,
        help="Distinct prefixes; each is shared by num-prompts // num-prefixes requests "
        "(default: 10).",
    )
    group.add_argument(
        "--prefix-repetition-output-len",
        type=int,
        help="Output tokens per request (default: --output-len, else 128).",
    )


def _add_throughput(commands: argparse._SubParsersAction) -> None:
    parser = _engine_command(
        commands,
        "throughput",
        "Offline generation throughput (vllm bench throughput).",
        "Measure offline throughput: every request at once on the offline engine (or on "
        "transformers with --backend hf), then print requests/s and tokens/s.",
    )
    bench = parser.add_argument_group("benchmark options")
    bench.add_argument(
        "--backend",
        choices=("aioserve", "vllm", "hf", "mii", "aioserve-chat", "vllm-chat"),
        default="aioserve",
        help="What to measure: aioserve's engine (vllm is an alias), its chat path "
        "(aioserve-chat, alias vllm-chat), or transformers (hf). mii is refused.",
    )
    bench.add_argument(
        "--dataset-name",
        choices=[name for name in DATASET_NAMES if name != "custom"],
        default="sharegpt",
        help="The workload; without --dataset-path, sharegpt and burstgpt fall back to random.",
    )
    bench.add_argument("--dataset", help="Deprecated: the ShareGPT file (use --dataset-path).")
    bench.add_argument(
        "--dataset-path", help="The dataset file (ShareGPT JSON, BurstGPT CSV, text)."
    )
    bench.add_argument(
        "--input-len",
        type=int,
        help="Input tokens per request (random: when --random-input-len is not given; sonnet).",
    )
    bench.add_argument(
        "--output-len",
        type=int,
        help="Output tokens per request; overrides the dataset's (random: when "
        "--random-output-len is not given).",
    )
    bench.add_argument("--n", type=int, default=1, help="Sequences generated per prompt.")
    bench.add_argument("--num-prompts", type=int, default=1000, help="Number of prompts.")
    bench.add_argument(
        "--num-warmups",
        type=int,
        default=0,
        help="Untimed prompts first: the same dataset, --num-warmups of them, seed + 1.",
    )
    bench.add_argument(
        "--no-oversample",
        action="store_true",
        help="sharegpt: do not repeat requests when the file has fewer than --num-prompts.",
    )
    bench.add_argument("--hf-max-batch-size", type=int, help="Largest batch of the hf backend.")
    bench.add_argument("--output-json", help="Write the results to this JSON file.")
    bench.add_argument(
        "--async-engine",
        action="store_true",
        help="Drive the AsyncEngine, one generate stream per request, instead of the LLM class.",
    )
    bench.add_argument(
        "--disable-detokenize",
        action="store_true",
        help="Do not detokenize the outputs (leave detokenization out of the measurement).",
    )
    bench.add_argument(
        "--lora-path",
        help="A LoRA adapter's PEFT folder (with --enable-lora): each request runs through it "
        "under one of --max-loras adapter ids, as vLLM's benchmark assigns them.",
    )
    bench.add_argument(
        "--lora-assignment",
        default="random",
        choices=("random", "round-robin"),
        help="How requests get their adapter id: at random, or cycling through them.",
    )
    bench.add_argument(
        "--prefix-len",
        type=int,
        default=0,
        help="Fixed prefix tokens before the random context (random: when "
        "--random-prefix-len is not given; sonnet).",
    )
    bench.add_argument("--random-range-ratio", default="0.0", help=RANGE_RATIO_HELP)
    random_dataset = parser.add_argument_group("random dataset options")
    random_dataset.add_argument(
        "--random-input-len",
        type=int,
        help="Input tokens per request; wins over --input-len (default: that, else 1024).",
    )
    random_dataset.add_argument(
        "--random-output-len",
        type=int,
        help="Output tokens per request; wins over --output-len (default: that, else 128).",
    )
    random_dataset.add_argument(
        "--random-prefix-len",
        type=int,
        help="Shared prefix tokens; wins over --prefix-len (default: that, else 0).",
    )
    bench.add_argument("--hf-subset", help="Subset of an hf dataset (the hf dataset is refused).")
    bench.add_argument("--hf-split", help="Split of an hf dataset (the hf dataset is refused).")
    # vLLM's frontend switches, which mean nothing offline. Their own dests keep them apart
    # from the server's arguments of the same names, which engine_config_from_args reads.
    for option, action, meaning in (
        ("--disable-frontend-multiprocessing", "store_true", "the engine runs in this process"),
        ("--disable-log-stats", "store_true", "the offline engine logs no statistics"),
        ("--enable-log-requests", argparse.BooleanOptionalAction, "no request is logged"),
        ("--disable-log-requests", argparse.BooleanOptionalAction, "no request is logged"),
    ):
        bench.add_argument(
            option,
            action=action,
            dest="ignored_" + option.removeprefix("--").replace("-", "_"),
            help=f"Accepted for vLLM command lines, no effect: {meaning}.",
        )
    _add_prefix_repetition_options(parser)
    parser.set_defaults(run=_run_throughput)


def _add_latency(commands: argparse._SubParsersAction) -> None:
    parser = _engine_command(
        commands,
        "latency",
        "Latency of one batch (vllm bench latency).",
        "Measure how long one batch of random prompts takes, over warm-up and timed "
        "iterations, and print the mean and percentiles.",
        # Off, unlike serving: every timed iteration sends the same prompts, and should
        # compute them in full rather than find them cached by the warm-up.
        defaults={"enable_prefix_caching": False},
    )
    bench = parser.add_argument_group("benchmark options")
    bench.add_argument("--input-len", type=int, default=32, help="Prompt tokens per request.")
    bench.add_argument("--output-len", type=int, default=128, help="Output tokens per request.")
    bench.add_argument("--batch-size", type=int, default=8, help="Requests per batch.")
    bench.add_argument("--n", type=int, default=1, help="Sequences generated per prompt.")
    bench.add_argument("--num-iters-warmup", type=int, default=10, help="Untimed iterations first.")
    bench.add_argument("--num-iters", type=int, default=30, help="Timed iterations.")
    bench.add_argument("--output-json", help="Write the results to this JSON file.")
    bench.add_argument(
        "--disable-detokenize",
        action="store_true",
        help="Do not detokenize the outputs (leave detokenization out of the measurement).",
    )
    parser.set_defaults(run=_run_latency)


def _add_serve_dataset_options(parser: argparse.ArgumentParser) -> None:
    dataset = parser.add_argument_group("dataset options")
    dataset.add_argument("--dataset-name", choices=DATASET_NAMES, default="random")
    dataset.add_argument(
        "--dataset-path",
        help="The dataset file (ShareGPT JSON, BurstGPT CSV, custom JSONL, text).",
    )
    dataset.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="Accepted for vLLM command lines, no effect: aioserve's tokenizer loading never "
        "runs code shipped with a model, and a tokenizer that needs it fails either way.",
    )
    dataset.add_argument(
        "--disable-shuffle",
        action="store_true",
        help="sharegpt, custom: keep the file's order instead of shuffling it with --seed.",
    )
    dataset.add_argument(
        "--no-oversample",
        action="store_true",
        help="sharegpt, custom: do not repeat requests when the file has fewer than --num-prompts.",
    )
    dataset.add_argument(
        "--skip-chat-template",
        action="store_true",
        help="custom: send the prompts as they are, not rendered with the chat template.",
    )
    dataset.add_argument(
        "--chat-template-kwargs",
        type=json.loads,
        help="custom: JSON object of arguments for the chat template, e.g. "
        "'{\"enable_thinking\": false}'.",
    )
    dataset.add_argument("--num-prompts", type=int, default=1000, help="Number of prompts.")
    dataset.add_argument("--seed", type=int, default=0, help="Seed of the workload and arrivals.")
    dataset.add_argument(
        "--input-len", type=int, help="Input tokens per request; overrides the dataset option."
    )
    dataset.add_argument(
        "--output-len", type=int, help="Output tokens per request; overrides the dataset option."
    )
    random_dataset = parser.add_argument_group("random dataset options")
    random_dataset.add_argument("--random-input-len", type=int, default=1024)
    random_dataset.add_argument("--random-output-len", type=int, default=128)
    random_dataset.add_argument("--random-range-ratio", default="0.0", help=RANGE_RATIO_HELP)
    random_dataset.add_argument(
        "--random-prefix-len", type=int, default=0, help="Shared prefix tokens."
    )
    random_dataset.add_argument(
        "--random-batch-size",
        type=int,
        default=1,
        help="openai-embeddings only: prompts per request, sent as one list input "
        "(--num-prompts prompts in all).",
    )
    sharegpt = parser.add_argument_group("sharegpt dataset options")
    sharegpt.add_argument(
        "--sharegpt-output-len", type=int, help="Output tokens; overrides the replies' lengths."
    )
    custom = parser.add_argument_group("custom dataset options")
    custom.add_argument(
        "--custom-output-len",
        type=int,
        default=256,
        help="Output tokens per request; -1: each row's output_tokens.",
    )
    sonnet = parser.add_argument_group("sonnet dataset options")
    sonnet.add_argument("--sonnet-input-len", type=int, default=550)
    sonnet.add_argument("--sonnet-output-len", type=int, default=150)
    sonnet.add_argument("--sonnet-prefix-len", type=int, default=200)
    _add_prefix_repetition_options(parser)


def _add_serve(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "serve",
        help="Load-test an OpenAI-compatible server (vllm bench serve).",
        description="Send a workload to a running OpenAI-compatible server (aioserve or any "
        "other), streaming, and report throughput and TTFT, TPOT, ITL and end-to-end latency "
        "(--backend openai-embeddings: embeddings requests, their throughput and end-to-end "
        "latency).",
    )
    target = parser.add_argument_group("server options")
    target.add_argument(
        "--backend",
        choices=("openai", "vllm", "openai-chat", "openai-embeddings"),
        default="openai",
        help="openai (alias vllm): the completions API; openai-chat: chat completions; "
        "openai-embeddings: /v1/embeddings of a pooling model (reports end-to-end latency "
        "and inputs/s, no TTFT/TPOT/ITL). openai-responses is refused: aioserve serves no "
        "/v1/responses; vLLM's other pooling and audio backends are not offered yet.",
    )
    target.add_argument("--base-url", help="The server's URL, instead of --host and --port.")
    target.add_argument("--host", default="127.0.0.1")
    target.add_argument("--port", type=int, default=8000)
    target.add_argument(
        "--endpoint",
        help="The API path (default: /v1/completions, /v1/chat/completions for openai-chat, "
        "/v1/embeddings for openai-embeddings).",
    )
    target.add_argument(
        "--header", nargs="*", metavar="KEY=VALUE", help="Extra HTTP headers on every request."
    )
    target.add_argument(
        "--model", help="The model's name on the server (default: the first of /v1/models)."
    )
    target.add_argument(
        "--served-model-name", help="The name to send in requests, when it differs from --model."
    )
    target.add_argument(
        "--lora-modules",
        nargs="+",
        help="LoRA adapters the server serves, by name: each request asks for one of them "
        "instead of the model (--lora-assignment says which).",
    )
    target.add_argument(
        "--lora-assignment",
        default="random",
        choices=("random", "round-robin"),
        help="How requests get their adapter from --lora-modules: at random, or in turn.",
    )
    target.add_argument("--tokenizer", help="Tokenizer for the workload (default: the model).")
    target.add_argument(
        "--tokenizer-mode",
        default="auto",
        help="vLLM's tokenizer mode. auto, hf, cohere, kimi_k3, inkling: the transformers "
        "tokenizer (fast when there is one); slow: its slow version. Modes that need a "
        "tokenizer of vLLM's own (mistral, deepseek_v32, ...) are refused.",
    )
    target.add_argument(
        "--ready-check-timeout-sec",
        type=int,
        default=0,
        help="Before the run, retry the first request (every 5 s) until it succeeds or this "
        "many seconds pass; 0 skips the check.",
    )
    target.add_argument(
        "--profile",
        action="store_true",
        help="Run the server's torch profiler over the timed requests: POST /start_profile "
        "before them and /stop_profile after (the server needs VLLM_TORCH_PROFILER_DIR).",
    )
    traffic = parser.add_argument_group("traffic options")
    traffic.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Requests per second; inf sends them all at once.",
    )
    traffic.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="Shape of the gamma distribution of the gaps between requests: 1 is a Poisson "
        "process, below 1 burstier, above 1 more even.",
    )
    traffic.add_argument("--max-concurrency", type=int, help="Most requests in flight at once.")
    traffic.add_argument(
        "--ramp-up-strategy",
        choices=("linear", "exponential"),
        help="Raise the request rate from --ramp-up-start-rps to --ramp-up-end-rps over the "
        "run (instead of --request-rate).",
    )
    traffic.add_argument("--ramp-up-start-rps", type=int, help="First request rate of a ramp-up.")
    traffic.add_argument("--ramp-up-end-rps", type=int, help="Last request rate of a ramp-up.")
    traffic.add_argument("--num-warmups", type=int, default=0, help="Untimed requests first.")
    traffic.add_argument(
        "--ignore-eos",
        action="store_true",
        help="Ask the server to ignore EOS (always on for the random dataset).",
    )
    traffic.add_argument("--request-id-prefix", help="Prefix of the x-request-id header.")
    traffic.add_argument(
        "--extra-body", type=json.loads, help="JSON object merged into every request body."
    )
    traffic.add_argument(
        "--logprobs",
        type=int,
        help="Log probabilities per token asked of the completions backends (default: none).",
    )
    sampling = parser.add_argument_group("sampling parameters (default: the server's)")
    for option, kind in (
        ("--temperature", float),
        ("--top-p", float),
        ("--top-k", int),
        ("--min-p", float),
        ("--frequency-penalty", float),
        ("--presence-penalty", float),
        ("--repetition-penalty", float),
    ):
        sampling.add_argument(option, type=kind)
    results = parser.add_argument_group("result options")
    results.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")
    results.add_argument("--save-result", action="store_true", help="Write the result JSON.")
    results.add_argument(
        "--append-result",
        action="store_true",
        help="Append the result JSON as a new line of the result file.",
    )
    results.add_argument(
        "--save-detailed",
        action="store_true",
        help="Also save per-request lengths, timings, texts and errors.",
    )
    results.add_argument(
        "--metadata", nargs="*", metavar="KEY=VALUE", help="Extra keys for the result JSON."
    )
    results.add_argument("--result-dir", help="Folder of the result JSON (default: here).")
    results.add_argument("--result-filename", help="Name of the result JSON.")
    results.add_argument("--label", help="Label of the result (default: the backend).")
    results.add_argument(
        "--percentile-metrics",
        help="Comma-separated metrics to report: ttft, tpot, itl, e2el, and with "
        "--max-concurrency client_queue_time and (at a finite --request-rate) "
        "e2el_including_client_queue (default: ttft,tpot,itl; e2el for openai-embeddings).",
    )
    results.add_argument(
        "--metric-percentiles",
        default="99",
        help='Comma-separated percentiles (0 to 100) to report, e.g. "25,50,75" (default: 99).',
    )
    results.add_argument(
        "--goodput",
        nargs="+",
        metavar="KEY:VALUE",
        help="Service level objectives in milliseconds (ttft, tpot, e2el), e.g. ttft:200 "
        "e2el:2000: also report the requests per second that met all of them.",
    )
    _add_serve_dataset_options(parser)
    parser.set_defaults(run=_run_serve)


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `bench` and its subcommands on the top-level `aioserve` subparsers."""
    bench = subparsers.add_parser(
        "bench",
        help="Benchmarks: throughput, latency, serve (vllm bench).",
        description="vLLM's benchmark tools with vLLM's options.",
    )
    commands = bench.add_subparsers(title="benchmarks", dest="benchmark", required=True)
    _add_throughput(commands)
    _add_latency(commands)
    _add_serve(commands)
