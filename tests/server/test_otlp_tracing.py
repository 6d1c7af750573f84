"""--otlp-traces-endpoint against a real OTLP receiver, over the wire.

The receiver is an aiohttp app taking OTLP/HTTP protobuf POSTs at /v1/traces, decoded with
opentelemetry-proto's ExportTraceServiceRequest; the server under test exports to it with
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf. Requests go through the official openai
client, with W3C `traceparent`/`tracestate` headers. Checked: vLLM's span (name, kind,
gen_ai.* attributes) for completions, chat (whole and streamed) and embeddings, its parent
taken from the headers or a fresh root trace without them, a not-sampled parent honoured,
the spans still waiting sent when the app stops, the refusals at start (packages missing,
an unknown protocol), and no export at all without the flag.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import openai
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from aioserve import AsyncEngine
from aioserve.config.declaration import ConfigError
from aioserve.config.engine import engine_config_from_kwargs
from aioserve.config.frontend import frontend_config_from_args
from aioserve.config.parser import build_engine_parser
from aioserve.server import tracing
from aioserve.server.app import build_app
from aioserve.server.state import ServerState
from aioserve.server.tracing import PIP_INSTALL
from tests.server.conftest import MODEL, serve_app, serve_built

pytestmark = pytest.mark.usefixtures("no_api_key_env")

SPAN_WAIT_S = 30.0


@dataclass
class ReceivedSpan:
    """One span as the receiver decoded it (ids as hex, attributes as Python values)."""

    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str
    trace_state: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]


def _values(pairs) -> dict[str, Any]:
    """OTLP KeyValues as a dict of plain values."""
    return {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in pairs}


class OTLPReceiver:
    """An OTLP/HTTP trace collector: every span POSTed to /v1/traces, kept."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.app = web.Application()
        self.app.router.add_post("/v1/traces", self._export)

    async def _export(self, request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        message = ExportTraceServiceRequest.FromString(await request.read())
        for resource_spans in message.resource_spans:
            resource = _values(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(
                        ReceivedSpan(
                            span.name,
                            span.kind,
                            span.trace_id.hex(),
                            span.span_id.hex(),
                            span.parent_span_id.hex(),
                            span.trace_state,
                            span.start_time_unix_nano,
                            span.end_time_unix_nano,
                            _values(span.attributes),
                            resource,
                        )
                    )
        body = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type="application/x-protobuf")

    def of_request(self, request_id: str) -> list[ReceivedSpan]:
        return [s for s in list(self.spans) if s.attributes.get("gen_ai.request.id") == request_id]

    def wait_for(self, request_id: str) -> ReceivedSpan:
        """The span of engine request `request_id`, once it arrived (one only)."""
        deadline = time.monotonic() + SPAN_WAIT_S
        while not self.of_request(request_id):
            assert time.monotonic() < deadline, f"no span for {request_id}"
            time.sleep(0.02)
        (span,) = self.of_request(request_id)
        return span


@pytest.fixture(scope="module")
def receiver(server_loop) -> Iterator[tuple[OTLPReceiver, str]]:
    """The receiver, on a free port: itself and its /v1/traces URL."""
    collector = OTLPReceiver()
    with serve_app(server_loop, collector.app) as url:
        yield collector, url + "/v1/traces"


@contextmanager
def traced_server(
    server_loop, engine: AsyncEngine, endpoint: str, schedule_delay_ms: int = 20
) -> Iterator[str]:
    """The app `aioserve serve --otlp-traces-endpoint <endpoint>` builds for `engine`,
    exporting over OTLP/HTTP every `schedule_delay_ms` ms: its base URL."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        patch.setenv("OTEL_BSP_SCHEDULE_DELAY", str(schedule_delay_ms))
        with serve_built(server_loop, engine, "--otlp-traces-endpoint", endpoint) as url:
            yield url


@pytest.fixture(scope="module")
def server(server_loop, engine, receiver) -> Iterator[str]:
    with traced_server(server_loop, engine, receiver[1]) as url:
        yield url


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _parent(sampled: bool = True) -> tuple[str, str, dict[str, str]]:
    """A fresh caller span: its trace id, span id and the W3C headers naming it."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    flags = "01" if sampled else "00"
    headers = {"traceparent": f"00-{trace_id}-{span_id}-{flags}", "tracestate": "caller=abc"}
    return trace_id, span_id, headers


def _check_timing(span: ReceivedSpan, sent_ns: int, answered_ns: int) -> None:
    """The span lies within the HTTP exchange, its latencies positive and consistent."""
    a = span.attributes
    ttft, e2e = a["gen_ai.latency.time_to_first_token"], a["gen_ai.latency.e2e"]
    queued = a["gen_ai.latency.time_in_queue"]
    prefill, decode = (
        a["gen_ai.latency.time_in_model_prefill"],
        a["gen_ai.latency.time_in_model_decode"],
    )
    inference = a["gen_ai.latency.time_in_model_inference"]
    assert 0 < ttft <= e2e
    assert queued >= 0 and prefill > 0 and decode >= 0
    assert inference == pytest.approx(prefill + decode)
    assert queued + inference <= e2e + 1e-6
    assert ttft == pytest.approx(queued + prefill)
    # Wall-clock nanoseconds (the engine's monotonic times moved to the epoch), spanning e2e.
    assert sent_ns - 5_000_000 <= span.start_ns < span.end_ns <= answered_ns + 5_000_000
    assert (span.end_ns - span.start_ns) / 1e9 == pytest.approx(e2e, abs=1e-5)


def test_a_completion_is_one_server_span_under_the_callers_trace(server, receiver):
    collector, _ = receiver
    trace_id, span_id, headers = _parent()
    sent = time.time_ns()
    completion = _client(server).completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=5,
        temperature=0.5,
        top_p=0.9,
        seed=1,
        extra_headers=headers,
    )
    answered = time.time_ns()
    span = collector.wait_for(f"{completion.id}-0")
    assert span.name == "llm_request"
    assert span.kind == Span.SPAN_KIND_SERVER
    assert (span.trace_id, span.parent_span_id) == (trace_id, span_id)
    assert span.span_id not in ("", span_id, "0" * 16)
    assert span.trace_state == "caller=abc"
    a = span.attributes
    assert a["gen_ai.response.model"] == MODEL
    assert a["gen_ai.request.max_tokens"] == 5
    assert a["gen_ai.request.temperature"] == 0.5
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.request.n"] == 1
    assert a["gen_ai.usage.prompt_tokens"] == completion.usage.prompt_tokens
    assert a["gen_ai.usage.completion_tokens"] == completion.usage.completion_tokens
    _check_timing(span, sent, answered)
    # vLLM's resource attributes.
    assert span.resource["vllm.process_id"] == str(os.getpid())
    assert span.resource["vllm.instrumenting_module_name"] == "vllm.llm_engine"


