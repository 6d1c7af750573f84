"""The HTTP server's configuration: `FrontendConfig`, from vLLM's Frontend arguments.

Each field is one supported argument of the Frontend group of `aioserve.config.arguments`,
named by its `dest` (a test checks that fields and declarations match); unset arguments
take their declared default. Unsupported Frontend arguments are refused by
`engine_config_from_args`, which a command calls first.

`log_stats_interval` reads vLLM's VLLM_LOG_STATS_INTERVAL, the period of the server's
stats line.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aioserve.config.arguments import ARGUMENTS
from aioserve.config.declaration import FRONTEND, ConfigError, checked_values
from aioserve.config.values import LoRAModulePath


@dataclass(frozen=True)
class FrontendConfig:
    host: str | None  # None: every interface
    port: int
    uds: str | None  # None: TCP on host and port
    uvicorn_log_level: str
    disable_uvicorn_access_log: bool
    disable_access_log_for_endpoints: list[str] | None  # None: every path logged
    allow_credentials: bool
    allowed_origins: list[str]
    allowed_methods: list[str]
    allowed_headers: list[str]
    api_key: list[str] | None
    lora_modules: list[LoRAModulePath] | None
    chat_template: str | None  # None: the tokenizer's
    chat_template_content_format: str
    default_chat_template_kwargs: dict[str, Any] | None  # None: none
    trust_request_chat_template: bool
    response_role: str
    ssl_keyfile: str | None
    ssl_certfile: str | None
    ssl_ca_certs: str | None
    ssl_cert_reqs: int
    ssl_ciphers: str | None  # None: OpenSSL's defaults
    enable_ssl_refresh: bool
    root_path: str | None
    middleware: list[str]
    return_tokens_as_token_ids: bool
    disable_frontend_multiprocessing: bool
    enable_request_id_headers: bool
    enable_auto_tool_choice: bool
    tool_call_parser: str | None
    tool_strict_level: str  # auto, function or parameter (server/tool_calls/strict_tags.py)
    tool_parser_plugin: str  # "": none
    anthropic_disabled_thinking_effort: str  # "auto": probed (server/anthropic_api.py)
    exclude_tools_when_tool_choice_none: bool
    enable_prompt_tokens_details: bool
    enable_server_load_tracking: bool
    sse_keep_alive_interval: int  # seconds; 0: no keep-alive comments
    disable_fastapi_docs: bool
    enable_offline_docs: bool  # always so: the /docs page fetches nothing (docs_page.py)
    h11_max_incomplete_event_size: int
    h11_max_header_count: int
    max_log_len: int | None  # None: no limit
    disable_log_stats: bool
    disable_log_requests: bool
    enable_log_requests: bool
    enable_log_outputs: bool
    enable_log_deltas: bool
    log_error_stack: bool | None  # None: VLLM_SERVER_DEV_MODE decides (server/app.py)
    enable_force_include_usage: bool
    enable_per_request_metrics: bool
    enable_tokenizer_info_endpoint: bool
    fingerprint_mode: str  # full, hash, custom or none (server/fingerprint.py)
    fingerprint_value: str | None
    enable_scale_out: bool  # the scale-out routes answer 403 without it (server/scale_out.py)
    tokens_only: bool  # no tokenizer, scale-out routes, no detokenizing (values.tokens_only)
    otlp_traces_endpoint: str | None  # None: no tracing
    custom_histogram_buckets: dict[str, list[float]] | None  # family -> bounds (metrics.py)
    shutdown_timeout: float


LOG_STATS_INTERVAL_ENV = "VLLM_LOG_STATS_INTERVAL"
DEFAULT_LOG_STATS_INTERVAL_S = 10.0


def log_stats_interval(environ: Mapping[str, str] | None = None) -> float:
    """Seconds between two stats lines: VLLM_LOG_STATS_INTERVAL, as vLLM reads it (10 when
    unset, 0 or negative). Where vLLM's float() would raise inside its logging loop, a
    value that is not a number is a ConfigError at start-up."""
    environ = os.environ if environ is None else environ
    raw = environ.get(LOG_STATS_INTERVAL_ENV)
    if raw is None:
        return DEFAULT_LOG_STATS_INTERVAL_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if math.isnan(seconds) or math.isinf(seconds):
        raise ConfigError(f"{LOG_STATS_INTERVAL_ENV} must be a number of seconds, got {raw!r}")
    return seconds if seconds > 0 else DEFAULT_LOG_STATS_INTERVAL_S


_FRONTEND_ARGUMENTS = tuple(a for a in ARGUMENTS if a.group == FRONTEND and a.supported)


def _build(values: dict[str, Any]) -> FrontendConfig:
    config = FrontendConfig(
        **{
            a.dest: values[a.dest] if a.dest in values else a.check(None, a.flag)
            for a in _FRONTEND_ARGUMENTS
        }
    )
    _check_combinations(config)
    return config


def _check_combinations(config: FrontendConfig) -> None:
    """ConfigError for arguments that vLLM 0.32 refuses together (validate_parsed_serve_args),
    and for a fingerprint value that would be ignored or missing."""
    if config.enable_log_outputs and not config.enable_log_requests:
        raise ConfigError("--enable-log-outputs requires --enable-log-requests")
    if config.enable_per_request_metrics and config.disable_log_stats:
        raise ConfigError(
            "--enable-per-request-metrics requires engine statistics logging; remove "
            "--disable-log-stats to enable per-request metrics"
        )
    # vLLM answers null for custom without a value and ignores a value in another mode.
    if config.fingerprint_mode == "custom" and config.fingerprint_value is None:
        raise ConfigError("--fingerprint-mode custom requires --fingerprint-value")
    if config.fingerprint_value is not None and config.fingerprint_mode != "custom":
        raise ConfigError(
            f"--fingerprint-value is used only with --fingerprint-mode custom, not "
            f"{config.fingerprint_mode}"
        )


def frontend_config_from_args(args: argparse.Namespace) -> FrontendConfig:
    """The FrontendConfig from a namespace parsed by the `serve` parser.

    Values given on the command line (or in `--config`) are checked and converted as in
    `engine_config_from_args`. Raises ConfigError for invalid values.
    """
    given = ((a, getattr(args, a.dest)) for a in _FRONTEND_ARGUMENTS if hasattr(args, a.dest))
    return _build(checked_values(given))


def frontend_config(**values: Any) -> FrontendConfig:
    """A FrontendConfig from snake_case keywords (the others take their defaults).

    Values are checked as keywords: a ConfigError names the keyword.
    """
    declared = {a.dest: a for a in _FRONTEND_ARGUMENTS}
    unknown = [name for name in values if name not in declared]
    if unknown:
        raise TypeError(f"unexpected frontend argument(s): {', '.join(unknown)}")
    return _build(checked_values(((declared[n], v) for n, v in values.items()), keywords=True))
