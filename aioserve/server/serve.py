"""`aioserve serve [model_tag] [options]`: build the engine and the app, serve, drain on exit.

Start-up, in order: the arguments are checked (an unsupported vLLM argument or a bad value
stops here, before the model loads, with a message naming it), logging is set up, the TLS
context, --middleware imports, the OpenTelemetry packages (with --otlp-traces-endpoint)
and --chat-template are checked, the engine loads the model (the default one,
SmolLM2-135M-Instruct, when none is given), one warm-up request runs through it, and the
app listens on --host/--port (or the Unix socket --uds, unix_socket.py) on a uvloop event
loop, with vLLM's header limits and access log (http_runner.py). Then one line
(`ready_line`) says how long that took since the process started, the weights' stored form
and the dtype they are held in, their bytes, the KV cache's bytes and blocks and the knob
that sized it, and the process's resident memory, before vLLM's "Application startup
complete.". Under systemd (`Type=notify`) READY=1 follows, then status and watchdog pings
(systemd_notify.py).

Shutdown: the first SIGTERM or SIGINT starts draining (STOPPING=1 under systemd). New
requests get 503 (/health too, so that load balancers move away; /metrics keeps
answering), while the requests in flight run to their end for up to --shutdown-timeout
seconds. Then whatever still runs is aborted, the listener closes (a --uds socket file is
removed), the engine stops, the spans still waiting (--otlp-traces-endpoint) are sent and
the process exits with status 0.
A second signal skips the rest of the wait. A model step that hangs does not hold the exit
up: the engine leaves it behind after a few seconds.

Engine death (engine/health.py says what kills the engine): /health turns 503 at once, the
requests in flight end with a 500 (streams with an error event), new ones get 503, and
within `_DEATH_POLL_S` the server stops as above, without the drain, and exits with
status `ENGINE_DIED_EXIT_STATUS`, so that systemd (Restart=on-failure) starts it again.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import ssl
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import web

from aioserve import __version__, host_memory
from aioserve.config.arguments import argument
from aioserve.config.declaration import ConfigError
from aioserve.config.engine import engine_config_from_args
from aioserve.config.frontend import FrontendConfig, frontend_config_from_args, log_stats_interval
from aioserve.config.values import CASCADE_ATTENTION_DEPRECATION
from aioserve.engine.sampling_params import SamplingParams
from aioserve.log_setup import configure_logging
from aioserve.server.errors import APIError
from aioserve.server.http_runner import make_runner
from aioserve.server.middlewares import IN_FLIGHT, RequestsInFlight, import_middlewares
from aioserve.server.systemd_notify import SystemdService
from aioserve.server.tls_refresh import TLSRefresher
from aioserve.server.tool_calls import check_tool_call_settings
from aioserve.server.unix_socket import UnixSocket, check_socket_path

if TYPE_CHECKING:
    from aioserve.engine.async_engine import AsyncEngine
    from aioserve.engine.settings import EngineSettings
    from aioserve.server.state import ServerState

logger = logging.getLogger("aioserve")
T = TypeVar("T")

ENGINE_DIED_EXIT_STATUS = 1
_DEATH_POLL_S = 0.1
_WARM_UP_PROMPT_TOKENS = 8
_SECRET_ARGUMENTS = frozenset({"api_key", "hf_token"})


def build_ssl_context(frontend: FrontendConfig) -> ssl.SSLContext | None:
    """The server's TLS context from --ssl-certfile/-keyfile/-ca-certs/-cert-reqs/-ciphers,
    if any. The ciphers stay the context's when --enable-ssl-refresh loads new files into it."""
    certfile, keyfile, ca_certs = (
        frontend.ssl_certfile,
        frontend.ssl_keyfile,
        frontend.ssl_ca_certs,
    )
    if certfile is None:
        if (
            keyfile
            or ca_certs
            or frontend.ssl_cert_reqs
            or frontend.ssl_ciphers
            or frontend.enable_ssl_refresh
        ):
            raise ConfigError(
                "--ssl-keyfile, --ssl-ca-certs, --ssl-cert-reqs, --ssl-ciphers and "
                "--enable-ssl-refresh need --ssl-certfile"
            )
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as error:
        raise ConfigError(
            f"--ssl-certfile {certfile} (--ssl-keyfile {keyfile}): cannot load the "
            f"certificate and its key: {error}"
        ) from None
    if ca_certs:
        try:
            context.load_verify_locations(ca_certs)
        except (OSError, ssl.SSLError) as error:
            raise ConfigError(f"--ssl-ca-certs {ca_certs}: cannot load: {error}") from None
    context.verify_mode = ssl.VerifyMode(frontend.ssl_cert_reqs)
    if frontend.ssl_ciphers:
        try:
            context.set_ciphers(frontend.ssl_ciphers)
        except ssl.SSLError as error:  # the argument's check has tried it already
            raise ConfigError(f"--ssl-ciphers {frontend.ssl_ciphers!r}: {error}") from None
    return context


