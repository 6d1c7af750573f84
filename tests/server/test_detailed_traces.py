"""--collect-detailed-traces against a real OTLP receiver, over the wire.

The server is built as `aioserve serve --otlp-traces-endpoint <receiver>
--collect-detailed-traces model,worker` builds it (engine and app from one command line),
exporting over OTLP/HTTP to the receiver of tests/server/test_otlp_tracing.py. Checked: the
spans carry gen_ai.latency.time_in_model_forward and time_in_model_execute, in seconds,
with forward <= execute <= the time in the model <= e2e; a server without the flag sends
spans without them; and the flag without an endpoint is refused at start, naming both.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from aioserve import AsyncEngine
from aioserve.cli import main
from aioserve.config.engine import engine_config_from_args
from aioserve.config.frontend import frontend_config_from_args
from aioserve.config.parser import build_engine_parser
from aioserve.server.app import build_app
from aioserve.server.state import ServerState
from tests.server.conftest import MODEL, serve_app, serve_built
from tests.server.test_otlp_tracing import OTLPReceiver, ReceivedSpan

pytestmark = pytest.mark.usefixtures("no_api_key_env")

FORWARD = "gen_ai.latency.time_in_model_forward"
EXECUTE = "gen_ai.latency.time_in_model_execute"


@pytest.fixture(scope="module")
def receiver(server_loop) -> Iterator[tuple[OTLPReceiver, str]]:
    collector = OTLPReceiver()
    with serve_app(server_loop, collector.app) as url:
        yield collector, url + "/v1/traces"


@pytest.fixture(scope="module")
def otlp_http():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        patch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
        yield


@pytest.fixture(scope="module")
def detailed_server(smollm2_gguf, server_loop, receiver, otlp_http) -> Iterator[str]:
    """The default model served as `aioserve serve` would with the flags: its base URL."""
    args = build_engine_parser("aioserve serve").parse_args(
        ["--model", str(smollm2_gguf), "--dtype", "float32", "--seed", "0"]
        + ["--max-model-len", "1024", "--block-size", "16", "--enforce-eager"]
        + ["--otlp-traces-endpoint", receiver[1], "--collect-detailed-traces", "model,worker"]
    )
    engine = AsyncEngine.from_config(engine_config_from_args(args, serving=True))
    state = ServerState(engine, [MODEL], frontend_config_from_args(args))
    try:
        with serve_app(server_loop, build_app(state)) as url:
            yield url
    finally:
        server_loop.run(engine.shutdown())


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _check_model_times(span: ReceivedSpan) -> tuple[float, float]:
    a = span.attributes
    forward, execute = a[FORWARD], a[EXECUTE]
    assert isinstance(forward, float) and isinstance(execute, float)
    assert 0 < forward <= execute
    # Seconds, within the request's life: its steps ran between its first scheduling and
    # its last token, one after another on the model thread.
    assert execute <= a["gen_ai.latency.time_in_model_inference"] + 1e-3
    assert execute <= a["gen_ai.latency.e2e"]
    return forward, execute


def test_spans_carry_the_model_times_with_the_flag(detailed_server, receiver):
    collector, _ = receiver
    client = _client(detailed_server)
    short = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=2,
        extra_body={"ignore_eos": True},
    )
    long = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=24,
        extra_body={"ignore_eos": True},
    )
    short_times = _check_model_times(collector.wait_for(f"{short.id}-0"))
    long_times = _check_model_times(collector.wait_for(f"{long.id}-0"))
    # Summed over its steps: 24 steps take longer than 2 of the same prompt.
    assert long_times[0] > short_times[0] and long_times[1] > short_times[1]


def test_a_streamed_chat_with_two_samples_is_timed_once_per_step(detailed_server, receiver):
    collector, _ = receiver
    chunks = list(
        _client(detailed_server).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Count to five."}],
            max_tokens=8,
            n=2,
            seed=3,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    _check_model_times(collector.wait_for(chunks[0].id))


def test_without_the_flag_the_spans_have_no_model_times(server_loop, engine, receiver, otlp_http):
    collector, endpoint = receiver
    with serve_built(server_loop, engine, "--otlp-traces-endpoint", endpoint) as url:
        completion = _client(url).completions.create(model=MODEL, prompt="Plain", max_tokens=3)
        span = collector.wait_for(f"{completion.id}-0")
    assert "gen_ai.latency.e2e" in span.attributes
    assert not {FORWARD, EXECUTE} & set(span.attributes)


@pytest.mark.parametrize("modules", ["model", "worker", "all", "model,worker"])
def test_the_flag_without_an_endpoint_is_refused_at_start_naming_both(modules, capsys, tmp_path):
    # Refused before any model loads; past the check the missing chat template would stop
    # the start, with another message.
    missing = str(tmp_path / "missing.jinja")
    assert main(["serve", "--collect-detailed-traces", modules, "--chat-template", missing]) == 2
    error = capsys.readouterr().err
    assert error.startswith(
        "aioserve: error: --collect-detailed-traces requires `--otlp-traces-endpoint` to be set"
    ), error


def test_an_unknown_module_is_refused_naming_the_flag(capsys, tmp_path):
    argv = ["serve", "--otlp-traces-endpoint", "http://127.0.0.1:4318/v1/traces"]
    argv += ["--chat-template", str(tmp_path / "missing.jinja")]
    assert main([*argv, "--collect-detailed-traces", "model,gpu"]) == 2
    error = capsys.readouterr().err
    assert error.startswith(
        "aioserve: error: --collect-detailed-traces must be one or more of model, worker, all"
    ), error