def test_a_chat_completion_is_traced_and_greedy_leaves_temperature_out(server, receiver):
    collector, _ = receiver
    trace_id, span_id, headers = _parent()
    sent = time.time_ns()
    chat = _client(server).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=7,
        temperature=0.0,
        extra_headers=headers,
    )
    answered = time.time_ns()
    span = collector.wait_for(chat.id)
    assert (span.name, span.kind) == ("llm_request", Span.SPAN_KIND_SERVER)
    assert (span.trace_id, span.parent_span_id) == (trace_id, span_id)
    a = span.attributes
    assert "gen_ai.request.temperature" not in a  # vLLM leaves a 0 out
    assert a["gen_ai.request.max_tokens"] == 7
    assert a["gen_ai.usage.prompt_tokens"] == chat.usage.prompt_tokens
    assert a["gen_ai.usage.completion_tokens"] == chat.usage.completion_tokens
    _check_timing(span, sent, answered)


def test_a_streamed_chat_counts_the_tokens_of_every_chunk(server, receiver):
    collector, _ = receiver
    _, span_id, headers = _parent()
    chunks = list(
        _client(server).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Count to five."}],
            max_tokens=12,
            n=2,
            seed=3,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers=headers,
            extra_body={"ignore_eos": True},
        )
    )
    usage = chunks[-1].usage
    span = collector.wait_for(chunks[0].id)
    assert span.parent_span_id == span_id
    a = span.attributes
    assert a["gen_ai.request.n"] == 2
    assert a["gen_ai.usage.prompt_tokens"] == usage.prompt_tokens
    assert a["gen_ai.usage.completion_tokens"] == usage.completion_tokens == 2 * 12


