"""Running a route's prompts on the engine: error mapping and merging several streams.

`engine_outputs` wraps `AsyncEngine.generate` so that its errors read as HTTP errors: a
request the engine refuses when registering it (a ValueError) is a 400, an engine that
failed while running it a 500. `merge_outputs` runs one engine request per prompt and
yields their outputs as they come, tagged with the prompt's index.

Both close what they run however they end (finished, error, client gone, handler
cancelled): closing the engine's iterator aborts its request, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing
from http import HTTPStatus

from aioserve.engine.async_engine import AsyncEngine, PromptType
from aioserve.engine.outputs import RequestOutput
from aioserve.engine.sampling_params import SamplingParams
from aioserve.server.errors import APIError


async def engine_outputs(
    engine: AsyncEngine,
    prompt: PromptType,
    params: SamplingParams,
    request_id: str,
    priority: int = 0,
) -> AsyncGenerator[RequestOutput, None]:
    """`engine.generate`, with its errors as APIError (400 refused, 500 failed)."""
    stream = engine.generate(prompt, params, request_id, priority=priority)
    async with aclosing(stream):
        try:
            first = await anext(stream)
        except ValueError as error:  # refused when registering: the request's fault
            raise APIError(str(error)) from None
        except RuntimeError as error:
            raise APIError(str(error), HTTPStatus.INTERNAL_SERVER_ERROR) from None
        yield first
        try:
            async for output in stream:
                yield output
        except RuntimeError as error:  # the model step or the engine loop failed
            raise APIError(str(error), HTTPStatus.INTERNAL_SERVER_ERROR) from None


async def merge_outputs(
    streams: list[AsyncGenerator[RequestOutput, None]],
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """(stream index, output) from all `streams`, in the order the outputs arrive."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as stream:
            async for output in stream:
                yield 0, output
        return
    pending: dict[asyncio.Task, int] = {}
    try:
        for index, stream in enumerate(streams):
            pending[asyncio.ensure_future(anext(stream))] = index
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                try:
                    output = task.result()
                except StopAsyncIteration:
                    continue
                yield index, output
                pending[asyncio.ensure_future(anext(streams[index]))] = index
    finally:
        for task in pending:
            task.cancel()
        # A stream's generator cannot be closed while a task is still running it.
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
