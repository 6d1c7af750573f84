"""Running a route's prompts on the engine: error mapping and merging several streams.

`engine_outputs` wraps `AsyncEngine.generate` so that its errors read as HTTP errors: a
request the engine refuses when registering it (a ValueError) is a 400, an engine that
failed while running it a 500. `merge_outputs` runs one engine request per prompt and
yields their outputs as they come, tagged with the prompt's index.

Both close what they run however they end (finished, error, client gone, handler
cancelled): closing the engine's iterator aborts its request, which frees its KV blocks.

With --otlp-traces-endpoint, a handler passes the HTTP request's `RequestTrace` and
`engine_outputs` sends each finished request's span (tracing.py).

Load shedding (engine/load_shedding.py): a handler calls `reserve_places` once it knows
how many sequences it will start, before rendering or tokenizing anything, and passes the
reservation to `engine_outputs`, which hands each prompt's places over to the engine as
it registers the prompt. A refusal, there or on registration, is a 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing
from http import HTTPStatus

from aioserve.engine.admission import InvalidRequest
from aioserve.engine.async_engine import AsyncEngine, PromptType
from aioserve.engine.load_shedding import QueueFullError, Reservation
from aioserve.engine.lora_requests import LoRARequest
from aioserve.engine.outputs import RequestOutput
from aioserve.engine.sampling_params import SamplingParams
from aioserve.server.body_fields import shown_value
from aioserve.server.errors import APIError, bad_parameter
from aioserve.server.tracing import RequestTrace, traced_outputs

RETRY_AFTER_S = "1"
"""The Retry-After of a shed request, as of a draining server's 503."""


def overloaded(error: QueueFullError) -> APIError:
    """The 503 of a request a queue cap refused."""
    return APIError(
        error.message, HTTPStatus.SERVICE_UNAVAILABLE, headers={"Retry-After": RETRY_AFTER_S}
    )


def reserve_places(engine: AsyncEngine, num_sequences: int) -> Reservation:
    """Hold `num_sequences` places in flight for a request on its way in, or raise the 503."""
    try:
        return engine.load_shedder.reserve(num_sequences)
    except QueueFullError as error:
        raise overloaded(error) from None


async def engine_outputs(
    engine: AsyncEngine,
    prompt: PromptType,
    params: SamplingParams,
    request_id: str,
    priority: int = 0,
    reservation: Reservation | None = None,
    lora_request: LoRARequest | None = None,
    trace: RequestTrace | None = None,
) -> AsyncGenerator[RequestOutput, None]:
    """`engine.generate`, with its errors as APIError (400 refused, 500 failed, 503 shed),
    through the LoRA adapter `lora_request` if given; traced (a span once finished) with
    a `trace` (--otlp-traces-endpoint)."""
    stream = engine.generate(
        prompt, params, request_id, priority=priority, lora_request=lora_request
    )
    if trace is not None:
        stream = traced_outputs(stream, trace, request_id, params, engine.settings)
    async with aclosing(stream):
        try:
            if reservation is not None:
                # Released just before `generate` registers the request, with no await in
                # between: the places pass to the engine's count without a gap to take.
                reservation.release(params.n)
            first = await anext(stream)
        except QueueFullError as error:
            raise overloaded(error) from None
        except InvalidRequest as error:  # refused when registering: the request's fault
            raise bad_parameter(error.param, shown_value(error.value), str(error)) from None
        except ValueError as error:  # the same, where no one field is at fault
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