def test_a_responses_request_is_traced(server, receiver):
    collector, _ = receiver
    trace_id, span_id, headers = _parent()
    response = _client(server).responses.create(
        model=MODEL, input="Name a colour.", max_output_tokens=4, extra_headers=headers
    )
    span = collector.wait_for(response.id)
    assert (span.trace_id, span.parent_span_id) == (trace_id, span_id)
    a = span.attributes
    assert a["gen_ai.request.max_tokens"] == 4
    assert a["gen_ai.usage.prompt_tokens"] == response.usage.input_tokens
    assert a["gen_ai.usage.completion_tokens"] == response.usage.output_tokens


def test_without_trace_headers_a_span_starts_a_trace_of_its_own(server, receiver):
    collector, _ = receiver
    client = _client(server)
    first = client.completions.create(model=MODEL, prompt="One", max_tokens=2)
    second = client.completions.create(model=MODEL, prompt="Two", max_tokens=2)
    spans = [collector.wait_for(f"{c.id}-0") for c in (first, second)]
    for span in spans:
        assert span.parent_span_id == "" and span.trace_state == ""
        assert span.trace_id != "0" * 32
    assert spans[0].trace_id != spans[1].trace_id


def test_each_prompt_of_a_request_has_its_span_under_the_same_parent(server, receiver):
    collector, _ = receiver
    trace_id, span_id, headers = _parent()
    completion = _client(server).completions.create(
        model=MODEL, prompt=["Red", "Green and blue"], max_tokens=3, extra_headers=headers
    )
    spans = [collector.wait_for(f"{completion.id}-{i}") for i in range(2)]
    assert {(s.trace_id, s.parent_span_id) for s in spans} == {(trace_id, span_id)}
    assert len({s.span_id for s in spans}) == 2
    assert sum(s.attributes["gen_ai.usage.prompt_tokens"] for s in spans) == (
        completion.usage.prompt_tokens
    )


def test_a_caller_that_does_not_sample_gets_no_span(server, receiver):
    collector, _ = receiver
    client = _client(server)
    _, _, unsampled = _parent(sampled=False)
    dropped = client.completions.create(
        model=MODEL, prompt="Quiet", max_tokens=2, extra_headers=unsampled
    )
    kept = client.completions.create(model=MODEL, prompt="Loud", max_tokens=2)
    collector.wait_for(f"{kept.id}-0")  # exported in order: the first would be there by now
    assert collector.of_request(f"{dropped.id}-0") == []


def test_the_spans_still_waiting_are_sent_when_the_app_stops(server_loop, engine, receiver):
    collector, endpoint = receiver
    # A batch every minute: only the shutdown can send this one in time.
    with traced_server(server_loop, engine, endpoint, schedule_delay_ms=60_000) as url:
        completion = _client(url).completions.create(model=MODEL, prompt="Bye", max_tokens=2)
        time.sleep(0.2)
        assert collector.of_request(f"{completion.id}-0") == []
    assert len(collector.of_request(f"{completion.id}-0")) == 1


@pytest.fixture(scope="module")
def minilm_engine(minilm_folder, server_loop) -> Iterator[AsyncEngine]:
    engine = AsyncEngine.from_config(
        engine_config_from_kwargs(model=str(minilm_folder), dtype="float32")
    )
    yield engine
    server_loop.run(engine.shutdown())