def run_serve(args: argparse.Namespace) -> int:
    """Run the server until a signal or the engine's death ends it; the exit status."""
    started = time.monotonic()
    config = engine_config_from_args(args, serving=True)
    frontend = frontend_config_from_args(args)
    configure_logging(frontend.uvicorn_log_level, args=config.logging)
    ssl_context = build_ssl_context(frontend)
    if frontend.uds is not None:
        check_socket_path(frontend.uds)
        if hasattr(args, "host") or hasattr(args, "port"):
            logger.warning("--host and --port are ignored: the server listens on --uds")
    import_middlewares(frontend.middleware)
    check_tool_call_settings(frontend)
    if hasattr(args, "disable_cascade_attn"):
        logger.warning(CASCADE_ATTENTION_DEPRECATION)
    if not frontend.disable_log_stats:
        log_stats_interval()  # a bad VLLM_LOG_STATS_INTERVAL stops the start here
    if frontend.lora_modules and not config.lora.enable_lora:
        raise ConfigError("--lora-modules needs --enable-lora")
    # The modules below load torch and transformers (seconds): a refused argument is
    # reported before that.
    from aioserve.engine.async_engine import AsyncEngine
    from aioserve.engine.step_profiler import torch_activities
    from aioserve.server.app import build_app
    from aioserve.server.chat_template import load_chat_template
    from aioserve.server.state import ServerState
    from aioserve.server.tracing import check_tracing

    if config.profiler.profiler_config is not None:
        torch_activities(config.profiler.profiler_config)  # CUDA needs a GPU
    if frontend.otlp_traces_endpoint is not None:
        check_tracing()
    if frontend.chat_template is not None:
        try:
            load_chat_template(frontend.chat_template)
        except (OSError, ValueError) as error:
            raise ConfigError(str(error)) from None
    logger.info("aioserve API server version %s", __version__)
    logger.info("non-default args: %s", _given_arguments(args))
    if host_memory.changes:
        logger.info("host memory: %s (see aioserve/host_memory.py)", "; ".join(host_memory.changes))
    try:
        engine = AsyncEngine.from_config(config)
    except ValueError as error:  # a model that cannot be found or does not fit the settings
        raise ConfigError(str(error)) from None
    except KeyboardInterrupt:  # Ctrl-C before the loop (and its signal handlers) runs
        logger.info("Interrupted while loading the model")
        return 130
    state = ServerState(
        engine,
        list(engine.settings.served_model_names),
        frontend,
        profiler=config.profiler.profiler_config,
    )
    app = build_app(state)
    status = run_on_uvloop(_serve(app, state, ssl_context, started))
    logger.info("Finished server process")
    return status


