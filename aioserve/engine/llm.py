"""LLM: vLLM's offline API (`generate`, `chat`; `embed`, `encode` and `score` for a pooling
model) on top of the AsyncEngine.

The LLM owns a private event loop (uvloop where available) and runs the engine's
scheduler coroutine on it for the duration of each call, so offline and served
generation go through exactly the same code.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
from collections.abc import Coroutine, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import torch
from tqdm import tqdm

from aioserve.config.engine import EngineConfig, engine_config_from_kwargs
from aioserve.engine.async_engine import AsyncEngine, PromptType
from aioserve.engine.beam_search import BeamSearchOutput, BeamSearchParams, offline_beam_search
from aioserve.engine.lora_requests import LoRARequest
from aioserve.engine.output_stream import OutputStream
from aioserve.engine.outputs import (
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from aioserve.engine.pause import PauseMode
from aioserve.engine.pooling_params import PoolingParams
from aioserve.engine.sampling_params import RequestOutputKind, SamplingParams
from aioserve.engine.step_profiler import torch_activities
from aioserve.log_setup import configure_logging

ChatMessages = list[dict[str, Any]]
_T = TypeVar("_T")
_CLOSED = "this LLM is closed: its model and KV pool are freed"


def _new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


class LLM:
    """Load a model once, then generate for batches of prompts.

    `LLM(model=..., dtype=..., seed=..., **engine_args)` takes the engine arguments of
    `aioserve serve` in snake_case (`max_num_seqs=...`, `enable_prefix_caching=...`).
    `max_num_queued_reqs` and `max_num_queued_tokens` are accepted but shed nothing here:
    `generate` queues its whole batch, as nobody could retry a refusal (load_shedding.py).
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        if model is not None:
            engine_args["model"] = model
        self._start(engine_config_from_kwargs(**engine_args), keywords=True)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An LLM for an already built configuration (e.g. from the command line's arguments)."""
        llm = cls.__new__(cls)
        llm._start(config, keywords=False)
        return llm

    def _start(self, config: EngineConfig, *, keywords: bool) -> None:
        if config.logging.given:  # vLLM's LLM sets its logging up from these arguments
            configure_logging("info", args=config.logging, keywords=keywords)
        if config.profiler.profiler_config is not None:
            torch_activities(config.profiler.profiler_config)
        self.config = config
        self._loop = _new_event_loop()
        self._engine: AsyncEngine | None = AsyncEngine.from_config(config)
        self._ids = itertools.count()

    @property
    def engine(self) -> AsyncEngine:
        """The engine behind this LLM; RuntimeError once `close()` has freed it."""
        if self._engine is None:
            raise RuntimeError(_CLOSED)
        return self._engine

    def _complete(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        """Run `coroutine` to its end on the LLM's own loop."""
        if self._engine is None:
            coroutine.close()
            raise RuntimeError(_CLOSED)
        return self._loop.run_until_complete(coroutine)

    def start_profile(self) -> None:
        """Start torch's profiler over the engine's steps, as `profiler_config` says (the
        trace is written by `stop_profile`). RuntimeError without a profiler configured."""
        settings = self.config.profiler.profiler_config
        if settings is None:
            raise RuntimeError(
                "Profiling is not enabled: pass profiler_config={'profiler': 'torch', "
                "'torch_profiler_dir': DIR} (or set VLLM_TORCH_PROFILER_DIR)"
            )
        self._complete(self.engine.start_profile(settings))

    def stop_profile(self) -> None:
        """Stop the profiler and write its trace in torch_profiler_dir."""
        self._complete(self.engine.stop_profile())

    def sleep(self, level: int = 1, mode: PauseMode = "abort") -> None:
        """Put the engine to sleep (vLLM's LLM.sleep; engine/sleep.py): level 0 pauses
        scheduling, level 1 also frees the KV cache and offloads the weights (kept in host
        memory on the CPU), level 2 frees both. Memory is freed with enable_sleep_mode=True
        only. `mode` ("abort", "wait", "keep") says what becomes of requests in flight."""
        self._complete(self.engine.sleep(level, mode))

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Bring back the memory of `tags` ("weights", "kv_cache", "scheduling"; None: all)
        and whether the engine is fully awake (vLLM's LLM.wake_up)."""
        return self._complete(self.engine.wake_up(tags))

    def release_kv_cache_memory(self) -> None:
        """Free the KV cache's memory after a completed `sleep(level=0)`; restore it with
        `wake_up(tags=["kv_cache"])` (vLLM's LLM.release_kv_cache_memory)."""
        self._complete(self.engine.release_kv_cache_memory())

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.default_sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in the order of the prompts; with
        `lora_request`, through that adapter (one for all prompts, or one per prompt)."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(
                    f"lora_request has {len(loras)} entries for {len(prompts)} prompts"
                )
        return self._complete(self._run(prompts, params, priorities, use_tqdm, loras))

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's offline beam search (engine/beam_search.py): per prompt, in order, the best
        `params.beam_width` beams, best first; `concurrency_limit` prompts at a time."""
        return self._complete(
            offline_beam_search(
                self.engine,
                prompts,
                params,
                lora_request,
                lambda: f"beam-{next(self._ids)}",
                use_tqdm=use_tqdm,
                concurrency_limit=concurrency_limit,
            )
        )

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the chat template, then generate."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("chat needs the tokenizer, which is not loaded (skip_tokenizer_init)")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts: list[PromptType] = []
        for conversation in conversations:
            _refuse_media_parts(conversation)
            text = tokenizer.apply_chat_template(
                conversation,
                chat_template=chat_template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}),
            )
            # The template writes the special tokens itself (BOS included).
            ids = tokenizer(text, add_special_tokens=False).input_ids
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """An embedding model's vector of each prompt, in order (`output.outputs.embedding`)."""
        return self.encode(prompts, _with_task(pooling_params, "embed"), use_tqdm=use_tqdm)

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """A sequence classifier's scores of each prompt, in order (`output.outputs.probs`)."""
        return self.encode(prompts, _with_task(pooling_params, "classify"), use_tqdm=use_tqdm)

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """A pooling model's pooled output of each prompt, in order (`output.outputs.data`),
        for the model's task unless `pooling_params` names one."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        params = pooling_params or PoolingParams()
        return self._complete(self._run_pooling(list(prompts), params, use_tqdm))

    def score(
        self, data_1: str | Sequence[str], data_2: str | Sequence[str], *, use_tqdm: bool = True
    ) -> list[ScoringRequestOutput]:
        """Each pair's score: one text is paired with each of the others, two lists
        pairwise (vLLM's pairing). An embedding model scores the cosine similarity of the
        two texts' vectors; a cross-encoder (a one-label sequence classifier) reads each pair
        as one prompt, `tokenizer(text_1, text_2)`, and scores its activated logit."""
        first = [data_1] if isinstance(data_1, str) else list(data_1)
        second = [data_2] if isinstance(data_2, str) else list(data_2)
        if not first or not second:  # vLLM's words
            raise ValueError(
                "At least one text element must be given"
                if not first
                else "At least one text_pair element must be given"
            )
        if len(first) == 1:
            first = first * len(second)
        elif len(first) != len(second):
            raise ValueError(
                f"score pairs {len(first)} texts with {len(second)}: give one or as many"
            )
        pooler = self.engine.settings.pooler
        if pooler is not None and not pooler.scores_pairs:  # vLLM's words
            raise ValueError("Scoring API is only enabled for num_labels == 1.")
        if pooler is not None and pooler.task == "classify":
            return self._cross_encode(first, second, use_tqdm)
        encoded = self.embed([*first, *second], use_tqdm=use_tqdm)
        pairs = zip(encoded[: len(first)], encoded[len(first) :], strict=True)
        return [
            ScoringRequestOutput(
                f"score-{a.request_id}",
                ScoringOutput(torch.nn.functional.cosine_similarity(a.data, b.data, dim=0).item()),
                a.prompt_token_ids + b.prompt_token_ids,
            )
            for a, b in pairs
        ]

    def _cross_encode(
        self, first: list[str], second: list[str], use_tqdm: bool
    ) -> list[ScoringRequestOutput]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("score needs the tokenizer, which is not loaded (skip_tokenizer_init)")
        prompts: list[PromptType] = []
        for text_1, text_2 in zip(first, second, strict=True):
            encoded = tokenizer(text_1, text_2)
            prompt = {"prompt_token_ids": encoded.input_ids}
            if "token_type_ids" in encoded:
                prompt["token_type_ids"] = encoded.token_type_ids
            prompts.append(prompt)
        outputs = self.classify(prompts, use_tqdm=use_tqdm)
        return [
            ScoringRequestOutput(
                f"score-{o.request_id}", ScoringOutput(o.data[0].item()), o.prompt_token_ids
            )
            for o in outputs
        ]

    async def _run_pooling(
        self, prompts: list[PromptType], params: PoolingParams, use_tqdm: bool
    ) -> list[PoolingRequestOutput]:
        engine = self.engine
        with tqdm(total=len(prompts), desc="Processed prompts", disable=not use_tqdm) as bar:

            async def encode_one(prompt: PromptType) -> PoolingRequestOutput:
                output = await engine.encode(prompt, params, f"offline-{next(self._ids)}")
                bar.update(1)
                return output

            tasks = [asyncio.ensure_future(encode_one(p)) for p in prompts]
            try:
                return list(await asyncio.gather(*tasks))
            except BaseException:
                for task in tasks:  # cancelled, each aborts its request
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            finally:
                await engine.stop_loop()

    def _params_per_prompt(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * count
        else:
            params = list(sampling_params)
            if len(params) != count:
                raise ValueError(f"got {len(params)} sampling params for {count} prompts")
        # Offline callers want only the final output of each request.
        return [p.clone(output_kind=RequestOutputKind.FINAL_ONLY) for p in params]

    async def _run(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams],
        priorities: list[int],
        use_tqdm: bool,
        loras: list[LoRARequest | None],
    ) -> list[RequestOutput]:
        engine = self.engine
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        queues = []
        try:
            for request_id, prompt, p, prio, lora in zip(
                ids, prompts, params, priorities, loras, strict=True
            ):
                prompt = await engine.prepare_prompt(prompt)  # images encoded (multimodal.py)
                queues.append(
                    engine.add_request(request_id, prompt, p, priority=prio, lora_request=lora)
                )
        except BaseException:
            for request_id in ids[: len(queues)]:
                engine.abort(request_id)
            raise
        results: list[RequestOutput | None] = [None] * len(prompts)
        with tqdm(total=len(prompts), desc="Processed prompts", disable=not use_tqdm) as bar:

            async def collect(index: int, queue: OutputStream) -> None:
                while True:
                    item = await queue.get()
                    if isinstance(item, BaseException):
                        raise item
                    if item.finished:
                        results[index] = item
                        bar.update(1)
                        return

            try:
                await asyncio.gather(*(collect(i, q) for i, q in enumerate(queues)))
            except BaseException:
                for request_id in ids:
                    engine.abort(request_id)
                raise
            finally:
                # Nothing is left running between calls, so the loop can be dropped at any time.
                await engine.stop_loop()
        return results  # type: ignore[return-value]

    def close(self) -> None:
        """Stop the engine's loop and threads and free its model and KV pool; the LLM
        cannot be used afterwards."""
        if self._engine is None:
            return
        self._loop.run_until_complete(self._engine.shutdown())
        self._loop.close()
        self._engine = None
        gc.collect()  # the compiled model's reference cycles hold its weights

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _with_task(params: PoolingParams | None, task: str) -> PoolingParams:
    """`params` for `task`; ValueError when they name another (vLLM's words)."""
    params = params or PoolingParams()
    if params.task not in (None, task):
        raise ValueError(f"You cannot overwrite params.task={params.task!r} with {task!r}!")
    return replace(params, task=task)


def _refuse_media_parts(conversation: ChatMessages) -> None:
    """LLM.chat renders text: a content part of another kind (an image, audio) would reach
    the template unread. Images go through `generate` with vLLM's multi_modal_data."""
    for message in conversation:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(
                    f"LLM.chat takes text content parts only, got {kind!r}: send images "
                    'with generate({"prompt": ..., "multi_modal_data": {"image": ...}})'
                )
