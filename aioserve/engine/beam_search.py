"""Beam search, as vLLM 0.32 runs it (entrypoints/generate/beam_search/): on top of the
engine, one single-token request per live beam and step.

Each step every live beam of a prompt asks the engine for one token with `2 * beam_width`
logprobs (the model's raw logprobs, whatever the temperature; the token it samples is one
more candidate when it is not among them). Each logprob entry extends its beam into a
candidate whose cumulative logprob is the beam's plus the entry's. A candidate ending in
the EOS token is finished at once (unless `ignore_eos`); the others are ranked by
cumulative logprob and the best `beam_width` live on. After `max_tokens` steps (or when no
beam is left) the finished and the live beams are sorted by vLLM's beam score,
`cumulative_logprob / length ** length_penalty` (the length counts the prompt's tokens and
not a final EOS), and the best `beam_width` are the answer. The repeated prompts are cheap
with prefix caching: a step recomputes only a beam's last, partial block.

Two shapes of the answer, as vLLM has them:
- offline (`LLM.beam_search`): a BeamSearchOutput per prompt, its `sequences` each with the
  whole token list (prompt included, a final EOS kept) and the text of all of it;
- served (`beam_search_output`): one finished RequestOutput whose `beam_width` outputs are
  the beams in order: the generated tokens (a final EOS only with
  `include_stop_str_in_output`), their text without it, `finish_reason` "stop" with the
  EOS id as `stop_reason` for a beam that ended, "length" for one still live at the end.

The EOS token is the tokenizer's (vLLM's); without a tokenizer (skip_tokenizer_init),
the model's own EOS ids (its generation config's and config's), where vLLM has none.
The internal requests are not load-shed: the caller admitted the search as a whole.
A prompt with images (multimodal.py) has them encoded once; every step's requests reuse
their rows.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from aioserve.engine.lora_requests import LoRARequest
from aioserve.engine.multimodal import ImagePrompt, has_multimodal_data
from aioserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from aioserve.engine.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

StepHook = Callable[
    [AsyncGenerator[RequestOutput, None], str, SamplingParams],
    AsyncGenerator[RequestOutput, None],
]
"""Wraps each internal request's output stream (the server traces them through it)."""


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams (sampling_params.py) but its structured outputs and
    watermarking, which aioserve's beam search does not have."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # vLLM's words (_verify_num_sequences).
        if not isinstance(self.beam_width, int) or isinstance(self.beam_width, bool):
            raise ValueError(f"beam_width must be an int, but is of type {type(self.beam_width)}")
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}.")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise ValueError(f"max_tokens must be an int, got {self.max_tokens!r}.")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be at least 0, got {self.max_tokens}.")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}.")
            setattr(self, name, float(value))
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}.")


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's BeamSearchSequence): its tokens, prompt first, the logprob entries
    of each step that made it, their sum, and, once returned, its text."""

    orig_prompt: dict[str, Any]
    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    lora_request: LoRARequest | None = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first (vLLM's BeamSearchOutput)."""

    sequences: list[BeamSearchSequence]


def beam_search_score(
    tokens: Sequence[int], cumulative_logprob: float, eos_token_ids: frozenset[int],
    length_penalty: float = 1.0,
) -> float:  # fmt: skip
    """vLLM's get_beam_search_score: the cumulative logprob over the length (a final EOS
    not counted, at least 1) to the power `length_penalty`."""
    length = len(tokens)
    if tokens and tokens[-1] in eos_token_ids:
        length -= 1
    return cumulative_logprob / (max(length, 1) ** length_penalty)


def eos_token_ids_of(engine: Any) -> frozenset[int]:
    """The EOS token(s) that end a beam: the tokenizer's, else the model's own."""
    tokenizer = engine.tokenizer
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return frozenset((int(tokenizer.eos_token_id),))
    return frozenset(engine.settings.eos_token_ids)


@dataclass
class _Search:
    """One prompt's search: its live beams and the finished ones."""

    prompt: dict[str, Any]
    params: BeamSearchParams
    eos: frozenset[int]
    served: bool  # the served shape: EOS dropped from a finished beam unless asked for
    beams: list[BeamSearchSequence] = field(default_factory=list)
    completed: list[BeamSearchSequence] = field(default_factory=list)
    error: bool = False

    def advance(self, results: list[RequestOutput]) -> None:
        """One step: `results[i]` is the engine's answer for `self.beams[i]`."""
        outputs = [result.outputs[0] for result in results]
        if any(o.finish_reason == "error" for o in outputs):
            self.error, self.beams = True, []
            return
        if any(o.finish_reason == "abort" for o in outputs):
            for beam in self.beams:
                beam.finish_reason = "abort"
            self.completed.extend(self.beams)
            self.beams = []
            return
        candidates: list[BeamSearchSequence] = []
        for beam, output in zip(self.beams, outputs, strict=True):
            if not output.logprobs:
                continue
            entries = output.logprobs[0]
            for token_id, logprob in entries.items():
                new = BeamSearchSequence(
                    self.prompt,
                    beam.tokens + [token_id],
                    beam.logprobs + [entries],
                    beam.lora_request,
                    beam.cum_logprob + logprob.logprob,
                )
                if token_id in self.eos and not self.params.ignore_eos:
                    if self.served:
                        new.finish_reason, new.stop_reason = "stop", token_id
                        if not self.params.include_stop_str_in_output:
                            new.tokens = beam.tokens
                    self.completed.append(new)
                else:
                    candidates.append(new)
        candidates.sort(key=lambda c: c.cum_logprob, reverse=True)  # stable: ties keep order
        self.beams = candidates[: self.params.beam_width]

    def best(self) -> list[BeamSearchSequence]:
        """The answer: finished and live beams by beam score, best first."""
        params = self.params

        def score(beam: BeamSearchSequence) -> float:
            return beam_search_score(beam.tokens, beam.cum_logprob, self.eos, params.length_penalty)

        ranked = sorted([*self.completed, *self.beams], key=score, reverse=True)
        return ranked[: params.beam_width]


