"""POST /start_profile and POST /stop_profile: torch's profiler over the engine's steps,
registered only when VLLM_TORCH_PROFILER_DIR names a folder, as in vLLM (for local
development: a trace records every op and its Python stack).

Both answer 200 with an empty body once done, as vLLM's do; /stop_profile waits for the
step running, then writes the trace (engine/step_profiler.py) and logs its path. Starting
a running profiler, or stopping a stopped one, is a 400 saying so. `bench serve --profile`
calls both around its run.
"""

from __future__ import annotations

import logging
from pathlib import Path

from aiohttp import web

from aioserve.engine.step_profiler import PROFILER_DIR_ENV, ProfilerStateError
from aioserve.server.errors import APIError
from aioserve.server.state import STATE

logger = logging.getLogger("aioserve")


def add_profile_routes(app: web.Application, directory: Path) -> None:
    """Register /start_profile and /stop_profile, their traces written in `directory`."""

    async def start_profile(request: web.Request) -> web.Response:
        logger.info("Starting profiler...")
        try:
            await request.app[STATE].engine.start_profile(directory)
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
        "%s is set: /start_profile and /stop_profile run torch's profiler, writing traces "
        "to %s. This is for local development only.",
        PROFILER_DIR_ENV,
        directory,
    )
    app.router.add_post("/start_profile", start_profile)
    app.router.add_post("/stop_profile", stop_profile)
