"""Continuous batching: which sequences run in the next model step, and how many tokens each.

Every step has a token budget (`max_num_batched_tokens`) and a cap on running sequences
(`max_num_seqs`). Running sequences are served first (a decode is one token; an unfinished
prompt continues with its next chunk), then waiting ones are admitted in policy order
while budget, sequence slots and KV blocks last. A prompt longer than the budget is split
into chunks over several steps when chunked prefill is on.

When a running sequence cannot get a block, the running sequence that the policy ranks
last is preempted by recompute: its blocks are freed and it goes back to the front of
the waiting queue, to be prefilled again (its prefix may still hit the cache). Nothing
is ever dropped.

The limits of vLLM 0.32 (`limits`, scheduler_limits.py): the step's budget may be lower
than max_num_batched_tokens (--max-num-scheduled-tokens), fewer sequences than
max_num_seqs may run (--max-num-active-seqs), and a waiting request is admitted only if
the KV cache can hold its whole prompt, not just its first chunk
(--scheduler-reserve-full-isl, on by default), and leave the --watermark's blocks free
while others run.

Policies: "fcfs" ranks by arrival; "priority" by (priority, arrival), lower first.

With LoRA adapters, at most `max_loras` distinct adapters run at once: a waiting request
whose adapter would be one more is passed over for this step, and later ones may go
ahead of it, as in vLLM.

With `long_prefill_token_threshold` (vLLM's --long-prefill-token-threshold) no sequence
computes more than that many tokens in one step, so that a long prompt cannot take a
step's whole budget from the others; a sequence alone in the engine (running or waiting)
is not held back, as in vLLM; with --long-prefill-token-threshold-adaptive the cap is at
least max_num_batched_tokens divided by the sequences running and waiting.

With `partial_prefills` (vLLM's --max-num-partial-prefills N > 1 and
--max-long-partial-prefills, partial_prefills.py), several prompts are prefilled side by
side: each prefill chunk takes at most the budget divided by the step's prefills, at most N
sequences are left mid-prefill by a step, and a long waiting prompt beyond the long ones'
limit is passed over for the step (keeping its place) while shorter ones behind it start.

With `prompt_delay` (vLLM V0's --scheduler-delay-factor, prompt_delay.py), waiting prompts
are held back while requests run, until the oldest waiting request has waited longer than
the factor times the last prompt step's latency, so that prompts start in batches.

A step may be scheduled before the previous one has returned (asynchronous scheduling):
a sequence's progress (`num_computed_tokens`) advances when its chunk is scheduled, and a
chunk that samples leaves a pending token, which the next step can already decode (the
runner takes it from its own record) and which `update` later turns into a known token.
A sequence whose pending tokens will reach its max_tokens or the context limit is not
scheduled again; its last result ends it.

With speculative decoding (`speculation`, vLLM's --speculative-config method "ngram"), a
decode whose last tokens occurred earlier in its sequence also computes the tokens that
followed them there (its drafts, speculation.py) and samples at each; `update` keeps the
drafts its samples confirmed and counts only their KV as computed (the rest is written
over later). Drafts are added once every sequence has its chunk,
from the budget and KV blocks left (they never preempt), and never pass the request's
max_tokens or the context. They need the host to know the
sequence's tokens, so speculation runs without asynchronous scheduling (resolution.py).

Each `schedule()` also describes the step in plain data for the runner (`StepPlan`):
sequences entering the runner, the chunks, and the sequences that left it since.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from aioserve.config.speculative import NgramSpeculation
from aioserve.engine.kv_cache_manager import KVCacheManager
from aioserve.engine.partial_prefills import PartialPrefillLimits
from aioserve.engine.plan_builder import new_sequence, sequence_chunk
from aioserve.engine.prompt_delay import PromptDelay
from aioserve.engine.repetition import ends_in_repetition
from aioserve.engine.request import Request, RequestStatus
from aioserve.engine.scheduler_limits import SchedulerLimits, long_prefill_cap
from aioserve.engine.speculation import propose_ngram_drafts
from aioserve.runner.step_plan import StepPlan

# Read for every sequence on every step; an enum member looked up on its class costs ~90 ns.
_RUNNING = RequestStatus.RUNNING


@dataclass
class ScheduledChunk:
    """One sequence's share of a step: tokens num_computed..num_computed+num_tokens."""

    request: Request
    num_computed_tokens: int
    num_tokens: int
    samples: bool  # the chunk reaches the sequence's last (known or pending) token
    drafts: list[int] = field(default_factory=list)  # its last len(drafts) tokens (speculative)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    preempted: list[Request] = field(default_factory=list)
    plan: StepPlan | None = None  # the same step for the runner

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    # Speculative decoding, as vLLM counts it: chunks with drafts, drafts, drafts kept, and
    # per draft position the chunks that kept it.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool,
        policy: str = "fcfs",
        long_prefill_token_threshold: int = 0,
        max_loras: int = 0,
        speculation: NgramSpeculation | None = None,
        partial_prefills: PartialPrefillLimits | None = None,
        prompt_delay: PromptDelay | None = None,
        limits: SchedulerLimits | None = None,  # None: vLLM's defaults
    ) -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be fcfs or priority, got {policy!r}")
        self.kv_cache = kv_cache
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.max_loras = max_loras  # most LoRA adapters running at once (0: LoRA is off)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = policy
        self.speculation = speculation
        self.partial_prefills = partial_prefills  # None: one prompt's prefill at a time
        self.prompt_delay = prompt_delay  # None: prompts are not held back
        self.limits = limits or SchedulerLimits()
        self.stats = SchedulerStats()
        if speculation is not None:
            self.stats.num_accepted_tokens_per_pos = [0] * speculation.num_speculative_tokens
        self.running: list[Request] = []
        self._running_sorted = True  # admissions append out of rank order
        # A heap of (rank, tiebreak, request): siblings of an n > 1 request share a rank.
        self._waiting: list[tuple[tuple, int, Request]] = []
        self._tiebreak = itertools.count()
        self._requests: dict[str, Request] = {}
        self._left_runner: list[str] = []  # sequences the next plan tells the runner to forget
        self.admitting = True  # False while generation is paused (pause.py): none start

    # -- bookkeeping ------------------------------------------------------------------------

    def _rank(self, request: Request) -> tuple:
        if self.policy == "priority":
            return (request.priority, request.arrival_index)
        return (request.arrival_index,)

    @property
    def token_budget(self) -> int:
        """The step's budget: vLLM's scheduled-token budget and the runner's input budget
        both shrink by each chunk (n-gram drafts take no extra slots): the smaller binds."""
        scheduled = self.limits.max_num_scheduled_tokens
        budget = self.max_num_batched_tokens
        return scheduled if scheduled and scheduled < budget else budget

    @property
    def max_num_active_seqs(self) -> int:
        """Most sequences running at once: max_num_seqs unless the limits ask for fewer."""
        active = self.limits.max_num_active_seqs
        return active if active and active < self.max_num_seqs else self.max_num_seqs

    @property
    def watermark_blocks(self) -> int:
        """Blocks an admission leaves free while other sequences run."""
        return int(self.limits.watermark * self.kv_cache.num_blocks)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt tokens of the sequences with no output token yet, whole prompts however far
        their prefill has got: the backlog vLLM's --max-num-queued-tokens caps."""
        return sum(
            len(r.prompt_token_ids) for r in self._requests.values() if not r.output_token_ids
        )

    def lora_adapters(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The names of the adapters of the running requests, and of the waiting ones, each
        sorted (no sort of the waiting queue itself, once a step)."""
        running = {r.lora.lora_name for r in self.running if r.lora is not None}
        waiting = {e[2].lora.lora_name for e in self._waiting if e[2].lora is not None}
        return tuple(sorted(running)), tuple(sorted(waiting))

    def has_unfinished(self) -> bool:
        return bool(self.running or self._waiting)

    def add_request(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        if request.num_prompt_tokens == 0:
            raise ValueError("the prompt must contain at least one token")
        self._requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        heapq.heappush(self._waiting, (self._rank(request), next(self._tiebreak), request))

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests (aborted, stopped by text, errored); their blocks return to the pool."""
        ended = []
        ids = set(request_ids)
        for request_id in ids:
            request = self._requests.pop(request_id, None)
            if request is None:
                continue
            request.status = status
            self._release(request)
            ended.append(request)
        if ended:
            self.running = [r for r in self.running if r.request_id not in ids]
            self._waiting = [entry for entry in self._waiting if entry[2].request_id not in ids]
            heapq.heapify(self._waiting)
        return ended

    # -- one step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.token_budget
        # A sequence's most tokens this step: the threshold, unless it is the only one.
        cap = long_prefill_cap(
            self.long_prefill_token_threshold,
            len(self.running) + len(self._waiting),
            self.max_num_batched_tokens,
            self.limits.adaptive_long_prefill_threshold,
        )
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []
        admitted: list[Request] = []

        # Running sequences, in rank order, so that the last ranked is preempted first.
        # Only admissions disturb the order (removals keep it), so most steps skip the sort.
        running = self.running
        if not self._running_sorted:
            running.sort(key=self._rank)
            self._running_sorted = True
        allocate = self.kv_cache.allocate
        step = None
        share = budget  # most tokens of one chunk
        if self.partial_prefills is not None:
            waiting = (entry[2] for entry in self._waiting)
            step = self.partial_prefills.begin_step(running, waiting, share)
            share = step.share
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            num_new = self._tokens_to_compute(request, budget if budget < share else share, cap)
            if num_new == 0:
                i += 1
                continue
            while not allocate(request, num_new):
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                chunks.append(self._schedule_chunk(request, num_new))
                budget -= num_new
                i += 1
                continue
            break  # the request preempted itself: everything ranked after it is gone too

        # Waiting sequences, unless something had to be preempted this step.
        running_loras = {r.lora_id for r in self.running if r.lora_id} if self.max_loras else ()
        passed_over: list[tuple[tuple, int, Request]] = []
        if step is not None:
            step.count_partial(self.running)
        delay = self.prompt_delay
        if delay is not None:
            now, was_running = delay.step_begins(), bool(self.running)
        max_active, watermark_blocks = self.max_num_active_seqs, self.watermark_blocks
        while (
            self.admitting
            and self._waiting
            and not preempted
            and budget > 0
            and len(self.running) < max_active
        ):
            if delay is not None and not delay.admits(
                now, (e[2] for e in self._waiting), was_running
            ):
                break  # --scheduler-delay-factor: not yet
            request = self._waiting[0][2]
            if request.num_pending_tokens:
                break  # preempted while a step ran: its token must be known first
            lora_id = request.lora_id
            if lora_id and lora_id not in running_loras and len(running_loras) >= self.max_loras:
                # Its adapter would be one too many: later requests may still fit (vLLM's rule).
                passed_over.append(heapq.heappop(self._waiting))
                continue
            if step is not None and step.passes_over(request):
                passed_over.append(heapq.heappop(self._waiting))  # a long prompt too many
                continue
            cached = self.kv_cache.find_cached_prefix(request)
            request.num_computed_tokens = len(cached) * self.kv_cache.block_size
            num_new = self._tokens_to_compute(request, budget if budget < share else share, cap)
            # --watermark: blocks left free for the running sequences to grow into.
            keep_free = watermark_blocks if self.running else 0
            if (
                num_new == 0
                or (step is not None and not step.may_start(request, num_new))
                or (
                    self.limits.reserve_full_isl
                    and not self.kv_cache.fits(
                        min(request.num_tokens, self.max_model_len), cached, keep_free
                    )
                )
                or not self.kv_cache.allocate(request, num_new, cached, keep_free)
            ):
                request.num_computed_tokens = 0
                break
            heapq.heappop(self._waiting)
            self.kv_cache.record_lookup(request.num_tokens, request.num_computed_tokens)
            if request.num_output_tokens == 0:
                request.num_cached_prompt_tokens = request.num_computed_tokens
            request.status = RequestStatus.RUNNING
            request.in_runner = True
            request.num_blocks_sent = 0
            self.running.append(request)
            self._running_sorted = False
            admitted.append(request)
            if lora_id:
                running_loras.add(lora_id)
            if step is not None:
                step.start(request, num_new)
            chunks.append(self._schedule_chunk(request, num_new))
            budget -= num_new
        for entry in passed_over:
            heapq.heappush(self._waiting, entry)
        if self.speculation is not None and budget > 0:
            self._add_drafts(chunks, budget, cap)
        if not chunks:  # no step: the runner hears of departures with the next one
            return SchedulerOutput(chunks, preempted)
        plan = StepPlan(
            new_sequences=[new_sequence(r) for r in admitted],
            chunks=[
                sequence_chunk(
                    c.request,
                    c.num_computed_tokens,
                    c.num_tokens,
                    c.samples,
                    self.kv_cache,
                    c.drafts,
                )
                for c in chunks
            ],
            finished_seq_ids=self._left_runner,
        )
        self._left_runner = []
        output = SchedulerOutput(chunks, preempted, plan)
        if delay is not None and admitted:
            delay.prompts_admitted(output, now)
        return output

    def _schedule_chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        """Count the chunk as computed; one that reaches the end leaves a pending token."""
        start = request.num_computed_tokens
        end = start + num_new
        samples = end == request.num_planned_tokens
        request.num_computed_tokens = end
        if samples:
            request.num_pending_tokens += 1
        return ScheduledChunk(request, start, num_new, samples)

    def _add_drafts(self, chunks: list[ScheduledChunk], budget: int, cap: int) -> None:
        """Give the step's decodes their drafts, in rank order, from the budget and KV blocks
        every chunk has left: a draft never takes what a sequence needs to go on."""
        for chunk in chunks:
            if budget <= 0:
                return
            request = chunk.request
            if chunk.num_tokens != 1 or not chunk.samples:
                continue
            room = min(budget, cap - 1) if cap else budget
            drafts = self._drafts(request, room)
            # The chunk's one token is counted in num_computed_tokens already.
            if drafts and self.kv_cache.allocate(request, len(drafts)):
                chunk.num_tokens += len(drafts)
                chunk.drafts = drafts
                request.num_computed_tokens += len(drafts)
                budget -= len(drafts)

    def _drafts(self, request: Request, room: int) -> list[int]:
        """The drafts of a decode scheduled this step, at most `room` and as many as its
        max_tokens and the context leave room for. A constrained sequence (structured
        output, bad words) drafts once its reasoning has ended, and never past an EOS
        token: its step masks follow its drafts through its matcher (step_masks.py). A
        sequence with a thinking budget does not draft (runner/thinking_budget.py)."""
        if request.reasoning_gate is not None or not request.output_token_ids:
            return []
        if request.sampling_params.thinking_token_budget is not None:
            return []  # its forced tokens are worked out one row a sequence
        num_output = len(request.output_token_ids)
        num_tokens = len(request.prompt_token_ids) + num_output
        room = min(
            room,
            self.speculation.num_speculative_tokens,
            request.max_tokens - num_output - 1,
            self.max_model_len - num_tokens - 1,
        )
        if room < 1:
            return []
        drafts = propose_ngram_drafts(request.token_history(), self.speculation, room)
        if request.matcher is not None:
            for i, token in enumerate(drafts):
                if token in request.eos_token_ids:
                    return drafts[:i]
        return drafts

    def _tokens_to_compute(self, request: Request, budget: int, cap: int) -> int:
        pending = request.num_pending_tokens
        num_output = len(request.output_token_ids)
        planned = len(request.prompt_token_ids) + num_output + pending  # num_planned_tokens
        if pending and (
            num_output + pending >= request.max_tokens or planned >= self.max_model_len
        ):
            return 0  # its pending token is its last: the step's result will end it
        remaining = planned - request.num_computed_tokens
        if 0 < cap < remaining:
            remaining = cap
        if remaining > budget and not self.enable_chunked_prefill:
            return 0
        return min(remaining, budget)

    def _release(self, request: Request) -> None:
        """Free the request's blocks; the next plan tells the runner that it left."""
        self.kv_cache.free(request)
        if request.in_runner:
            request.in_runner = False
            self._left_runner.append(request.request_id)

    def _preempt(self, request: Request) -> None:
        self._release(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        heapq.heappush(self._waiting, (self._rank(request), next(self._tiebreak), request))

    def preempt_running(self) -> None:
        """Preempt every running sequence: its blocks freed, it waits to be computed again.
        Only with no step in flight (no pending token may be lost)."""
        running, self.running = self.running, []
        for request in running:
            self._preempt(request)

    def update(self, output: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Record a finished step: its sampled tokens are appended, its full blocks cached.

        `sampled` maps request id to the tokens sampled for it this step; a list is cut
        after a token that ends its request (a speculative step samples several). A request
        preempted while the step ran keeps its token (it was sampled from a valid state);
        one that ended meanwhile drops it. Stop conditions on tokens (EOS, stop_token_ids,
        max_tokens, context length) end requests here, and a pooling request ends with the
        step that runs its prompt; text stop strings are checked by
        the output processor, which then calls `finish_requests`. Returns the requests
        that finished in this update.
        """
        finished: list[Request] = []
        if self.prompt_delay is not None:
            self.prompt_delay.step_recorded(output)
        cache_full_blocks = self.kv_cache.cache_full_blocks
        for chunk in output.chunks:
            request = chunk.request
            if chunk.samples:
                request.num_pending_tokens -= 1
            if request.status.is_finished:
                continue  # aborted or stopped while the step ran
            if request.pooling:
                if chunk.samples:  # its whole prompt ran: the step pooled it
                    request.status = RequestStatus.FINISHED_STOPPED
                    finished.append(request)
                continue
            new_tokens = sampled.get(request.request_id, ())
            num_sampled = len(new_tokens)
            for kept, token_id in enumerate(new_tokens, 1):
                request.output_token_ids.append(token_id)
                status = self._check_stop(request, token_id)
                if status is not None:
                    request.status = status
                    del new_tokens[kept:]  # those after the stop are not the request's
                    break
            written = chunk.num_computed_tokens + chunk.num_tokens
            if chunk.drafts:
                # The KV of the drafts its samples confirmed is good; the rest is not.
                written = chunk.num_computed_tokens + len(new_tokens)
                request.num_computed_tokens = written
                self._count_accepted(len(chunk.drafts), num_sampled - 1)
            if request.status.is_finished:
                finished.append(request)
            elif request.status is not _RUNNING:
                continue  # preempted while the step ran: its blocks are gone
            # A request that ends here caches its blocks too, before it frees them: one
            # whose whole prompt ran in this step (max_tokens 1) would leave none behind.
            cache_full_blocks(request, written)
        if finished:
            done = {r.request_id for r in finished}
            self.running = [r for r in self.running if r.request_id not in done]
            if any(r.request_id in done for _, _, r in self._waiting):
                self._waiting = [e for e in self._waiting if e[2].request_id not in done]
                heapq.heapify(self._waiting)
            for request in finished:
                del self._requests[request.request_id]
                self._release(request)
        return finished

    def _count_accepted(self, num_drafts: int, num_accepted: int) -> None:
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        per_pos = stats.num_accepted_tokens_per_pos
        for position in range(num_accepted):
            per_pos[position] += 1

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                request.stop_reason = None if token_id == request.eos_token_id else token_id
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if (
            num_output >= request.max_tokens
            or len(request.prompt_token_ids) + num_output >= self.max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH
        repetition = params.repetition_detection
        if (
            repetition is not None
            and num_output >= params.min_tokens
            and ends_in_repetition(request.output_token_ids, repetition)
        ):
            request.stop_reason = "repetition_detected"
            return RequestStatus.FINISHED_REPETITION
        return None
