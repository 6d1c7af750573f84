"""--otlp-traces-endpoint: one OpenTelemetry span per finished engine request, as vLLM's.

vLLM 0.32 (vllm/tracing/, and `do_tracing` in vllm/v1/engine/output_processor.py) sends a
span named "llm_request", of kind SERVER, for every engine request that finishes: it starts
at the request's arrival, its parent is the trace context of the HTTP request's W3C
`traceparent` and `tracestate` headers (without them, it starts a trace of its own), and
its gen_ai.* attributes give the request's id and sampling parameters, its token counts
and the phases of its life. Here the server makes that span from what the engine hands
back (RequestOutput.metrics and the outputs): the engine knows nothing of OpenTelemetry.
The phases are those the Prometheus histograms observe (engine/stats.py's
`finished_request_stats`).

The OpenTelemetry packages are optional, as in vLLM: imported only with the flag set, and
a missing one stops the start with the pip command that installs them. Spans go through a
BatchSpanProcessor (a thread of its own exports them) to the OTLP exporter that
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL names: grpc (the default, in plaintext: vLLM's
insecure=True) or http/protobuf, sending to the flag's value as given (for OTLP/HTTP, the
whole URL: http://collector:4318/v1/traces). The app's cleanup flushes and stops it.

Where it differs from vLLM: a request with n > 1 samples is one span (its `n`, its
samples' tokens together), where vLLM sends one per sample, each with n = 1; the span
names the response's model (gen_ai.response.model, a key vLLM 0.32 declares but no longer
sets); the tracer provider is the app's own, not the process's global one.

Without the flag the handlers get no RequestTrace (None) and nothing here runs, but for
vLLM's warning, logged once, about a request that carried trace headers.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import logging
import os
import time
from collections.abc import AsyncGenerator, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aioserve.config.declaration import ConfigError
from aioserve.engine.admission import max_new_tokens
from aioserve.engine.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from aioserve.engine.outputs import PoolingRequestOutput, RequestOutput
    from aioserve.engine.settings import EngineSettings

logger = logging.getLogger("aioserve")

FLAG = "--otlp-traces-endpoint"
PROTOCOL_VARIABLE = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
PIP_INSTALL = "pip install opentelemetry-sdk opentelemetry-api opentelemetry-exporter-otlp"
TRACE_HEADERS = ("traceparent", "tracestate")
SPAN_NAME = "llm_request"
# The module each protocol's exporter comes from (vLLM's get_span_exporter).
_EXPORTERS = {
    "grpc": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "http/protobuf": "opentelemetry.exporter.otlp.proto.http.trace_exporter",
}
_SDK_MODULES = (
    "opentelemetry.trace",
    "opentelemetry.trace.propagation.tracecontext",
    "opentelemetry.sdk.resources",
    "opentelemetry.sdk.trace",
    "opentelemetry.sdk.trace.export",
)


class SpanAttributes:
    """The attribute keys of vLLM's spans (vllm/tracing/utils.py)."""

    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
    GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD = "gen_ai.latency.time_in_model_forward"
    GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE = "gen_ai.latency.time_in_model_execute"


def check_tracing() -> str:
    """The OTLP protocol the exporter will speak, once the OpenTelemetry modules it needs
    are found; a ConfigError naming the flag (and the pip command) when they are missing
    or OTEL_EXPORTER_OTLP_TRACES_PROTOCOL names another protocol. Called at start, before
    the model loads."""
    protocol = os.environ.get(PROTOCOL_VARIABLE, "grpc")
    if protocol not in _EXPORTERS:
        raise ConfigError(
            f"{FLAG}: unsupported OTLP protocol {protocol!r} in {PROTOCOL_VARIABLE} "
            f"(grpc or http/protobuf)"
        )
    for name in (*_SDK_MODULES, _EXPORTERS[protocol]):
        try:
            importlib.import_module(name)
        except ImportError as error:
            raise ConfigError(
                f"{FLAG} needs the OpenTelemetry packages, which are not installed "
                f"({error}); install them with: {PIP_INSTALL}"
            ) from None
    return protocol


class RequestTracer:
    """The OpenTelemetry side of a server started with --otlp-traces-endpoint: its tracer
    provider (not made the process's global one), exporting in batches. One per app."""

    def __init__(self, endpoint: str) -> None:
        protocol = check_tracing()
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        exporter_class = importlib.import_module(_EXPORTERS[protocol]).OTLPSpanExporter
        if protocol == "grpc":
            exporter = exporter_class(endpoint=endpoint, insecure=True)
        else:
            exporter = exporter_class(endpoint=endpoint)
        # vLLM's resource attributes, so that queries written for its traces find these.
        resource = Resource.create(
            {
                "vllm.instrumenting_module_name": "vllm.llm_engine",
                "vllm.process_id": str(os.getpid()),
            }
        )
        self._provider = TracerProvider(resource=resource)
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer(__name__)
        self._propagator = TraceContextTextMapPropagator()
        self._server_kind = SpanKind.SERVER
        logger.info("Sending request traces to %s over OTLP (%s)", endpoint, protocol)

    def trace(self, headers: Mapping[str, str], model: str) -> RequestTrace:
        """The trace of an HTTP request with these headers, answered as `model`."""
        carrier = {name: headers[name] for name in TRACE_HEADERS if name in headers}
        parent = self._propagator.extract(carrier) if carrier else None
        return RequestTrace(self, parent, model)

    def span(self, start_ns: int, end_ns: int, attributes: dict[str, Any], parent: Any) -> None:
        """Send one span (vLLM's name and kind) from start_ns to end_ns (time.time_ns)."""
        span = self._tracer.start_span(
            SPAN_NAME,
            context=parent,
            kind=self._server_kind,
            attributes=attributes,
            start_time=start_ns,
        )
        span.end(end_time=end_ns)

    async def shutdown(self) -> None:
        """Export what is left and stop the exporting thread (off the event loop: a
        collector that is slow or gone may hold the last export up to its timeout)."""
        await asyncio.to_thread(self._provider.shutdown)


