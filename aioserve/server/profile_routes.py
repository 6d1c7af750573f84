"""POST /start_profile and POST /stop_profile: torch's profiler over the engine's steps,
registered only when --profiler-config asks for the torch profiler (or, as in older vLLMs,
VLLM_TORCH_PROFILER_DIR names a folder): for local development, a trace records every op
and, by default, its Python stack (config/profiler.py has the options).

Both answer 200 with an empty body once done, as vLLM's do; /stop_profile waits for the
step running, then writes the trace (engine/step_profiler.py) and logs its path. Starting
a running profiler, or stopping a stopped one, is a 400 saying so. `bench serve --profile`
calls both around its run.
"""

from __future__ import annotations

import logging

from aiohttp import web

from aioserve.config.profiler import ProfilerSettings
from aioserve.engine.step_profiler import ProfilerStateError, torch_activities
from aioserve.server.errors import APIError
from aioserve.server.state import STATE

logger = logging.getLogger("aioserve")


def add_profile_routes(app: web.Application, settings: ProfilerSettings) -> None:
    """Register /start_profile and /stop_profile, their sessions run as `settings` say; a
    ConfigError when this machine cannot record what they ask for."""
    torch_activities(settings)

    async def start_profile(request: web.Request) -> web.Response:
        logger.info("Starting profiler...")
        try:
            await request.app[STATE].engine.start_profile(settings)
        except ProfilerStateError as error:
            raise APIError(str(error)) from None
        logger.info("Profiler started.")
        return web.Response()

    async def stop_profile(request: web.Request) -> web.Response:
        logger.info("Stopping profiler...")
        try:
            trace = await request.app[STATE].engine.stop_profile()
        except ProfilerStateError as error:
            raise APIError(str(error)) from None
        logger.info("Profiler stopped: trace written to %s", trace)
        return web.Response()

    logger.warning(
        "Profiler with mode 'torch' is enabled in the API server: /start_profile and "
        "/stop_profile write traces to %s. This should ONLY be used for local development!",
        settings.torch_profiler_dir,
    )
    app.router.add_post("/start_profile", start_profile)
    app.router.add_post("/stop_profile", stop_profile)