def run_on_uvloop(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run the coroutine to its end on a new uvloop event loop (the server's loop)."""
    try:
        import uvloop
    except ImportError:  # no uvloop build for this platform: the standard loop works too
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


async def _serve(
    app: web.Application,
    state: ServerState,
    ssl_context: ssl.SSLContext | None,
    started: float,
) -> int:
    """Serve until a signal or the engine's death; the exit status. `started`: the
    time.monotonic() at which run_serve began."""
    frontend = state.frontend
    systemd = SystemdService(state.engine)
    runner = make_runner(app, frontend)
    unix_socket = UnixSocket(frontend.uds) if frontend.uds is not None else None
    tls_refresher = None
    if ssl_context is not None and frontend.enable_ssl_refresh:
        tls_refresher = TLSRefresher(
            ssl_context, frontend.ssl_certfile, frontend.ssl_keyfile, frontend.ssl_ca_certs
        )
        tls_refresher.start()
    try:
        await _load_lora_modules(state)
        await _warm_up(state.engine)
        await runner.setup()
        await _listen(runner, frontend, ssl_context, unix_socket)
        ready = ready_line(state.engine.settings, seconds_since_start(started))
        _log_started(app, runner, frontend, ssl_context is not None, ready)
        first, second = asyncio.Event(), asyncio.Event()
        _on_stop_signals(first, second)
        systemd.ready()
        if not await _stopped_or_dead(first, state.engine):
            systemd.stopping()
            state.draining = True
            await _drain(app[IN_FLIGHT], frontend.shutdown_timeout, second)
        if state.engine.is_dead:
            state.draining = True
            logger.error(
                "The engine is dead (%s): exiting with status %d so that the service manager "
                "restarts the server",
                state.engine.health_problem(),
                ENGINE_DIED_EXIT_STATUS,
            )
            return ENGINE_DIED_EXIT_STATUS
        logger.info("Shutting down")
        return 0
    finally:
        if tls_refresher is not None:
            await tls_refresher.stop()
        await systemd.close()
        # Aborting what still runs first lets its handlers end their responses themselves.
        await state.engine.shutdown()
        await runner.cleanup()
        if unix_socket is not None:
            unix_socket.remove()


async def _listen(
    runner: web.AppRunner,
    frontend: FrontendConfig,
    ssl_context: ssl.SSLContext | None,
    unix_socket: UnixSocket | None,
) -> None:
    """Start serving on --uds's socket, or on --host/--port; a ConfigError when it cannot."""
    if unix_socket is not None:
        await web.SockSite(runner, unix_socket.bind(), ssl_context=ssl_context).start()
        return
    site = web.TCPSite(runner, frontend.host, frontend.port, ssl_context=ssl_context)
    try:
        await site.start()
    except OSError as error:
        raise ConfigError(
            f"cannot listen on {frontend.host or '*'}:{frontend.port}: {error.strerror}"
        ) from None


def _given_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The arguments given on the command line, as typed values (as vLLM logs them), the
    secret ones hidden. Call it once the configs are built: every value is valid by then."""
    given = {}
    for name, value in sorted(vars(args).items()):
        if name in ("run", "subcommand"):
            continue
        declared = argument(name)
        if name in _SECRET_ARGUMENTS:
            value = "<hidden>"
        elif declared is not None and declared.supported:
            value = declared.check(value, declared.flag)
        given[name] = value
    return given


async def _load_lora_modules(state: ServerState) -> None:
    """Read and serve the --lora-modules adapters; a ConfigError naming the first that
    cannot be served."""
    for module in state.frontend.lora_modules or ():
        try:
            await state.loras.load(module.name, module.path, module.base_model_name)
        except APIError as error:
            raise ConfigError(f"--lora-modules {module.name}: {error.message}") from None
        logger.info("LoRA adapter %r served from %s", module.name, module.path)


async def _warm_up(engine: AsyncEngine) -> None:
    """Run one request through the engine before the port opens: a prefill and a decode step
    (a pooling model's: one prompt pooled).

    The first steps pay one-time costs (on a GPU, Triton compiling the kernels): here, before
    READY=1, instead of in a client's first request, and a model that cannot run a step
    stops the start. The fixed seed leaves the engine's draws for unseeded requests as they
    were.
    """
    started = time.monotonic()
    prompt = {"prompt_token_ids": [0] * _WARM_UP_PROMPT_TOKENS}
    if engine.settings.runner_type == "pooling":
        from aioserve.engine.pooling_params import PoolingParams  # torch: not before the checks

        task = engine.settings.pooler.task  # "embed" or "classify"
        await engine.encode(prompt, PoolingParams(task=task), "aioserve-warm-up")
    else:
        params = SamplingParams(
            max_tokens=2, ignore_eos=True, temperature=0.0, seed=0, detokenize=False
        )
        async for _ in engine.generate(prompt, params, "aioserve-warm-up"):
            pass
    logger.info("warm-up request done in %.2f s", time.monotonic() - started)


async def _stopped_or_dead(stop: asyncio.Event, engine: AsyncEngine) -> bool:
    """Wait until `stop` is set (False) or the engine is dead (True)."""
    while not stop.is_set():
        if engine.is_dead:
            return True
        await asyncio.sleep(_DEATH_POLL_S)
    return False


def _on_stop_signals(first: asyncio.Event, second: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()

    def received(name: str) -> None:
        if first.is_set():
            logger.info("Received %s again: stopping now", name)
            second.set()
        else:
            logger.info("Received %s: no new requests; draining the ones in flight", name)
            first.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, received, sig.name)


async def _drain(in_flight: RequestsInFlight, timeout: float, stop_now: asyncio.Event) -> None:
    """Wait until no request is in flight, `timeout` seconds pass, or `stop_now` is set."""
    if in_flight.count == 0 or timeout == 0:
        return
    logger.info("Waiting up to %gs for %d request(s) in flight", timeout, in_flight.count)
    idle = asyncio.ensure_future(in_flight.wait_idle())
    stopped = asyncio.ensure_future(stop_now.wait())
    await asyncio.wait({idle, stopped}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    for task in (idle, stopped):
        task.cancel()
    if in_flight.count:
        logger.warning("Aborting %d request(s) still in flight", in_flight.count)


def seconds_since_start(serve_started: float) -> float:
    """Seconds since the process started, read from /proc/self/stat: that counts the
    interpreter's start and the imports before run_serve too. Without /proc, since
    `serve_started`, run_serve's time.monotonic() at its start."""
    try:
        with open("/proc/self/stat") as stat:
            # After the command name in parentheses, field 22 (starttime, in clock ticks
            # since boot) is the 20th.
            ticks = int(stat.read().rpartition(")")[2].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic() - serve_started


def ready_line(settings: EngineSettings, seconds: float) -> str:
    """What the process loaded and holds, and how long it took to be ready: one log line."""
    from aioserve.engine.load_report import format_bytes, resident_memory_bytes

    line = f"aioserve ready in {seconds:.1f} s"
    if settings.load_report is not None:
        line += f": {settings.load_report.describe()}"
    resident = resident_memory_bytes()
    if resident is not None:
        # On a GPU the weights and the KV cache are in device memory, not in this figure.
        host = "" if settings.device.type == "cpu" else " (host)"
        line += f"; resident memory{host} {format_bytes(resident)}"
    return line


def _log_started(
    app: web.Application,
    runner: web.AppRunner,
    frontend: FrontendConfig,
    tls: bool,
    ready: str,
) -> None:
    root_path = frontend.root_path
    routes: dict[str, list[str]] = {}
    for route in app.router.routes():
        path = route.resource.canonical
        if not (root_path and path.startswith(root_path + "/")):
            routes.setdefault(path, []).append(route.method)
    for path, methods in routes.items():
        logger.info("Route: %s, Methods: %s", path, ", ".join(methods))
    scheme = "https" if tls else "http"
    for address in runner.addresses:
        if isinstance(address, str):  # a Unix socket's path: vLLM's "unix:<path>"
            logger.info("Starting aioserve API server on unix:%s%s", address, " (TLS)" * tls)
            continue
        host, port = address[:2]
        host = f"[{host}]" if ":" in host else host
        logger.info("Starting aioserve API server on %s://%s:%d", scheme, host, port)
    if root_path:
        logger.info("Every route also answers under %s", root_path)
    logger.info("%s", ready)
    logger.info("Application startup complete.")
