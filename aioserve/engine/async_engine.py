"""AsyncEngine: requests in, their outputs out, the engine's loop (engine_loop.py) between.

`generate()` registers a generation request and returns an async iterator over its
outputs; `encode()` runs a pooling request (a pooling model's engine) and returns its
vector. Both check the request first (InvalidRequest with vLLM's messages), refuse it when
a queue cap is reached (QueueFullError), and abort it when their caller goes away (the
iterator closed, the task cancelled). The loop that runs them is `EngineLoop`'s.
`start_profile` and `stop_profile` run torch's profiler over its steps (step_profiler.py).
`pause_generation` and `resume_generation` hold the requests back and let them go again
(pause.py says how); `sleep` and `wake_up` pause and free memory, and bring it back
(sleep.py).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from aioserve.config.engine import EngineConfig
from aioserve.config.profiler import ProfilerSettings
from aioserve.engine.admission import (
    InvalidRequest,
    PromptType,
    cache_salt_of,
    new_sequences,
    sequence_ids,
    tokenize_prompt,
    validate_request,
)
from aioserve.engine.bad_words import bad_words_of, constrain
from aioserve.engine.build import build_engine, default_sampling_params
from aioserve.engine.engine_loop import SHUTDOWN_WAIT_S, EngineLoop
from aioserve.engine.health import EngineDeadError, death_message
from aioserve.engine.lora_requests import LoRARequest
from aioserve.engine.model_thread import ModelThread
from aioserve.engine.multimodal import (
    ImageJob,
    ImagePrompt,
    ImageRows,
    has_multimodal_data,
    images_of,
    run_image_job,
    widened_prompt,
)
from aioserve.engine.output_processor import RequestState
from aioserve.engine.output_stream import OutputStream
from aioserve.engine.outputs import PoolingRequestOutput, RequestMetrics, RequestOutput
from aioserve.engine.pause import PAUSE_MODES, PauseMode
from aioserve.engine.pooling_params import (
    PoolingParams,
    check_pooling_request,
    finish_vector,
    prefill_only_params,
    token_types_of,
)
from aioserve.engine.process_tuning import restore_process_settings, tune_process_for_serving
from aioserve.engine.prompt_embeds import (
    check_embeds_request,
    placeholder_prompt,
    prompt_embeds_of,
)
from aioserve.engine.request import RequestStatus
from aioserve.engine.sampling_params import SamplingParams
from aioserve.engine.sleep import EngineAsleepError, SleepRefused, check_level, wake_tags
from aioserve.engine.step_profiler import ProfilerStateError, StepProfiler
from aioserve.platform import is_gpu


class AsyncEngine(EngineLoop):
    _tuned_process = False  # whether this engine has tuned the process and not yet restored it
    _profiler: StepProfiler | None = None  # made by the first start_profile

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        """Build the engine's parts on its model thread (see model_thread.py for why)."""
        model_thread = ModelThread()
        try:
            parts = model_thread.submit(build_engine, config).result()
        except BaseException:
            model_thread.shutdown(wait=False)
            raise
        engine = cls(parts, model_thread)
        tune_process_for_serving(model_on_device=is_gpu())
        engine._tuned_process = True
        return engine

    async def shutdown(self, timeout: float = SHUTDOWN_WAIT_S) -> None:
        await super().shutdown(timeout)
        if self._tuned_process:
            self._tuned_process = False
            restore_process_settings()

    # -- requests ---------------------------------------------------------------------------

    def default_sampling_params(self) -> SamplingParams:
        return default_sampling_params(self.settings)

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text, prompt token ids) of a string, {"prompt": ...} or {"prompt_token_ids": ...}."""
        return tokenize_prompt(self.tokenizer, prompt)

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequest if add_request would refuse this prompt with `params`
        (compiling its structured output: see `compile_structured_output`)."""
        validate_request(
            self.settings, self.hf_config.vocab_size, self.tokenizer is not None, prompt_ids, params
        )
        if params.structured_outputs is not None:
            self.structured_outputs.compile(params.structured_outputs)
        bad_words_of(self.tokenizer, params, self.hf_config.vocab_size)  # refuses a bad list

    async def compile_structured_output(self, params: SamplingParams) -> None:
        """Compile the request's structured output off the event loop (InvalidRequest when
        it cannot be), so that check_request and add_request find it compiled."""
        if params.structured_outputs is not None:
            await self.structured_outputs.compile_async(params.structured_outputs)

    async def prepare_prompt(self, prompt: PromptType) -> PromptType | ImagePrompt:
        """The prompt as add_request takes it: one with images (multi_modal_data) is
        widened and its images encoded on the model thread (engine/multimodal.py);
        any other is returned as it is."""
        if not has_multimodal_data(prompt):
            return prompt
        if self.image_processor is None:
            raise InvalidRequest(
                "this model takes no images (multi_modal_data): it has no vision tower",
                "multi_modal_data",
                "image",
            )
        images = images_of(prompt, self.settings.limit_mm_per_prompt)
        text_prompt = {k: v for k, v in prompt.items() if k != "multi_modal_data"}
        text, prompt_ids = self.tokenize_prompt(text_prompt)
        prompt_ids, offsets = widened_prompt(self.image_processor, prompt_ids, len(images))
        job = ImageJob(images, self.image_processor)
        future = self._model_thread.submit(run_image_job, job, self.runner.image_features)
        encoded = await asyncio.wrap_future(future)
        rows = tuple(
            ImageRows(offset, values, digest)
            for offset, (values, digest) in zip(offsets, encoded, strict=True)
        )
        return ImagePrompt(text, prompt_ids, rows, cache_salt_of(prompt))

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        priority: int = 0,
        pooling: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> OutputStream:
        """Register a request; its outputs arrive on the returned stream (one consumer).

        With `pooling` it is a pooling request (see `encode`), and `params` are
        `prefill_only_params()`. With `lora_request` it runs with that adapter, read here
        unless `generate` read it already (LoRAAdapterError when it cannot be served)."""
        if self._dead is not None:
            raise EngineDeadError("the engine stopped after an error") from self._dead
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already running")
        if (pooling is None) != (self.settings.pooler is None):
            raise ValueError(
                f"this model's runner is {self.settings.runner_type!r}: it cannot "
                f"{'generate text' if pooling is None else 'pool (embed)'}"
            )
        lora_adapter = None
        if lora_request is not None:
            if self.lora_adapters is None:
                raise ValueError(
                    f"LoRA adapter {lora_request.lora_name!r} requested, but LoRA is not "
                    "enabled: start the engine with --enable-lora (enable_lora=True)"
                )
            lora_adapter = self.lora_adapters.read_now(lora_request)
        images: tuple[ImageRows, ...] = ()
        if isinstance(prompt, ImagePrompt):
            text, prompt_ids, images, embeds = (
                prompt.prompt,
                prompt.prompt_token_ids,
                prompt.images,
                None,
            )
            cache_salt = prompt.cache_salt
        else:
            if has_multimodal_data(prompt):
                raise ValueError("a prompt with multi_modal_data goes through prepare_prompt first")
            embeds = prompt_embeds_of(prompt, self.settings)
            if embeds is None:
                text, prompt_ids = self.tokenize_prompt(prompt)
            else:
                check_embeds_request(params)
                text, prompt_ids = None, placeholder_prompt(embeds)
            cache_salt = cache_salt_of(prompt)
        token_types = None
        if pooling is None:
            self.check_request(prompt_ids, params)
        else:
            check_pooling_request(self.settings, self.hf_config.vocab_size, prompt_ids, pooling)
            type_vocab_size = getattr(self.hf_config, "type_vocab_size", 1)
            token_types = token_types_of(prompt, len(prompt_ids), type_vocab_size)
        self._ensure_loop()
        now = time.monotonic()
        state = RequestState(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=prompt_ids,
            params=params,
            samples=[],
            metrics=RequestMetrics(arrival_time=now),
            stream_interval=max(params.stream_interval or 1, self.settings.stream_interval),
        )
        ids = sequence_ids(request_id, params.n)
        for sequence_id in ids:
            # A sibling of an n > 1 request is named "<id>#<index>": another client's id
            # may not take one of those names, nor give them to its own siblings.
            if sequence_id in self._sample_of:
                raise ValueError(f"request id {sequence_id!r} is already running")
        requests = new_sequences(
            self.settings, ids, prompt_ids, params, self._seed_rng,
            priority=priority, arrival_time=now, arrival_index=next(self._arrivals),
            cache_salt=cache_salt, prompt_embeds=embeds, images=images,
        )  # fmt: skip
        bad_words = bad_words_of(self.tokenizer, params, self.hf_config.vocab_size)
        try:
            for index, request in enumerate(requests):
                if pooling is not None:
                    request.pooling, request.token_type_ids = True, token_types
                request.lora, request.lora_adapter = lora_request, lora_adapter
                constrain(request, params, self.structured_outputs, bad_words)
                state.samples.append(self.output_processor.new_sample(index, request))
                self._sample_of[request.request_id] = (state, index)
                self.scheduler.add_request(request)
        except BaseException:
            # All or nothing: no sibling may stay behind holding a place or blocks.
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            self._forget(state)
            raise
        queue = OutputStream(functools.partial(self.output_processor.take_output, state))
        self._states[request_id] = state
        self._queues[request_id] = queue
        self._wakeup.set()
        return queue

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None,
        request_id: str,
        *,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they are produced; the last one has `finished=True`.

        Raises QueueFullError, before registering anything, when a queue cap refuses it;
        LoRAAdapterError when its adapter cannot be served.
        """
        params = sampling_params if sampling_params is not None else self.default_sampling_params()
        self.load_shedder.check(params.n)
        if lora_request is not None and self.lora_adapters is not None:
            await self.lora_adapters.read(lora_request)  # off the loop, before it is added
        prompt = await self.prepare_prompt(prompt)
        queue = self.add_request(
            request_id, prompt, params, priority=priority, lora_request=lora_request
        )
        finished = False
        try:
            while not finished:
                while queue.empty():
                    await queue.wait()
                try:
                    item = queue.get_nowait()
                except asyncio.QueueEmpty:  # news that amounted to no output
                    continue
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            # Unless the request ended, or was aborted and its id is now another request's.
            if not finished and self._queues.get(request_id) is queue:
                self.abort(request_id)

    async def encode(
        self,
        prompt: PromptType,
        params: PoolingParams,
        request_id: str,
        *,
        priority: int = 0,
    ) -> PoolingRequestOutput:
        """A pooling request's vector (a pooling model's engine only), cut and normalized
        as `params` say; raises as `generate` does. Cancelled, it is aborted."""
        self.load_shedder.check(1)
        queue = self.add_request(
            request_id, prompt, prefill_only_params(), priority=priority, pooling=params
        )
        try:
            while queue.empty():
                await queue.wait()
            item = queue.get_nowait()
        finally:
            if self._queues.get(request_id) is queue:
                self.abort(request_id)
        if isinstance(item, BaseException):
            raise item
        if not isinstance(item, PoolingRequestOutput):  # ended before its step ran
            reason = item.outputs[0].finish_reason if item.outputs else None
            raise RuntimeError(f"pooling request {request_id} ended ({reason}) before its step ran")
        assert self.settings.pooler is not None
        item.data = finish_vector(item.data, params, self.settings.pooler)
        return item

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False (nothing forgotten) while a request holds
        blocks, a step in flight included. Its AllBlocksCleared event is published at
        once, not held until the next step."""
        reset = self.kv_cache.reset_prefix_cache()
        if self.kv_events is not None:
            self.kv_events.flush()
        return reset

    # -- pausing (the server's /pause, /resume, /is_paused and /abort_requests) -------------

    async def pause_generation(self, mode: PauseMode = "abort", clear_cache: bool = True) -> None:
        """Pause generation in `mode` (pause.py); return once the pause is complete.

        With `clear_cache` (vLLM's default) the prefix cache is then forgotten, and the
        requests a "keep" pause froze running are preempted first (their blocks freed,
        their KV computed again after the resume), as vLLM's engine core does. ValueError
        for an unknown mode; EngineDeadError when the engine is dead."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"Invalid pause mode: {mode}")
        if self._dead is not None:
            raise EngineDeadError(death_message(self._dead))
        if mode == "abort":
            for request_id in list(self._states):
                # Recorded, as vLLM's engine core sends these aborts back as finished requests.
                self.abort(request_id, record=True)
        self._pause.begin(mode)
        self._ensure_loop()
        complete = self._pause.completion()
        self._wakeup.set()
        await complete
        if self._dead is not None:
            raise EngineDeadError(death_message(self._dead))
        if clear_cache:
            # Nothing is in flight: the loop has parked and cannot go on before this runs.
            self.scheduler.preempt_running()
            if not self.reset_prefix_cache():
                raise RuntimeError("the prefix cache was not reset: requests still hold blocks")
            self._stats.step_done(self.scheduler, self.kv_cache)

    def resume_generation(self) -> None:
        """End the pause: the queued and frozen requests go on. EngineAsleepError while
        sleep holds memory back (wake_up resumes)."""
        if self._sleep.holds_memory:
            asleep = ", ".join(sorted(self._sleep.sleeping_tags))
            raise EngineAsleepError(
                f"the engine is asleep ({asleep} not resident): wake it up (POST /wake_up, "
                "LLM.wake_up) to resume"
            )
        self._pause.end()
        if self._wakeup is not None:
            self._wakeup.set()

    @property
    def is_paused(self) -> bool:
        return self._pause.paused

    def abort_all(self) -> int:
        """Abort every request in flight; how many vLLM would say it aborted: each unfinished
        sequence, and the parent of an n > 1 request (vLLM's output processor tracks both)."""
        count = 0
        for request_id, state in list(self._states.items()):
            count += sum(s.finish_reason is None for s in state.samples)
            count += len(state.samples) > 1
            self.abort(request_id)
        return count

    # -- sleep mode (the server's /sleep, /wake_up, /is_sleeping, /release_kv_cache_memory) --

    async def sleep(self, level: int = 1, mode: PauseMode = "abort") -> None:
        """Sleep at `level` (sleep.py), the requests in flight handled as a pause in `mode`
        would. ValueError for an unknown level or mode; SleepRefused for a level 2
        this engine cannot take."""
        check_level(level)
        if level == 2 and (why := self._sleep.level_2_refusal()) is not None:
            raise SleepRefused(f"sleep level 2 is not supported for this model: {why}")
        async with self._sleep.lock:
            await self.pause_generation(mode, clear_cache=level >= 1)
            if level >= 1:
                await self._on_model_thread(self._sleep.sleep, level)
            self._sleep.record(1, level)

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """Bring back the memory of `tags` ("weights", "kv_cache"; None: all), and once
        all is resident resume generation; whether the engine is fully awake."""
        async with self._sleep.lock:
            executor_tags = wake_tags(tags)
            if executor_tags is None or executor_tags:
                await self._on_model_thread(self._sleep.wake_up, executor_tags)
            fully_awake = not self._sleep.sleeping_tags
            if fully_awake:
                self.resume_generation()
                self._sleep.record(0, 0)
            return fully_awake

    async def release_kv_cache_memory(self) -> None:
        """Free the KV cache's memory (the tag "kv_cache"), after a completed pause with
        all memory resident; RuntimeError (vLLM's) otherwise."""
        async with self._sleep.lock:
            idle = not self.scheduler.has_unfinished() and self.loop_clock.parked
            if not (self._pause.paused and idle):
                raise RuntimeError("release_kv_cache_memory() requires a completed pause first")
            if self._sleep.sleeping_tags:
                raise RuntimeError(
                    "release_kv_cache_memory() requires all executor memory to be resident"
                )
            if not self.reset_prefix_cache():
                raise RuntimeError("the prefix cache was not reset: requests still hold blocks")
            await self._on_model_thread(self._sleep.discard_kv_cache)
            self._sleep.record(1, 0)

    @property
    def is_sleeping(self) -> bool:
        """Whether the engine sleeps at any level (a pause counts, as in vLLM)."""
        return self._pause.paused or bool(self._sleep.sleeping_tags)

    @property
    def sleep_state(self) -> tuple[int, int]:
        """(asleep, level) as vLLM's `vllm:engine_sleep_state` last recorded them."""
        return self._sleep.state

    async def _on_model_thread(self, fn: Callable[..., object], *args: object) -> None:
        await asyncio.wrap_future(self._model_thread.submit(fn, *args))

    # -- profiling (the server's /start_profile and /stop_profile) ------------------------

    async def start_profile(self, settings: ProfilerSettings) -> None:
        """Start torch's profiler on the model thread, between two steps, as `settings` say
        (step_profiler.py). ProfilerStateError while a session runs."""
        if self._profiler is None or self._profiler.settings != settings:
            if self._profiler is not None and self._profiler.running:
                raise ProfilerStateError("the profiler is already running: stop it first")
            self._profiler = StepProfiler(settings)
        await asyncio.wrap_future(self._model_thread.submit(self._profiler.start))

    async def stop_profile(self) -> Path:
        """Stop the profiler after the step running; the trace file written.
        ProfilerStateError when no session runs."""
        if self._profiler is None:
            raise ProfilerStateError("the profiler is not running: start it first")
        return await asyncio.wrap_future(self._model_thread.submit(self._profiler.stop))
