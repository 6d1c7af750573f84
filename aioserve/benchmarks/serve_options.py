"""Checks of `bench serve`'s options that argparse cannot make, with vLLM's rules and words.

Each takes the option's raw value and returns it parsed, or raises ConfigError naming the
option.
"""

from __future__ import annotations

import argparse

from aioserve.benchmarks.statistics import GOODPUT_METRICS, LATENCY_METRICS, QUEUE_METRICS
from aioserve.config.declaration import ConfigError


def key_values(items: list[str] | None, option: str) -> dict[str, str]:
    """KEY=VALUE pairs of --header and --metadata."""
    pairs = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{option} takes KEY=VALUE pairs, got {item!r}")
        pairs[key.strip()] = value.strip()
    return pairs


def percentiles(text: str) -> list[float]:
    """--metric-percentiles: comma-separated numbers from 0 to 100 (numpy's range)."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(
            f"--metric-percentiles takes comma-separated numbers, got {text!r}"
        ) from None
    if any(not 0 <= v <= 100 for v in values):
        raise ConfigError(f"--metric-percentiles takes percentiles from 0 to 100, got {text!r}")
    return values


def percentile_metrics(text: str | None, default: str | None = None) -> list[str]:
    """--percentile-metrics: the metrics to report (default: `default`, else ttft, tpot,
    itl; vLLM's default for a pooling backend is e2el)."""
    selected = (text or default or "ttft,tpot,itl").split(",")
    known = LATENCY_METRICS + QUEUE_METRICS
    unknown = [name for name in selected if name not in known]
    if unknown:
        raise ConfigError(
            f"--percentile-metrics: unknown metric(s) {', '.join(unknown)}; "
            f"choose from {', '.join(known)}"
        )
    return selected


def goodput(pairs: list[str] | None) -> dict[str, float]:
    """--goodput KEY:VALUE objectives in milliseconds, by metric; empty without it."""
    objectives: dict[str, float] = {}
    for pair in pairs or []:
        try:
            name, value = pair.split(":")
            objectives[name] = float(value)
        except ValueError:
            raise ConfigError(
                "--goodput: Invalid format found for service level objectives. Specify "
                'service level objectives for goodput as "KEY:VALUE" pairs, where the key is '
                "a metric name, and the value is a number in milliseconds."
            ) from None
    for name, value in objectives.items():
        if name not in GOODPUT_METRICS:
            raise ConfigError(
                f"--goodput: Invalid metric name found, {name}: {value}. The service level "
                f"objective name should be one of {list(GOODPUT_METRICS)}."
            )
        if value < 0:
            raise ConfigError(
                f"--goodput: Invalid value found, {name}: {value}. The service level "
                "objective value should be non-negative."
            )
    return objectives


def check_ramp_up(args: argparse.Namespace) -> None:
    """vLLM's rules for --ramp-up-strategy, --ramp-up-start-rps and --ramp-up-end-rps."""
    if args.ramp_up_strategy is None:
        if args.ramp_up_start_rps is not None or args.ramp_up_end_rps is not None:
            raise ConfigError("--ramp-up-start-rps and --ramp-up-end-rps need --ramp-up-strategy")
        return
    if args.request_rate != float("inf"):
        raise ConfigError(
            "When using ramp-up, do not specify --request-rate. The request rate will be "
            "controlled by ramp-up parameters. Please remove the --request-rate argument."
        )
    start, end = args.ramp_up_start_rps, args.ramp_up_end_rps
    if start is None or end is None:
        raise ConfigError(
            "When using --ramp-up-strategy, both --ramp-up-start-rps and --ramp-up-end-rps "
            "must be specified"
        )
    if start < 0 or end < 0:
        raise ConfigError("Ramp-up start and end RPS must be non-negative")
    if start > end:
        raise ConfigError("Ramp-up start RPS must be less than end RPS")
    if args.ramp_up_strategy == "exponential" and start == 0:
        raise ConfigError("For exponential ramp-up, the start RPS cannot be 0.")
    if start == 0:
        # vLLM accepts it and then fails on the first request, whose rate is 0.
        raise ConfigError("--ramp-up-start-rps 0 would give the first request a rate of 0")