def _step_params(params: BeamSearchParams, seed: int | None) -> SamplingParams:
    return SamplingParams(
        n=1,
        max_tokens=1,
        temperature=params.temperature,
        logprobs=2 * params.beam_width,
        seed=seed,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


async def _request_outputs(
    engine: Any,
    request_id: str,
    prompt: dict[str, Any],
    params: SamplingParams,
    lora_request: LoRARequest | None,
    priority: int,
) -> AsyncGenerator[RequestOutput, None]:
    """One internal request's outputs (as AsyncEngine.generate, but not load-shed);
    closing it early aborts the request."""
    if lora_request is not None and engine.lora_adapters is not None:
        await engine.lora_adapters.read(lora_request)
    queue = engine.add_request(
        request_id, prompt, params, priority=priority, lora_request=lora_request
    )
    finished = False
    try:
        while not finished:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            finished = item.finished
            yield item
    finally:
        if not finished:
            engine.abort(request_id)


async def _final(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    async with aclosing(stream):
        async for output in stream:
            if output.finished:
                return output
    raise RuntimeError("an internal beam search request ended without its output")


async def _gather_all(coroutines: list) -> list:
    """Run `coroutines` at once; on any error (or cancellation) the others are cancelled
    and awaited, so that none is left holding a request."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _run(
    engine: Any,
    searches: list[_Search],
    request_id: str,
    *,
    priority: int = 0,
    seed: int | None = None,
    hook: StepHook | None = None,
    on_step: Callable[[], None] | None = None,
) -> None:
    """Step `searches` side by side (all their live beams in one batch) to their end."""
    steps = max((s.params.max_tokens for s in searches), default=0)
    for step in range(steps):
        live = [s for s in searches if s.beams and step < s.params.max_tokens]
        if not live:
            break
        batch = f"{request_id}-{uuid.uuid4().hex[:16]}"
        jobs, counts = [], []
        for k, search in enumerate(live):
            params = _step_params(search.params, seed)
            for i, beam in enumerate(search.beams):
                beam_id = f"{batch}-{k}-beam-{i}"
                prompt = _step_prompt(search.prompt, beam.tokens)
                stream = _request_outputs(
                    engine, beam_id, prompt, params, beam.lora_request, priority
                )
                if hook is not None:
                    stream = hook(stream, beam_id, params)
                jobs.append(_final(stream))
            counts.append(len(search.beams))
        results = await _gather_all(jobs)
        start = 0
        for search, count in zip(live, counts, strict=True):
            search.advance(results[start : start + count])
            start += count
        if on_step is not None:
            on_step()


def _new_search(
    engine: Any, prompt: dict[str, Any], params: BeamSearchParams, lora: LoRARequest | None,
    served: bool,
) -> _Search:  # fmt: skip
    token_ids = list(prompt["prompt_token_ids"])
    # The context bounds the steps: a beam may not outgrow --max-model-len.
    room = max(engine.settings.max_model_len - len(token_ids), 0)
    if params.max_tokens > room:
        params = BeamSearchParams(**{**params.__dict__, "max_tokens": room})
    search = _Search(prompt, params, eos_token_ids_of(engine), served)
    search.beams = [BeamSearchSequence(prompt, token_ids, [], lora)]
    return search


async def beam_search_output(
    engine: Any,
    prompt: dict[str, Any],
    params: BeamSearchParams,
    request_id: str,
    *,
    lora_request: LoRARequest | None = None,
    priority: int = 0,
    seed: int | None = None,
    with_logprobs: bool = False,
    hook: StepHook | None = None,
) -> RequestOutput:
    """A served request's beam search: one finished RequestOutput, vLLM's online shape.
    `prompt` holds `prompt_token_ids` (and `prompt`, `cache_salt` if any); the outputs carry
    each token's logprob entries only `with_logprobs`."""
    prompt = await _with_images_encoded(engine, prompt)
    search = _new_search(engine, prompt, params, lora_request, served=True)
    prompt_ids = search.beams[0].tokens
    await _run(engine, [search], request_id, priority=priority, seed=seed, hook=hook)
    text = prompt.get("prompt")
    if search.error:  # vLLM answers with one empty output
        error = CompletionOutput(0, "", [], None, None, finish_reason="error")
        return RequestOutput(request_id, text, prompt_ids, [error], finished=True)
    tokenizer = engine.tokenizer
    outputs = []
    for index, beam in enumerate(search.best()):
        token_ids = beam.tokens[len(prompt_ids) :]
        shown = token_ids
        if token_ids and token_ids[-1] in search.eos and not params.ignore_eos:
            shown = token_ids[:-1]  # the EOS is not part of the text
        decoded = "" if tokenizer is None else tokenizer.decode(shown, **_decoding(params))
        outputs.append(
            CompletionOutput(
                index=index,
                text=decoded,
                token_ids=token_ids,
                cumulative_logprob=beam.cum_logprob,
                # One entry per token shown (a dropped EOS took a step, not a token).
                logprobs=beam.logprobs[: len(token_ids)] if with_logprobs else None,
                finish_reason=beam.finish_reason or "length",
                stop_reason=beam.stop_reason,
            )
        )
    return RequestOutput(request_id, text, prompt_ids, outputs, finished=True)


def _decoding(params: BeamSearchParams) -> dict[str, Any]:
    return {"skip_special_tokens": params.skip_special_tokens}


async def offline_beam_search(
    engine: Any,
    prompts: Sequence[Any],
    params: BeamSearchParams,
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
    request_ids: Callable[[], str],
    *,
    use_tqdm: bool = False,
    concurrency_limit: int | None = None,
) -> list[BeamSearchOutput]:
    """`LLM.beam_search`'s work: each prompt (a string, a token id list, or a dict with
    `prompt` or `prompt_token_ids`) searched, `concurrency_limit` prompts at a time (all at
    once by default), all live beams of those in one batch a step; vLLM's offline shape."""
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    if concurrency_limit is not None and (
        not isinstance(concurrency_limit, int) or concurrency_limit < 1
    ):
        raise ValueError(f"concurrency_limit must be a positive int, got {concurrency_limit!r}")
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    prompts = [await _with_images_encoded(engine, _offline_prompt(engine, p)) for p in prompts]
    if lora_request is None or isinstance(lora_request, LoRARequest):
        loras = [lora_request] * len(prompts)
    else:
        loras = list(lora_request)
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request has {len(loras)} entries for {len(prompts)} prompts")
    searches = [
        _new_search(engine, prompt, params, lora, served=False)
        for prompt, lora in zip(prompts, loras, strict=True)
    ]
    if use_tqdm and concurrency_limit is not None:
        logger.warning(
            "Progress bar is not supported when using concurrency_limit. Disabling progress bar."
        )
        use_tqdm = False
    bar = tqdm(total=params.max_tokens, desc="Beam search", unit="token", disable=not use_tqdm)
    limit = concurrency_limit or len(searches) or 1
    try:
        for start in range(0, len(searches), limit):
            await _run(engine, searches[start : start + limit], request_ids(), on_step=bar.update)
    finally:
        bar.close()
        await engine.stop_loop()  # nothing is left running between the LLM's calls
    tokenizer = engine.tokenizer
    outputs = []
    for search in searches:
        best = search.best()
        for beam in best:
            if tokenizer is not None:  # vLLM's: the text of all the tokens, prompt included
                beam.text = tokenizer.decode(beam.tokens, **_decoding(params))
        outputs.append(BeamSearchOutput(best))
    return outputs


IMAGES = "images"  # a search prompt's key for its encoded images (_with_images_encoded)


def _offline_prompt(engine: Any, prompt: Any) -> dict[str, Any]:
    if isinstance(prompt, dict) and "prompt_embeds" in prompt:
        raise NotImplementedError("Embedding prompt not supported for beam search")
    if has_multimodal_data(prompt):
        return prompt  # tokenized with its images (_with_images_encoded)
    text, token_ids = engine.tokenize_prompt(prompt)
    out: dict[str, Any] = {"prompt": text, "prompt_token_ids": token_ids}
    if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
        out["cache_salt"] = prompt["cache_salt"]
    return out


async def _with_images_encoded(engine: Any, prompt: dict[str, Any]) -> dict[str, Any]:
    """A prompt with images as the search keeps it: its widened token ids, and its images
    encoded once (multimodal.py) for every step's beams; any other prompt as it is."""
    if not has_multimodal_data(prompt):
        return prompt
    prepared = await engine.prepare_prompt(prompt)
    out = {
        "prompt": prepared.prompt,
        "prompt_token_ids": prepared.prompt_token_ids,
        IMAGES: prepared.images,
    }
    if prepared.cache_salt is not None:
        out["cache_salt"] = prepared.cache_salt
    return out


def _step_prompt(prompt: dict[str, Any], tokens: list[int]) -> Any:
    """The prompt of a beam's next step: the search's prompt with the beam's tokens."""
    images = prompt.get(IMAGES)
    if images:
        return ImagePrompt(prompt.get("prompt"), tokens, images, prompt.get("cache_salt"))
    return {**prompt, "prompt_token_ids": tokens}