def test_pooling_requests_are_traced_too(server_loop, minilm_engine, receiver):
    collector, endpoint = receiver
    trace_id, span_id, headers = _parent()
    with traced_server(server_loop, minilm_engine, endpoint) as url:
        reply = _client(url).embeddings.create(
            model=MODEL, input=["a short text", "and a longer one than that"], extra_headers=headers
        )
        spans = [collector.wait_for(f"{reply.id}-{i}") for i in range(2)]
    assert {(s.trace_id, s.parent_span_id) for s in spans} == {(trace_id, span_id)}
    for span in spans:
        a = span.attributes
        assert (span.name, span.kind) == ("llm_request", Span.SPAN_KIND_SERVER)
        assert a["gen_ai.usage.completion_tokens"] == 0
        assert not {"gen_ai.request.max_tokens", "gen_ai.request.n"} & set(a)
        assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    assert sum(s.attributes["gen_ai.usage.prompt_tokens"] for s in spans) == (
        reply.usage.prompt_tokens
    )


def _build(engine: AsyncEngine, *argv: str) -> None:
    options = frontend_config_from_args(build_engine_parser("aioserve serve").parse_args(argv))
    build_app(ServerState(engine, [MODEL], options))


def _hide_opentelemetry(patch: pytest.MonkeyPatch) -> None:
    """Make every OpenTelemetry module fail to import, as if the packages were missing."""
    for name in [*sys.modules, "opentelemetry"]:
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            patch.setitem(sys.modules, name, None)


def test_the_flag_without_the_packages_is_refused_naming_it(engine, monkeypatch):
    _hide_opentelemetry(monkeypatch)
    with pytest.raises(ConfigError) as error:
        _build(engine, "--otlp-traces-endpoint", "http://127.0.0.1:4317")
    message = str(error.value)
    assert message.startswith("--otlp-traces-endpoint needs the OpenTelemetry packages")
    assert message.endswith(f"install them with: {PIP_INSTALL}")
    assert PIP_INSTALL == (
        "pip install opentelemetry-sdk opentelemetry-api opentelemetry-exporter-otlp"
    )


def test_serve_refuses_the_flag_without_the_packages_before_loading_a_model(tmp_path):
    # Past the check the missing chat template would stop it, with another message.
    code = (
        "import sys; sys.modules['opentelemetry'] = None; from aioserve.cli import main; "
        "sys.exit(main(sys.argv[1:]))"
    )
    argv = ["serve", "--otlp-traces-endpoint", "http://127.0.0.1:4317"]
    argv += ["--chat-template", str(tmp_path / "missing.jinja")]
    result = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(
        "aioserve: error: --otlp-traces-endpoint needs the OpenTelemetry packages"
    ), result.stderr
    assert PIP_INSTALL in result.stderr


def test_an_unknown_otlp_protocol_is_refused(engine, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ConfigError, match="unsupported OTLP protocol 'http/json' in OTEL_EX"):
        _build(engine, "--otlp-traces-endpoint", "http://127.0.0.1:4318/v1/traces")


def test_grpc_is_the_default_protocol_in_plaintext(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    assert tracing.check_tracing() == "grpc"
    made: list[dict[str, Any]] = []
    from opentelemetry.exporter.otlp.proto.grpc import trace_exporter

    class Recorded(trace_exporter.OTLPSpanExporter):
        def __init__(self, **kwargs: Any) -> None:
            made.append(kwargs)
            super().__init__(**kwargs)

    monkeypatch.setattr(trace_exporter, "OTLPSpanExporter", Recorded)
    asyncio.run(tracing.RequestTracer("localhost:4317").shutdown())
    assert made == [{"endpoint": "localhost:4317", "insecure": True}]


def test_without_the_flag_nothing_is_exported(server_loop, engine, receiver, monkeypatch, caplog):
    collector, endpoint = receiver
    # Even with the exporter's own variables pointing at the receiver.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    tracing._warn_tracing_disabled.cache_clear()
    before = len(collector.spans)
    _, _, headers = _parent()
    with caplog.at_level(logging.WARNING, logger="aioserve"):
        with serve_built(server_loop, engine) as url:
            client = _client(url)
            for prompt in ("Silent", "Still silent"):
                client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=2, extra_headers=headers
                )
    assert len(collector.spans) == before
    warnings = [
        r for r in caplog.records if "trace context but tracing is disabled" in r.getMessage()
    ]
    assert len(warnings) == 1  # vLLM's, once
