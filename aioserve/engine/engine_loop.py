"""The engine's loop: one scheduler coroutine between the requests and the model thread.

`EngineLoop` holds a running engine's state (scheduler, KV-cache bookkeeping, output
processor, the requests' states and streams) and runs, once started in the running event
loop, the loop that repeats:

    schedule (CPU) -> prepare inputs (CPU) -> hand the step to the model thread
    -> await the oldest step in flight -> record its sampled tokens (or a pooling model's
    vectors), stop checks, free blocks -> detokenize, tell each request's consumer it has
    news

The model step is the only thing that leaves the event loop, so HTTP handlers keep
running while the device computes. A consumer builds its output when it takes it, one for
all the steps it missed. When the host is the bottleneck, the loop goes on from a step
that is done without letting the consumers run, for up to `RUN_AHEAD_S`
(steps_in_flight.py), so that the device does not wait for them. A request whose consumer
goes away is aborted and its KV blocks return to the pool before the next step is
scheduled.

With asynchronous scheduling (`async_scheduling`, vLLM's --async-scheduling) two steps are
in flight: step N+1 is scheduled, prepared and queued on the model thread before step N's
tokens reach the host, so the device goes from one step to the next without waiting for
the host; the host learns step N's tokens while N+1 runs, one step late. Decodes in N+1 of
tokens sampled in N take them from the runner's device-side record. A request that step
N ends (EOS, a stop string, an abort) may still have a row in N+1: that token is dropped.
Without it, one step is in flight and the host works between steps. `host_gap` in each
StepStats is how long the model thread waited for the host before a step.

The engine dies when a step fails in a way that is not its requests' fault (health.py says
which), when the model thread is gone, or when the loop's own host work (scheduling,
recording tokens) raises. A dead engine ends every request with EngineDeadError and
refuses new ones. `health_problem()` says so at once, and also when the loop, busy, has
stopped going round (a hung model step).

The requests come in through its subclass, AsyncEngine (async_engine.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import threading
import time
from collections import deque

from aioserve.engine.health import EngineDeadError, LoopClock, StepFailures, death_message
from aioserve.engine.kv_cache_manager import KVCacheManager
from aioserve.engine.kv_events import kv_event_stream
from aioserve.engine.load_shedding import LoadShedder
from aioserve.engine.model_thread import ModelThread
from aioserve.engine.output_processor import OutputProcessor, RequestState
from aioserve.engine.output_stream import OutputStream
from aioserve.engine.pause import Pause
from aioserve.engine.prompt_delay import prompt_delay
from aioserve.engine.request import Request, RequestStatus
from aioserve.engine.scheduler import Scheduler, SchedulerOutput
from aioserve.engine.settings import EngineParts
from aioserve.engine.sleep import engine_sleep
from aioserve.engine.stats import StatLogger, StatsReporter, StepTally
from aioserve.engine.step_observation import StepObservation, StepObserver, residency_tracker
from aioserve.engine.step_timing import StepTiming, step_timer
from aioserve.engine.steps_in_flight import StepInFlight, StepWaiter, run_timed
from aioserve.engine.structured_outputs.compiler import StructuredOutputCompiler
from aioserve.engine.structured_outputs.step_masks import StepMasks, advance_constraint
from aioserve.runner.step_plan import StepResult

logger = logging.getLogger("aioserve")


SHUTDOWN_WAIT_S = 5.0
"""How long `shutdown` waits for a running model step before leaving it behind."""


class EngineLoop:
    def __init__(self, parts: EngineParts, model_thread: ModelThread | None = None) -> None:
        self.settings = parts.settings
        self.tokenizer = parts.tokenizer
        self.hf_config = parts.hf_config
        self.runner = parts.runner
        self.image_processor = parts.image_processor  # None: the model takes no images
        s = self.settings
        self.kv_events = kv_event_stream(s.kv_events)  # None without --kv-events-config
        self.kv_cache = KVCacheManager(
            s.num_blocks,
            s.block_size,
            s.enable_prefix_caching,
            s.prefix_caching_hash_algo,
            residency=residency_tracker(s.observability),
            events=None if self.kv_events is None else self.kv_events.recorder,
        )
        self.scheduler = Scheduler(
            self.kv_cache,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            max_model_len=s.max_model_len,
            enable_chunked_prefill=s.enable_chunked_prefill,
            policy=s.scheduling_policy,
            long_prefill_token_threshold=s.long_prefill_token_threshold,
            max_loras=s.max_loras,
            speculation=s.speculation,
            partial_prefills=s.partial_prefills,
            prompt_delay=prompt_delay(s.scheduler_delay_factor),
            limits=s.scheduler_limits,
        )
        self.lora_adapters = parts.lora_adapters
        self._pause = Pause(self.scheduler)  # /pause and /resume (pause.py)
        self._sleep = engine_sleep(parts)  # /sleep and /wake_up (sleep.py)
        self.load_shedder = LoadShedder(
            self.scheduler, s.max_num_queued_reqs, s.max_num_queued_tokens
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.structured_outputs = StructuredOutputCompiler(
            self.tokenizer,
            self.hf_config.vocab_size,
            s.structured_outputs,
            s.speculation.num_speculative_tokens if s.speculation else 0,
        )
        self._seed_rng = random.Random(s.seed)
        self._arrivals = itertools.count()
        self._states: dict[str, RequestState] = {}  # user request id -> state
        self._queues: dict[str, OutputStream] = {}
        self._sample_of: dict[str, tuple[RequestState, int]] = {}  # sequence id -> (state, index)
        self._model_thread = model_thread or ModelThread()
        self._step_timer = step_timer(  # --collect-detailed-traces; None without it
            self.runner,
            s.device,
            forward=s.collect_model_forward_time,
            execute=s.collect_model_execute_time,
        )
        # Waits for a GPU step, off the loop; a daemon thread, so that a hung device does
        # not keep the process from exiting.
        self._waiter: ModelThread | None = None
        self._last_step_end: float | None = None  # when the model thread last went idle
        self._step_waiter = StepWaiter()
        self._loop_task: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        self._dead: BaseException | None = None
        self._failures = StepFailures()
        self.loop_clock = LoopClock()
        self._stats = StatsReporter(kv_cache_in_memory=s.pooler is None)
        self._observer = (
            StepObserver(s.observability, self.runner) if s.observability.observes_steps else None
        )
        self.stat_loggers: list[StatLogger] = self._stats.loggers

    def abort(self, request_id: str, record: bool = False) -> None:
        """End a request now; its blocks are free before the next step is scheduled. As
        vLLM's abort, a request ended by its client (not `record`ed) leaves the per-request
        figures (finish reasons, latencies, token counts) alone."""
        state = self._states.get(request_id)
        if state is None:
            return
        unfinished = [s for s in state.samples if s.finish_reason is None]
        self.scheduler.finish_requests(
            [s.request.request_id for s in unfinished], RequestStatus.FINISHED_ABORTED
        )
        for sample in unfinished:  # a sibling that already ended has said so once
            self.output_processor.finish_sample(sample)
            state.changed.add(sample.index)
        self._deliver(state, record=record)
        self._stats.step_done(self.scheduler, self.kv_cache)

    # -- the engine loop --------------------------------------------------------------------

    def _ensure_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if (
            self._loop_task is not None
            and not self._loop_task.done()
            and self._loop_task.get_loop() is loop
        ):
            return
        self._wakeup = asyncio.Event()
        self._loop_task = loop.create_task(self._engine_loop(), name="aioserve-engine-loop")

    async def _engine_loop(self) -> None:
        depth = 2 if self.settings.async_scheduling else 1
        in_flight: deque[StepInFlight] = deque()
        self._last_step_end = None
        clock = self.loop_clock
        try:
            while True:
                clock.last_tick = time.monotonic()
                if len(in_flight) < depth and self._pause.has_work():
                    output = self.scheduler.schedule()
                    if not output.is_empty:
                        step = self._launch_step(output, fill_masks=not in_flight)
                        if step is not None:  # else preparing it failed its requests
                            in_flight.append(step)
                        continue
                if in_flight:
                    step = in_flight.popleft()
                    await self._finish_step(step, in_flight[0] if in_flight else None)
                    continue
                if self._pause.has_work():
                    raise RuntimeError(
                        "the scheduler found nothing to run although requests are waiting"
                    )
                self._pause.settle()
                self._wakeup.clear()
                clock.parked = True
                await self._wakeup.wait()
                clock.parked = False
                self._last_step_end = None  # the model thread was idle for lack of work
        except Exception as error:
            logger.error("the engine died: %s", error, exc_info=error)
            self._die(error)
        finally:
            clock.parked = True  # stopped, dead or cancelled: not a stall
            self._pause.settle()
            for step in in_flight:  # no step may wait for masks that will never come
                if step.masks is not None and not step.masks.bitmask.is_ready:
                    step.masks.abandon()

    def _die(self, error: BaseException) -> None:
        """No step can run again: end every request with EngineDeadError, refuse new ones."""
        self._dead = error
        message = death_message(error)
        now = time.monotonic()
        for state in list(self._states.values()):
            queue = self._queues.get(state.request_id)
            if queue is not None:
                queue.put_nowait(EngineDeadError(message))
            self._stats.request_finished(state, now, "error")
            self._forget(state)
        self._stats.step_done(self.scheduler, self.kv_cache)

    def _launch_step(self, output: SchedulerOutput, fill_masks: bool) -> StepInFlight | None:
        """Prepare a scheduled step and queue it on the model thread (None if preparing
        failed). Its structured-output masks are filled now if `fill_masks`, else once the
        step in flight before it has returned its tokens."""
        self._mark_scheduled(output)
        index = self._failures.launch()
        masks = StepMasks.plan(output, self.hf_config.vocab_size)
        try:
            prepared = self.runner.prepare(output.plan)
        except Exception as error:
            self._step_failed(output, index, error, "preparing a model step failed")
            return None
        if masks is not None and fill_masks:
            self._fill_masks(masks)
        started = threading.Event()
        future = self._model_thread.submit(
            run_timed, self.runner, prepared, started, self._step_timer
        )
        observed = None if self._observer is None else self._observer.launched(output, prepared)
        return StepInFlight(index, output, future, started, masks, observed)

    async def _finish_step(self, step: StepInFlight, next_step: StepInFlight | None) -> None:
        """Wait for a step's tokens, record them and deliver the outputs; then fill the
        structured-output masks of the step after it, which may be waiting for them."""
        masks = next_step.masks if next_step is not None else None
        try:
            await self._record_step(step, next_step)
        except BaseException:
            if masks is not None:
                masks.abandon()
            raise
        if masks is not None and not masks.bitmask.is_ready:
            self._fill_masks(masks)

    def _fill_masks(self, masks: StepMasks) -> None:
        dead_ends = masks.fill()
        if dead_ends:
            self._end_with_error(dead_ends, "its structured output allows no further token")

    def _end_with_error(self, requests: list[Request], why: str) -> None:
        """End sequences that cannot go on, with finish_reason "error"."""
        for request in requests:
            logger.warning("request %s ends: %s", request.request_id, why)
        ids = [request.request_id for request in requests]
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        for request in requests:
            state, index = self._sample_of.get(request.request_id, (None, 0))
            if state is not None and state.samples[index].request is request:
                self.output_processor.finish_sample(state.samples[index])
                state.changed.add(index)
                self._deliver(state)

    async def _record_step(self, step: StepInFlight, next_step: StepInFlight | None) -> None:
        try:
            executed = await self._step_waiter.result(step)
            if next_step is not None:
                # Let the model thread get the next step going before this thread takes the
                # GIL for its long stretch of host work: a thread waiting for the GIL waits
                # up to the switch interval (5 ms), so losing that race stalls the device.
                next_step.started.wait(0.001)
            if not executed.output.is_ready():
                if self._waiter is None:
                    self._waiter = ModelThread("aioserve-wait")
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(self._waiter, executed.output.wait)
            result = self.runner.collect(executed.output)
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # from the model thread: SystemExit is not ours
            self._step_failed(step.scheduled, step.index, error, "a model step failed")
            return
        self._failures.completed()
        self.loop_clock.step_seconds.append(executed.ended - executed.started)
        host_gap = None
        if self._last_step_end is not None:
            host_gap = max(0.0, executed.started - self._last_step_end)
        self._last_step_end = executed.ended
        if executed.timing is not None:
            self._add_step_times(step.scheduled, executed.timing)
        finished = self.scheduler.update(step.scheduled, result.sampled)
        observed = step.observed and StepObserver.finished(step.observed)
        self._process_step(step.scheduled, result, finished, host_gap, observed)

    def _add_step_times(self, output: SchedulerOutput, timing: StepTiming) -> None:
        """--collect-detailed-traces: the step's times added to each request in it, once."""
        states: dict[str, RequestState] = {}
        for chunk in output.chunks:
            entry = self._sample_of.get(chunk.request.request_id)
            if entry is not None and entry[0].samples[entry[1]].request is chunk.request:
                states[entry[0].request_id] = entry[0]
        timing.add_to(state.metrics for state in states.values())

    def _mark_scheduled(self, output: SchedulerOutput) -> None:
        now = time.monotonic()
        for chunk in output.chunks:
            request = chunk.request
            if chunk.num_computed_tokens >= len(request.prompt_token_ids):
                continue  # a decode: a request is first scheduled with a prompt chunk
            state, _ = self._sample_of[request.request_id]
            if state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = now
                state.num_cached_tokens = request.num_cached_prompt_tokens

    def _process_step(
        self,
        output: SchedulerOutput,
        result: StepResult,
        finished: list[Request],
        host_gap: float | None,
        observed: StepObservation | None = None,
    ) -> None:
        touched: dict[str, RequestState] = {}
        stopped_by_text: list[str] = []
        off_constraint: list[Request] = []
        now = time.monotonic()
        tally = StepTally()
        sampled, logprobs, prompt_logprobs = result.sampled, result.logprobs, result.prompt_logprobs
        pooled = result.pooled
        process_tokens = self.output_processor.process_tokens
        for chunk in output.chunks:
            request = chunk.request
            request_id = request.request_id
            tally.count_prompt(
                chunk.num_computed_tokens,
                chunk.num_tokens,
                len(request.prompt_token_ids),
                request.num_cached_prompt_tokens,
            )
            entry = self._sample_of.get(request_id)
            if entry is None:
                continue
            state, index = entry
            sample = state.samples[index]
            # An aborted request's id may already belong to a new request: match by object.
            if sample.request is not request or sample.finish_reason is not None:
                continue
            if pooled:
                vector = pooled.get(request_id)
                if vector is not None:
                    state.pooled = vector
                    state.changed.add(index)
                    # Its vector is its first (and last) output, as vLLM times it.
                    tally.count_output(state.metrics, 0, now, False)
                    touched[state.request_id] = state
                continue
            scored = prompt_logprobs.get(request_id) if prompt_logprobs else None
            if scored is not None:  # complete with the prompt's last chunk, which samples
                self.output_processor.add_prompt_logprobs(state, *scored)
            appended = sampled.get(request_id)  # cut by the scheduler after a stop
            if not appended:
                continue
            token_logprobs = logprobs.get(request_id) if logprobs else None
            if token_logprobs is not None and len(token_logprobs) > len(appended):
                token_logprobs = token_logprobs[: len(appended)]
            kept = process_tokens(sample, appended, token_logprobs)
            if kept is not None:
                if kept < len(appended):  # sampled past the stop string, with drafts
                    del request.output_token_ids[kept - len(appended) :]
                    appended = appended[:kept]
                request.stop_reason = sample.stop_reason
                stopped_by_text.append(request_id)
            if request.matcher is not None:
                if not advance_constraint(request, appended, lambda s=sample: s.text):
                    off_constraint.append(request)
            tally.count_output(state.metrics, len(appended), now, state.request_id in touched)
            state.changed.add(index)
            touched[state.request_id] = state
        self.scheduler.finish_requests(stopped_by_text, RequestStatus.FINISHED_STOPPED)
        # The sequences the scheduler ended first: ending one that broke its constraint
        # may end its request, which then forgets its siblings.
        for request in finished:
            state, index = self._sample_of[request.request_id]
            self.output_processor.finish_sample(state.samples[index])
            touched.setdefault(state.request_id, state)  # told even without a new token
        off_constraint = [r for r in off_constraint if not r.status.is_finished]
        if off_constraint:
            self._end_with_error(off_constraint, "a sampled token broke its structured output")
        for state in touched.values():
            self._deliver(state)
        self._stats.step_done(self.scheduler, self.kv_cache, tally, host_gap, observed)
        if self.kv_events is not None:
            self.kv_events.flush()  # one batch a step, queued for the publisher's thread

    def _deliver(self, state: RequestState, record: bool = True) -> None:
        """Tell the request's consumer it has news, if an output is due; the output is
        built when the consumer takes it. A finished request is `record`ed in the stats."""
        queue = self._queues.get(state.request_id)
        if queue is None:
            return
        if state.finished:
            state.metrics.finished_time = time.monotonic()
            queue.notify()
            if record:
                self._stats.request_finished(state, state.metrics.finished_time)
            self._forget(state)
        elif self.output_processor.streams(state):
            queue.notify()

    def _step_failed(
        self, output: SchedulerOutput, index: int, error: BaseException, what: str
    ) -> None:
        """Fail the step's requests, or raise EngineDeadError if the failure is the engine's."""
        self._failures.failed(index, error, what)
        logger.error(what, exc_info=error)
        self._fail_requests(output, error)

    def _fail_requests(self, output: SchedulerOutput, error: Exception) -> None:
        """End every request that had a sequence in the failed step, with the error."""
        failed: dict[str, RequestState] = {}
        for chunk in output.chunks:
            entry = self._sample_of.get(chunk.request.request_id)
            if entry is not None and entry[0].samples[entry[1]].request is chunk.request:
                failed[entry[0].request_id] = entry[0]
        now = time.monotonic()
        for state in failed.values():
            siblings = [s.request.request_id for s in state.samples]
            self.scheduler.finish_requests(siblings, RequestStatus.FINISHED_ERROR)
            queue = self._queues.get(state.request_id)
            if queue is not None:
                queue.put_nowait(RuntimeError(f"the model step failed: {error}"))
            self._stats.request_finished(state, now, "error")
            self._forget(state)
        self._stats.step_done(self.scheduler, self.kv_cache)

    def _forget(self, state: RequestState) -> None:
        self._states.pop(state.request_id, None)
        self._queues.pop(state.request_id, None)
        for sample in state.samples:
            self._sample_of.pop(sample.request.request_id, None)

    # -- introspection and shutdown ------------------------------------------------------------

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._states)

    @property
    def is_dead(self) -> bool:
        """True once the engine died (see the module docstring): no request can run."""
        return self._dead is not None or self._model_thread.is_lost

    def health_problem(self, now: float | None = None) -> str | None:
        """Why the engine cannot serve at `now` (time.monotonic), or None while it is healthy."""
        if self._dead is not None:
            return death_message(self._dead)
        if self._model_thread.is_lost:
            return "the model thread is gone"
        now = time.monotonic() if now is None else now
        return self.loop_clock.stall(now, self._model_thread.busy_since)

    @property
    def model_step_running_since(self) -> float | None:
        """When the model thread began the step it runs now (time.monotonic); None when idle."""
        return self._model_thread.busy_since

    async def stop_loop(self) -> None:
        """Stop the scheduler coroutine; the next request starts it again."""
        task, self._loop_task = self._loop_task, None
        if task is None or task.done():
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    async def shutdown(self, timeout: float = SHUTDOWN_WAIT_S) -> None:
        """Abort every request and stop the loop and the model thread.

        A model step still running after `timeout` seconds (a hung one) is left behind: the
        model thread is a daemon thread, so it does not keep the process from exiting.
        """
        for request_id in list(self._states):
            self.abort(request_id)
        await self.stop_loop()
        self.structured_outputs.shutdown()
        if self.kv_events is not None:
            self.kv_events.shutdown()
        self._model_thread.shutdown(wait=False)
        if self._waiter is not None:
            self._waiter.shutdown(wait=False)
        if not await asyncio.to_thread(self._model_thread.join, timeout):
            logger.warning(
                "a model step still runs %g s after the shutdown began: leaving it behind",
                timeout,
            )
