"""From sampled token ids to what callers receive: text, stop strings, logprobs, outputs.

Runs on the event loop after each step. Each user request (with its n samples) has a
`RequestState`; every sample has its own incremental detokenizer and stop-string matcher.
A stop string found here ends the sample; the engine then tells the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from aioserve.engine.detokenizer import IncrementalDetokenizer
from aioserve.engine.outputs import (
    CompletionOutput,
    Logprob,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
)
from aioserve.engine.request import Request
from aioserve.engine.sampling_params import RequestOutputKind, SamplingParams
from aioserve.engine.stop_strings import StopStringMatcher
from aioserve.runner.step_plan import TokenLogprobs

# Read for every request on every step; an enum member looked up on its class costs ~90 ns.
_DELTA, _FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY


@dataclass(eq=False)
class SampleState:
    """One of the n samples of a request, as the caller sees it."""

    index: int
    request: Request
    detokenizer: IncrementalDetokenizer | None
    stop_matcher: StopStringMatcher | None
    # The text as the steps produced it, joined only when read: `text += piece` on an
    # attribute copies the whole text every step, quadratic in the output's length.
    pieces: list[str] = field(default_factory=list)
    num_sent_tokens: int = 0
    num_sent_pieces: int = 0
    num_sent_logprobs: int = 0
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def to_output(self, delta: bool) -> CompletionOutput:
        all_token_ids = self.request.output_token_ids
        pieces, logprobs = self.pieces, self.logprobs
        if delta:
            token_ids = all_token_ids[self.num_sent_tokens :]
            unsent = len(pieces) - self.num_sent_pieces
            text = pieces[-1] if unsent == 1 else "".join(pieces[self.num_sent_pieces :])
            logprobs = logprobs[self.num_sent_logprobs :] if logprobs is not None else None
        else:
            token_ids = list(all_token_ids)
            text = "".join(pieces)
        self.num_sent_tokens = len(all_token_ids)
        self.num_sent_pieces = len(pieces)
        self.num_sent_logprobs = len(self.logprobs) if self.logprobs is not None else 0
        # Positional: keyword arguments cost a third of a microsecond more, on every step.
        return CompletionOutput(
            self.index,
            text,
            token_ids,
            self.cumulative_logprob,
            logprobs,
            self.finish_reason,
            self.stop_reason,
        )


@dataclass(eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    changed: set[int] = field(default_factory=set)
    prompt_logprobs: PromptLogprobs | None = None  # filled as the prompt's chunks run
    num_scored_prompt_tokens: int = 0
    prompt_logprobs_sent: bool = False
    pooled: torch.Tensor | None = None  # a pooling request's vector, once its step ran
    stream_interval: int = 1  # tokens a DELTA output gathers (--stream-interval)

    @property
    def finished(self) -> bool:
        for sample in self.samples:  # a plain loop: cheaper than all() for one or two
            if sample.finish_reason is None:
                return False
        return True


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer

    def new_sample(self, index: int, request: Request) -> SampleState:
        params = request.sampling_params
        detokenizer = matcher = None
        if self.tokenizer is not None and params.detokenize:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                # A prompt of embeddings has no text to continue: its tokens are placeholders.
                () if request.prompt_embeds is not None else request.prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )
            if params.stop:
                matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        logprobs = [] if params.wants_logprobs else None
        return SampleState(
            index,
            request,
            detokenizer,
            matcher,
            logprobs=logprobs,
            cumulative_logprob=0.0 if logprobs is not None else None,
        )

    def process_tokens(
        self,
        sample: SampleState,
        new_token_ids: list[int],
        new_logprobs: list[TokenLogprobs] | None,
    ) -> int | None:
        """Take a sample's new tokens. If a stop string ended the sample, the number of them
        it keeps: a step with drafts may have sampled more after the one that completed
        the stop string, which the caller drops. None while no stop string ended it."""
        request = sample.request
        if sample.stop_matcher is not None and len(new_token_ids) > 1:
            num_before = len(request.output_token_ids) - len(new_token_ids)
            for i, token_id in enumerate(new_token_ids):
                lp = None if new_logprobs is None else new_logprobs[i : i + 1]
                last = i == len(new_token_ids) - 1
                if self._take_tokens(sample, [token_id], lp, num_before + i + 1, last):
                    return i + 1
            return None
        num_output = len(request.output_token_ids)
        if self._take_tokens(sample, new_token_ids, new_logprobs, num_output, True):
            return len(new_token_ids)
        return None

    def _take_tokens(
        self,
        sample: SampleState,
        new_token_ids: list[int],
        new_logprobs: list[TokenLogprobs] | None,
        num_output: int,
        ends_step: bool,
    ) -> bool:
        """process_tokens of tokens that bring the sample to `num_output` tokens, the step's
        last among them if `ends_step` (the one that an end by the scheduler is about);
        True if a stop string ended the sample."""
        request = sample.request
        if new_logprobs is not None and sample.logprobs is not None:
            for token_id, lp in zip(new_token_ids, new_logprobs, strict=True):
                sample.logprobs.append(self._logprob_dict(token_id, lp))
                sample.cumulative_logprob += lp.sampled_logprob
        if sample.detokenizer is None:
            return False
        tokens = new_token_ids
        finished = ends_step and request.status.is_finished
        if (
            finished
            and request.status.finish_reason == "stop"
            and not request.sampling_params.include_stop_str_in_output
            and tokens
        ):
            # Ended by EOS or a stop token id: its text is not part of the output (vLLM).
            tokens = tokens[:-1]
        piece = sample.detokenizer.add_tokens(tokens) if tokens else ""
        pieces = sample.pieces
        matcher = sample.stop_matcher
        if matcher is None:
            if piece:
                pieces.append(piece)
            return False
        if num_output <= request.sampling_params.min_tokens:
            # Like vLLM, stop strings are only looked for once min_tokens are out.
            pieces.append(matcher.emit_unchecked(piece))
            if finished:  # its length reached within min_tokens
                pieces.append(matcher.flush())
            return False
        safe, matched = matcher.process(piece)
        pieces.append(safe)
        if matched is not None:
            sample.finish_reason = "stop"
            sample.stop_reason = matched
            return True
        if finished:
            pieces.append(matcher.flush())
        return False

    def add_prompt_logprobs(
        self, state: RequestState, first_position: int, scored: list[TokenLogprobs]
    ) -> None:
        """Record the logprobs of prompt tokens first_position.. (see runner/prompt_logprobs.py);
        positions already scored (by a sibling of an n > 1 request, or before a preemption)
        keep their first values."""
        if state.prompt_logprobs is None:
            state.prompt_logprobs = [None] * len(state.prompt_token_ids)
        entries = state.prompt_logprobs
        prompt = state.prompt_token_ids
        for position, lp in enumerate(scored, start=first_position):
            if entries[position] is None:
                entries[position] = self._logprob_dict(prompt[position], lp)
                state.num_scored_prompt_tokens += 1

    def finish_sample(self, sample: SampleState) -> None:
        """Record the scheduler's verdict on a finished sample (unless a stop string ended it)."""
        if sample.finish_reason is None:
            sample.finish_reason = sample.request.status.finish_reason
            sample.stop_reason = sample.request.stop_reason

    def streams(self, state: RequestState) -> bool:
        """Whether the request's unfinished outputs are delivered (all but FINAL_ONLY)."""
        return state.params.output_kind is not _FINAL_ONLY

    def take_output(self, state: RequestState) -> RequestOutput | PoolingRequestOutput | None:
        """The output a consumer takes now, everything since the one it took before; None
        when nothing is due. A pooling request has one output, its pooled vector as the
        runner made it."""
        finished = state.finished
        kind = state.params.output_kind
        if not finished and (kind is _FINAL_ONLY or not state.changed):
            return None  # nothing due, or nothing new since the last output
        if state.pooled is not None:
            return PoolingRequestOutput(
                state.request_id, state.prompt_token_ids, state.pooled, True, state.metrics
            )
        delta = kind is _DELTA
        samples = state.samples
        changed = state.changed
        if delta and not finished and state.stream_interval > 1:
            changed = _due(samples, changed, state.stream_interval)
            if not changed:
                return None
            state.changed -= changed
        if delta and len(changed) < len(samples):
            samples = [s for s in samples if s.index in changed]
        changed.clear()
        return RequestOutput(  # positional, as in to_output
            state.request_id,
            state.prompt,
            state.prompt_token_ids,
            [s.to_output(delta) for s in samples],
            finished,
            self._prompt_logprobs_due(state, delta),
            state.num_cached_tokens,
            state.metrics,
        )

    def _prompt_logprobs_due(self, state: RequestState, delta: bool) -> PromptLogprobs | None:
        """A request's prompt logprobs once every prompt token is scored: in every output
        after that, or in the first only when outputs are deltas (vLLM's semantics)."""
        if state.params.prompt_logprobs is None or (delta and state.prompt_logprobs_sent):
            return None
        if state.num_scored_prompt_tokens < len(state.prompt_token_ids) - 1:
            return None
        state.prompt_logprobs_sent = True
        return state.prompt_logprobs or [None]

    def _logprob_dict(self, token_id: int, lp: TokenLogprobs) -> dict[int, Logprob]:
        entries = {
            token_id: Logprob(lp.sampled_logprob, lp.sampled_rank, self._decode_one(token_id))
        }
        for rank, (top_id, top_lp) in enumerate(
            zip(lp.top_token_ids, lp.top_logprobs, strict=True), start=1
        ):
            if top_id not in entries:
                entries[top_id] = Logprob(top_lp, rank, self._decode_one(top_id))
        return entries

    def _decode_one(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])


def _due(samples: list[SampleState], changed: set[int], interval: int) -> set[int]:
    """The changed samples a stream sends now under a stream interval (vLLM's rule): those
    that finished, have sent nothing yet, or gathered `interval` unsent tokens."""
    return {
        s.index
        for s in samples
        if s.index in changed
        and (
            s.finish_reason is not None
            or s.num_sent_tokens == 0
            or len(s.request.output_token_ids) - s.num_sent_tokens >= interval
        )
    }
