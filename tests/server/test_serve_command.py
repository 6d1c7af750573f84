"""`python -m aioserve serve`: its frontend arguments, and a real server process.

The argument tests parse `aioserve serve` command lines and check each frontend option's
value and each refusal. The process tests run `python -m aioserve serve` on the default
model's GGUF on a free port of 127.0.0.1, talk to it with the `openai` client and aiohttp,
and stop it with SIGTERM while a stream is in flight. Every process is killed in a finally.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import openai
import pytest

from aioserve.config.arguments import ARGUMENTS
from aioserve.config.declaration import FRONTEND, ConfigError
from aioserve.config.engine import engine_config_from_args
from aioserve.config.frontend import FrontendConfig, frontend_config_from_args
from aioserve.config.parser import build_engine_parser
from aioserve.config.values import LoRAModulePath
from aioserve.models.resolve import DEFAULT_MODEL
from aioserve.server.serve import _given_arguments
from tests.child_process import die_with_parent
from tests.server.serve_process import free_port, wait_until_healthy

# --- the frontend arguments ------------------------------------------------------------------

FRONTEND_FLAGS = [
    (["--host", "127.0.0.1"], "host", "127.0.0.1"),
    (["--port", "0"], "port", 0),
    (["--port", "8001"], "port", 8001),
    (["--uds", "/run/aioserve/api.sock"], "uds", "/run/aioserve/api.sock"),
    (["--uvicorn-log-level", "warning"], "uvicorn_log_level", "warning"),
    (["--disable-uvicorn-access-log"], "disable_uvicorn_access_log", True),
    (
        ["--disable-access-log-for-endpoints", " /health, /metrics,,"],
        "disable_access_log_for_endpoints",
        ["/health", "/metrics"],
    ),
    (["--allow-credentials"], "allow_credentials", True),
    (["--allowed-origins", '["https://a.example"]'], "allowed_origins", ["https://a.example"]),
    (["--allowed-methods", '["GET", "POST"]'], "allowed_methods", ["GET", "POST"]),
    (["--allowed-headers", "[]"], "allowed_headers", []),
    (["--api-key", "k"], "api_key", ["k"]),
    (["--api-key", "k1", "k2"], "api_key", ["k1", "k2"]),
    (["--chat-template", "t.jinja"], "chat_template", "t.jinja"),
    (["--chat-template-content-format", "openai"], "chat_template_content_format", "openai"),
    (
        ["--default-chat-template-kwargs", '{"enable_thinking": false}'],
        "default_chat_template_kwargs",
        {"enable_thinking": False},
    ),
    (["--trust-request-chat-template"], "trust_request_chat_template", True),
    (["--no-trust-request-chat-template"], "trust_request_chat_template", False),
    (["--response-role", "bot"], "response_role", "bot"),
    (["--ssl-keyfile", "k.pem"], "ssl_keyfile", "k.pem"),
    (["--ssl-certfile", "c.pem"], "ssl_certfile", "c.pem"),
    (["--ssl-ca-certs", "ca.pem"], "ssl_ca_certs", "ca.pem"),
    (["--ssl-cert-reqs", "2"], "ssl_cert_reqs", 2),
    (["--ssl-cert-reqs", "CERT_OPTIONAL"], "ssl_cert_reqs", 1),
    (["--enable-ssl-refresh"], "enable_ssl_refresh", True),
    (
        ["--ssl-ciphers", "ECDHE-RSA-AES256-GCM-SHA384:ECDHE-RSA-CHACHA20-POLY1305"],
        "ssl_ciphers",
        "ECDHE-RSA-AES256-GCM-SHA384:ECDHE-RSA-CHACHA20-POLY1305",
    ),
    (["--h11-max-incomplete-event-size", "65536"], "h11_max_incomplete_event_size", 65536),
    (["--h11-max-header-count", "32"], "h11_max_header_count", 32),
    (["--sse-keep-alive-interval", "15"], "sse_keep_alive_interval", 15),
    (["--root-path", "/api/"], "root_path", "/api"),
    (["--middleware", "a.b", "--middleware", "c.d.e"], "middleware", ["a.b", "c.d.e"]),
    (["--return-tokens-as-token-ids"], "return_tokens_as_token_ids", True),
    (["--disable-frontend-multiprocessing"], "disable_frontend_multiprocessing", True),
    (["--enable-request-id-headers"], "enable_request_id_headers", True),
    (["--enable-auto-tool-choice"], "enable_auto_tool_choice", True),
    (["--tool-call-parser", "hermes"], "tool_call_parser", "hermes"),
    (["--tool-parser-plugin", "/x/plugin.py"], "tool_parser_plugin", "/x/plugin.py"),
    (["--tool-strict-level", "parameter"], "tool_strict_level", "parameter"),
    (["--enable-offline-docs"], "enable_offline_docs", True),
    (["--anthropic-disabled-thinking-effort", "low"], "anthropic_disabled_thinking_effort", "low"),
    (
        ["--exclude-tools-when-tool-choice-none"],
        "exclude_tools_when_tool_choice_none",
        True,
    ),
    (["--enable-prompt-tokens-details"], "enable_prompt_tokens_details", True),
    (["--enable-server-load-tracking"], "enable_server_load_tracking", True),
    (["--disable-fastapi-docs"], "disable_fastapi_docs", True),
    (["--max-log-len", "100"], "max_log_len", 100),
    (["--disable-log-stats"], "disable_log_stats", True),
    (["--disable-log-requests"], "disable_log_requests", True),
    (["--enable-log-requests"], "enable_log_requests", True),
    (["--no-enable-log-requests"], "enable_log_requests", False),
    (["--enable-log-outputs", "--enable-log-requests"], "enable_log_outputs", True),
    (["--no-enable-log-deltas"], "enable_log_deltas", False),
    (["--log-error-stack"], "log_error_stack", True),
    (["--no-log-error-stack"], "log_error_stack", False),
    (["--enable-force-include-usage"], "enable_force_include_usage", True),
    (["--enable-per-request-metrics"], "enable_per_request_metrics", True),
    (["--enable-tokenizer-info-endpoint"], "enable_tokenizer_info_endpoint", True),
    (["--fingerprint-mode", "none"], "fingerprint_mode", "none"),
    (
        ["--fingerprint-value", "fp-1", "--fingerprint-mode", "custom"],
        "fingerprint_value",
        "fp-1",
    ),
    (["--no-tokens-only"], "tokens_only", False),
    (["--tokens-only"], "tokens_only", True),
    (["--enable-scale-out"], "enable_scale_out", True),
    (
        ["--otlp-traces-endpoint", "http://127.0.0.1:4317"],
        "otlp_traces_endpoint",
        "http://127.0.0.1:4317",
    ),
    (["--shutdown-timeout", "2.5"], "shutdown_timeout", 2.5),
    (
        ["--custom-histogram-buckets", '{"request_latency": [0.1, 1]}'],
        "custom_histogram_buckets",
        {"request_latency": [0.1, 1.0]},
    ),
    (
        [
            "--lora-modules",
            "sql=/a/sql",
            '{"name": "chat", "path": "/a/chat", "base_model_name": "m"}',
        ],
        "lora_modules",
        [LoRAModulePath("sql", "/a/sql"), LoRAModulePath("chat", "/a/chat", "m")],
    ),
]


def _options(*argv: str) -> FrontendConfig:
    return frontend_config_from_args(build_engine_parser("aioserve serve").parse_args(argv))


def test_the_start_up_log_lists_given_arguments_as_typed_values():
    # vLLM logs "non-default args: {...}" with the values its parser converted.
    args = build_engine_parser("serve").parse_args(
        ["--max-model-len", "2K", "--gpu-memory-utilization", "0.5", "--port", "0"]
        + ["--enable-prefix-caching", "--api-key", "secret", "--served-model-name", "a", "b"]
    )
    assert _given_arguments(args) == {
        "api_key": "<hidden>",
        "enable_prefix_caching": True,
        "gpu_memory_utilization": 0.5,
        "max_model_len": 2048,
        "port": 0,
        "served_model_name": ["a", "b"],
    }


@pytest.mark.parametrize(("argv", "dest", "expected"), FRONTEND_FLAGS)
def test_frontend_flag_sets_its_option(argv, dest, expected):
    value = getattr(_options(*argv), dest)
    assert value == expected and type(value) is type(expected)


def test_every_supported_frontend_argument_is_tested():
    tested = {argv[0].replace("--no-", "--") for argv, _, _ in FRONTEND_FLAGS}
    supported = {a.flag for a in ARGUMENTS if a.group == FRONTEND and a.supported}
    assert supported == tested
    fields = {field.name for field in dataclasses.fields(FrontendConfig)}
    assert fields == {a.dest for a in ARGUMENTS if a.group == FRONTEND and a.supported}


def test_defaults_are_vllms_and_the_default_model_is_served():
    options = _options()
    assert (options.host, options.port, options.api_key) == (None, 8000, None)
    assert options.allowed_origins == []  # vLLM 0.32: cross-origin access off by default
    assert options.allowed_methods == options.allowed_headers == ["*"]
    assert options.response_role == "assistant"
    assert options.shutdown_timeout == 30.0
    assert options.uds is options.disable_access_log_for_endpoints is options.ssl_ciphers is None
    # vLLM's H11_MAX_INCOMPLETE_EVENT_SIZE_DEFAULT and H11_MAX_HEADER_COUNT_DEFAULT; no
    # keep-alive comments.
    assert (options.h11_max_incomplete_event_size, options.h11_max_header_count) == (4194304, 256)
    assert options.sse_keep_alive_interval == 0
    config = engine_config_from_args(build_engine_parser("aioserve serve").parse_args([]))
    assert config.model.model == DEFAULT_MODEL


def test_frontend_options_come_from_a_config_file_too(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text(
        "port: 9001\nallowed_origins: ['https://a.example']\nenable-log-requests: true\n"
    )
    options = _options("--config", str(path), "--port", "9002")
    assert options.port == 9002  # the command line wins
    assert options.allowed_origins == ["https://a.example"]
    assert options.enable_log_requests is True


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "65536"], "--port must be a TCP port from 0 to 65535, got 65536"),
        (["--port", "http"], "--port must be an integer, got 'http'"),
        (["--allowed-origins", "*"], "--allowed-origins must be a JSON list of strings"),
        (["--allowed-methods", '"GET"'], "--allowed-methods must be a JSON list of strings"),
        (["--ssl-cert-reqs", "3"], "--ssl-cert-reqs must be 0, 1 or 2"),
        (["--root-path", "api"], "--root-path must start with '/', got 'api'"),
        (["--middleware", "nodots"], "--middleware must be import paths"),
        (["--max-log-len", "-1"], "--max-log-len must be at least 0, got -1"),
        (["--shutdown-timeout", "-1"], "--shutdown-timeout must be a number of seconds"),
        (["--shutdown-timeout", "inf"], "--shutdown-timeout must be a number of seconds"),
        (["--uvicorn-log-level", "loud"], "--uvicorn-log-level must be one of debug, info"),
        (
            ["--ssl-ciphers", "NO-SUCH-CIPHER"],
            "--ssl-ciphers 'NO-SUCH-CIPHER' is not a cipher list OpenSSL accepts: No cipher",
        ),
        (["--ssl-ciphers", ""], "--ssl-ciphers must be a non-empty string"),
        (["--uds", ""], "--uds must be a non-empty string"),
        (
            ["--h11-max-incomplete-event-size", "0"],
            "--h11-max-incomplete-event-size must be at least 1, got 0",
        ),
        (["--h11-max-header-count", "many"], "--h11-max-header-count must be an integer"),
        (
            ["--sse-keep-alive-interval", "-1"],
            "--sse-keep-alive-interval must be a non-negative integer (0 disables keep-alive "
            "comments), got -1",
        ),
        (["--sse-keep-alive-interval", "1.5"], "--sse-keep-alive-interval must be an integer"),
        (
            ["--lora-modules", "sql"],
            "--lora-modules has an entry that is neither name=path nor JSON",
        ),
        (["--lora-modules", '{"name": "x"}'], "--lora-modules entries take the keys name and path"),
        (["--lora-modules", "a=/x", "a=/y"], "--lora-modules names an adapter more than once: a"),
    ],
)
def test_bad_frontend_values_are_refused_by_name(argv, message):
    with pytest.raises(ConfigError) as error:
        _options(*argv)
    assert str(error.value).startswith(message)


# --- the process ---------------------------------------------------------------------------


def _aioserve(*argv: str, log: Path) -> subprocess.Popen:
    environment = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    with open(log, "wb") as output:
        return subprocess.Popen(
            [sys.executable, "-m", "aioserve", *argv],
            stdout=output,
            stderr=subprocess.STDOUT,
            env=environment,
            preexec_fn=die_with_parent,
        )


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait(timeout=30)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
        (["--tool-call-parser", "qwen3_xml"], "tool-call parser 'qwen3_xml' is not supported"),
        (["--headless", "--disable-log-stats"], "--headless is a vLLM argument that "),
        (["--port", "70000"], "--port must be a TCP port from 0 to 65535, got 70000"),
        (["--chat-template", "no-such-file"], "--chat-template 'no-such-file' is neither"),
        (["--middleware", "no.such.module"], "--middleware no.such.module: cannot import it"),
        (
            ["--ssl-keyfile", "k.pem"],
            "--ssl-keyfile, --ssl-ca-certs, --ssl-cert-reqs, --ssl-ciphers and "
            "--enable-ssl-refresh need",
        ),
        (
            ["--ssl-ciphers", "HIGH"],
            "--ssl-keyfile, --ssl-ca-certs, --ssl-cert-reqs, --ssl-ciphers and "
            "--enable-ssl-refresh need --ssl-certfile",
        ),
        (["--ssl-ciphers", "NOPE"], "--ssl-ciphers 'NOPE' is not a cipher list OpenSSL accepts"),
        (["--lora-modules", "sql=/a/sql"], "--lora-modules needs --enable-lora"),
        (["--uds", "/no/such/folder/api.sock"], "--uds /no/such/folder/api.sock: the folder"),
        (["--uds", "/" + "d" * 120], "--uds /" + "d" * 120 + ": a Unix socket path has at most"),
    ],
)
def test_refused_arguments_stop_the_command_before_the_model_loads(tmp_path, argv, message):
    log = tmp_path / "serve.log"
    process = _aioserve("serve", "no/such-model", *argv, log=log)
    try:
        assert process.wait(timeout=120) == 2
    finally:
        _stop(process)
    assert f"aioserve: error: {message}" in log.read_text()


async def _status(url: str) -> int:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.get(url) as response:
            return response.status


async def _sigterm_during_a_stream(process: subprocess.Popen, url: str) -> dict:
    """Open a stream, SIGTERM the server after its first event, then look around."""
    seen: dict = {}
    body = {
        "model": "smol",
        "prompt": "Once upon a time",
        "max_tokens": 16,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async with session.post(url + "/v1/completions", json=body) as stream:
            events = [await stream.content.readline()]
            process.send_signal(signal.SIGTERM)
            # The signal is handled on the server's loop: wait until /health says so.
            deadline = time.monotonic() + 30
            while (status := await _status(url + "/health")) == 200:
                assert time.monotonic() < deadline, "SIGTERM did not start draining"
                await asyncio.sleep(0.05)
            seen["health"] = status
            async with session.post(
                url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}
            ) as refused:
                seen["new_request"] = (refused.status, await refused.json())
            events += [line async for line in stream.content]
    seen["events"] = [line.decode().strip() for line in events if line.strip()]
    return seen


@pytest.mark.slow
def test_serve_answers_then_drains_on_sigterm(smollm2_gguf, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    argv = ["serve", str(smollm2_gguf), "--max-model-len", "512", "--host", "127.0.0.1"]
    argv += ["--enforce-eager"]
    argv += ["--port", str(port), "--served-model-name", "smol", "--shutdown-timeout", "60"]
    process = _aioserve(*argv, log=log)
    try:
        wait_until_healthy(process, url, log)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        completion = client.completions.create(
            model="smol", prompt="The capital of France is", max_tokens=4, temperature=0
        )
        assert completion.model == "smol"
        assert completion.choices[0].text and completion.choices[0].finish_reason == "length"
        assert completion.usage.completion_tokens == 4

        seen = asyncio.run(_sigterm_during_a_stream(process, url))
        assert seen["health"] == 503
        status, error = seen["new_request"]
        assert status == 503 and error["error"]["type"] == "ServiceUnavailableError"
        # The stream in flight ran to its end: every token, the usage chunk, [DONE].
        events = seen["events"]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] == 16
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"

        assert process.wait(timeout=120) == 0
    finally:
        _stop(process)
    text = log.read_text()
    assert "Application startup complete." in text
    # The ready line, just before it: what was loaded from the Q4_1 GGUF and what it holds.
    assert re.search(
        r"aioserve ready in [\d.]+ s: .*, GGUF Q4_1( \+ \w+)* weights \(\d+ MiB on disk\) "
        r"dequantized to (float32|bfloat16): \d+ MiB(, the dense layers' packed for oneDNN, "
        r"plus \d+ MiB of the head's packed copy(, plus \d+ MiB of the 4-bit layers as stored, "
        r"for steps of up to \d+ rows)?)?; KV cache [\d.]+ [MG]iB \(\w+, \d+ blocks "
        r"of \d+ tokens\), set by (VLLM_CPU_KVCACHE_SPACE|--gpu-memory-utilization) .*; "
        r"resident memory( \(host\))? [\d.]+ [MG]iB\n.*Application startup complete\.",
        text,
    ), text
    # `serve` on the CPU takes vLLM-CPU's server defaults, not its LLM class's.
    assert "up to 128 sequences and 2048 tokens a step" in text
    assert "Received SIGTERM" in text and "Finished server process" in text
    assert '"POST /v1/completions HTTP/1.1" 200' in text  # the access log
