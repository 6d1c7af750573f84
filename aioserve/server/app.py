"""The aiohttp application: middlewares, routes and hooks, put together from a ServerState.

`build_app(state)` is the one place where the server's parts meet: the middlewares
(middlewares.py, in the order described there), this module's routes (routes.py), the
OpenAI generation routes (openai_routes.py) and vLLM's scale-out routes (scale_out.py)
or, for a pooling model, the pooling routes of its task (pooling_routes.py:
embeddings.py, classify.py, scoring.py), SageMaker's
/invocations in front of those (invocations.py), the profiler's routes where
--profiler-config (or VLLM_TORCH_PROFILER_DIR) asks for one (profile_routes.py), the
development routes with VLLM_SERVER_DEV_MODE=1 (dev_routes.py), the metrics (metrics.py),
the request tracer with --otlp-traces-endpoint (tracing.py), GET /tokenizer_info with
--enable-tokenizer-info-endpoint (tokenizer_info.py) and the schema and docs pages
(openapi.py).
`serve.py` runs the app; tests run it in-process.
"""

from __future__ import annotations

from aiohttp import web

from aioserve.config.frontend import log_stats_interval
from aioserve.server.dev_routes import add_dev_routes, dev_mode
from aioserve.server.errors import LOG_ERROR_STACK, error_middleware
from aioserve.server.invocations import add_invocations_route
from aioserve.server.lora_routes import add_lora_routes
from aioserve.server.metrics import add_metrics
from aioserve.server.middlewares import (
    IN_FLIGHT,
    MAX_REQUEST_BODY_BYTES,
    CorsPolicy,
    RequestsInFlight,
    api_key_middleware,
    configured_api_keys,
    cors_preflight_middleware,
    cors_response_hook,
    drain_middleware,
    import_middlewares,
    request_id_hook,
    request_log_middleware,
    route_error_middleware,
)
from aioserve.server.openai_routes import add_openai_routes
from aioserve.server.openapi import add_docs_routes
from aioserve.server.pooling_routes import add_pooling_routes
from aioserve.server.profile_routes import add_profile_routes
from aioserve.server.routes import add_routes
from aioserve.server.scale_out import add_scale_out_routes
from aioserve.server.state import STATE, ServerState
from aioserve.server.tokenizer_info import add_tokenizer_info_route
from aioserve.server.tracing import RequestTracer


async def _stop_text_thread(app: web.Application) -> None:
    app[STATE].text_thread.shutdown(wait=False, cancel_futures=True)


async def _stop_tracer(app: web.Application) -> None:
    """Send the spans still waiting and stop the exporter (--otlp-traces-endpoint)."""
    tracer = app[STATE].tracer
    if tracer is not None:
        await tracer.shutdown()


def build_app(state: ServerState) -> web.Application:
    """The app serving `state.engine` as `state.frontend` configures it.

    Raises ConfigError when a --middleware import path cannot be imported, or when
    --otlp-traces-endpoint is set without the OpenTelemetry packages (tracing.py).
    """
    frontend = state.frontend
    root_path = frontend.root_path
    in_flight = RequestsInFlight()
    cors = CorsPolicy(
        frontend.allowed_origins,
        frontend.allowed_methods,
        frontend.allowed_headers,
        frontend.allow_credentials,
    )
    middlewares = [
        error_middleware,
        *import_middlewares(frontend.middleware),
        drain_middleware(lambda: state.draining, in_flight, root_path),
        cors_preflight_middleware(cors),
    ]
    api_keys = configured_api_keys(frontend)
    if api_keys:
        middlewares.append(api_key_middleware(api_keys, root_path))
    middlewares.append(route_error_middleware)
    if frontend.enable_log_requests and not frontend.disable_log_requests:
        middlewares.append(request_log_middleware(frontend.max_log_len))

    app = web.Application(middlewares=middlewares, client_max_size=MAX_REQUEST_BODY_BYTES)
    app[STATE] = state
    app.on_cleanup.append(_stop_text_thread)
    if frontend.otlp_traces_endpoint is not None:
        state.tracer = RequestTracer(frontend.otlp_traces_endpoint)
        app.on_cleanup.append(_stop_tracer)
    app[IN_FLIGHT] = in_flight
    log_stack = frontend.log_error_stack
    app[LOG_ERROR_STACK] = dev_mode() if log_stack is None else log_stack
    app.on_response_prepare.append(cors_response_hook(cors))
    if frontend.enable_request_id_headers:
        app.on_response_prepare.append(request_id_hook)

    add_routes(app, load_tracking=frontend.enable_server_load_tracking)
    if frontend.enable_tokenizer_info_endpoint:
        add_tokenizer_info_route(app)
    if state.engine.settings.runner_type == "pooling":
        add_pooling_routes(app)  # as vLLM, no generation routes for a pooling model
    else:
        add_openai_routes(app)
        add_lora_routes(app)
        add_scale_out_routes(app, frontend)
    add_invocations_route(app)
    if state.profiler is not None:
        add_profile_routes(app, state.profiler)
    if dev_mode():
        add_dev_routes(app)
    add_metrics(
        app, state, stats_interval=None if frontend.disable_log_stats else log_stats_interval()
    )
    if not frontend.disable_fastapi_docs:
        add_docs_routes(app, root_path)
    if root_path:
        _also_under(app, root_path)
    return app


def _also_under(app: web.Application, root_path: str) -> None:
    """Make every route answer under `root_path` as well (for path-routing proxies)."""
    for route in list(app.router.routes()):
        if route.method != "HEAD":  # add_get adds HEAD again for the prefixed path
            path = root_path + route.resource.canonical
            if route.method == "GET":
                app.router.add_get(path, route.handler)
            else:
                app.router.add_route(route.method, path, route.handler)