@dataclass(frozen=True)
class RequestTrace:
    """What the spans of one HTTP request's engine requests share: their parent context
    (None: a trace of their own) and the model the response names."""

    tracer: RequestTracer
    parent: Any
    model: str

    def generation_finished(
        self,
        request_id: str,
        params: SamplingParams,
        output: RequestOutput,
        num_generation_tokens: int,
        max_tokens: int,
    ) -> None:
        """The span of a generation request whose last output is `output`."""
        attributes: dict[str, Any] = {}
        # vLLM's rule: a parameter that is 0 (or unset) is left out.
        for key, value in (
            (SpanAttributes.GEN_AI_REQUEST_TOP_P, params.top_p),
            (SpanAttributes.GEN_AI_REQUEST_MAX_TOKENS, max_tokens),
            (SpanAttributes.GEN_AI_REQUEST_TEMPERATURE, params.temperature),
            (SpanAttributes.GEN_AI_REQUEST_N, params.n),
        ):
            if value:
                attributes[key] = value
        self._send(request_id, output, num_generation_tokens, attributes)

    def pooling_finished(self, request_id: str, output: PoolingRequestOutput) -> None:
        """The span of a pooling request (no sampling parameters, no output tokens)."""
        self._send(request_id, output, 0, {})

    def _send(
        self,
        request_id: str,
        output: RequestOutput | PoolingRequestOutput,
        num_generation_tokens: int,
        attributes: dict[str, Any],
    ) -> None:
        m = output.metrics
        # The engine's outputs carry their metrics, the end recorded before a last one is out.
        assert m is not None and m.finished_time is not None
        arrival, finished = m.arrival_time, m.finished_time
        # As finished_request_stats: a phase that did not happen ends where the next begins.
        scheduled = m.first_scheduled_time if m.first_scheduled_time is not None else finished
        first_token = m.first_token_time if m.first_token_time is not None else finished
        last_token = m.last_token_time if m.last_token_time is not None else first_token
        attributes.update(
            {
                SpanAttributes.GEN_AI_REQUEST_ID: request_id,
                SpanAttributes.GEN_AI_RESPONSE_MODEL: self.model,
                SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS: len(output.prompt_token_ids),
                SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS: num_generation_tokens,
                # vLLM's first_token_latency: 0 for a request that got no token.
                SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: (
                    0.0 if m.first_token_time is None else first_token - arrival
                ),
                SpanAttributes.GEN_AI_LATENCY_E2E: finished - arrival,
                SpanAttributes.GEN_AI_LATENCY_TIME_IN_QUEUE: scheduled - arrival,
                SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: first_token - scheduled,
                SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: last_token - first_token,
                SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE: last_token - scheduled,
            }
        )
        # --collect-detailed-traces (engine/step_timing.py), in seconds as vLLM V0's.
        if m.model_forward_time is not None:
            attributes[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD] = m.model_forward_time
        if m.model_execute_time is not None:
            attributes[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE] = m.model_execute_time
        # The engine's times are time.monotonic(); a span's are nanoseconds since the epoch.
        offset_ns = time.time_ns() - time.monotonic_ns()
        self.tracer.span(
            offset_ns + round(arrival * 1e9),
            offset_ns + round(finished * 1e9),
            attributes,
            self.parent,
        )


def request_trace(
    tracer: RequestTracer | None, headers: Mapping[str, str], model: str
) -> RequestTrace | None:
    """The trace of an HTTP request's engine requests; None without --otlp-traces-endpoint
    (then a request with trace headers gets vLLM's warning, once)."""
    if tracer is not None:
        return tracer.trace(headers, model)
    if TRACE_HEADERS[0] in headers or TRACE_HEADERS[1] in headers:
        _warn_tracing_disabled()
    return None


@functools.cache
def _warn_tracing_disabled() -> None:
    logger.warning("Received a request with trace context but tracing is disabled")


async def traced_outputs(
    stream: AsyncGenerator[RequestOutput, None],
    trace: RequestTrace,
    request_id: str,
    params: SamplingParams,
    settings: EngineSettings,
) -> AsyncGenerator[RequestOutput, None]:
    """`stream`'s outputs, passed on; its last one (finished) is traced first. Output
    tokens are counted as the outputs carry them (deltas when streaming)."""
    delta = params.output_kind is RequestOutputKind.DELTA
    num_tokens: dict[int, int] = {}  # sample index -> its output tokens
    async with aclosing(stream):
        async for output in stream:
            if delta or output.finished:
                for sample in output.outputs:
                    before = num_tokens.get(sample.index, 0) if delta else 0
                    num_tokens[sample.index] = before + len(sample.token_ids)
            if output.finished:
                limit = max_new_tokens(settings, len(output.prompt_token_ids), params)
                trace.generation_finished(
                    request_id, params, output, sum(num_tokens.values()), limit
                )
            yield output
