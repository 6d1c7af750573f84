"""Load shedding: vLLM's --max-num-queued-reqs and --max-num-queued-tokens (vLLM PR #49445).

Two independent caps, checked before a request enters the engine, with vLLM's semantics:

- max_num_queued_reqs: sequences in flight (waiting or running; a request with n > 1 is n
  sequences). A request is refused when the sequences in flight plus its own n would
  exceed the cap.
- max_num_queued_tokens: the prefill backlog, the prompt tokens of the sequences that have
  produced no token yet, whole prompts however far their prefill has got. A request is
  refused while the backlog is at or above the cap; its own prompt is not counted, so the
  check needs no tokenization and one long prompt is admitted into an empty backlog.

A refusal is a `QueueFullError` (HTTP 503 with Retry-After in the server), with vLLM's
messages; `LoadShedder.rejections` counts them by reason (vLLM's
`vllm:admission_rejections_total`).

The server checks before it renders or tokenizes anything and then holds its places with a
`Reservation` while it does (a request being tokenized is in flight too), so that a burst
cannot all pass the check before any of it is registered; the reservation is handed over
as the engine registers the request. `AsyncEngine.generate` checks again on registration,
which is where the prefill backlog of requests tokenized meanwhile is seen. Requests
already admitted are never touched. `AsyncEngine.add_request`, the path of the offline
`LLM`, is not checked: an offline batch has nobody to retry a refused request.
"""

from __future__ import annotations

from aioserve.engine.scheduler import Scheduler

MAX_NUM_QUEUED_REQS = "max_num_queued_reqs"
MAX_NUM_QUEUED_TOKENS = "max_num_queued_tokens"
REASONS = (MAX_NUM_QUEUED_REQS, MAX_NUM_QUEUED_TOKENS)
"""The `reason` of a refusal: the setting that refused it."""

_MESSAGES = {
    MAX_NUM_QUEUED_REQS: "The engine is currently busy and cannot accept new requests. "
    "Please try again later or on a different instance.",
    MAX_NUM_QUEUED_TOKENS: "The engine has reached its prefill token backlog limit. "
    "Please try again later or on a different instance.",
}


class QueueFullError(Exception):
    """A request refused by a queue cap; `reason` names the cap (one of REASONS)."""

    def __init__(self, reason: str) -> None:
        super().__init__(_MESSAGES[reason])
        self.reason = reason
        self.message = _MESSAGES[reason]


class LoadShedder:
    """The caps of one engine, what is reserved under them, and what they refused."""

    def __init__(
        self,
        scheduler: Scheduler,
        max_num_queued_reqs: int | None,
        max_num_queued_tokens: int | None,
    ) -> None:
        self.scheduler = scheduler
        self.max_num_queued_reqs = max_num_queued_reqs
        self.max_num_queued_tokens = max_num_queued_tokens
        self.num_reserved = 0
        """Sequences admitted by `reserve` and not registered in the engine yet."""
        self.rejections = dict.fromkeys(REASONS, 0)

    @property
    def num_in_flight(self) -> int:
        """Sequences waiting or running, plus those reserved for requests on their way in."""
        return self.scheduler.num_waiting + self.scheduler.num_running + self.num_reserved

    def check(self, num_sequences: int) -> None:
        """Raise QueueFullError if a request of `num_sequences` sequences must be refused."""
        cap = self.max_num_queued_reqs
        if cap is not None and self.num_in_flight + num_sequences > cap:
            self._refuse(MAX_NUM_QUEUED_REQS)
        cap = self.max_num_queued_tokens
        if cap is not None and self.scheduler.num_prefill_tokens >= cap:
            self._refuse(MAX_NUM_QUEUED_TOKENS)

    def reserve(self, num_sequences: int) -> Reservation:
        """`check`, then hold `num_sequences` places in flight until they are released."""
        self.check(num_sequences)
        self.num_reserved += num_sequences
        return Reservation(self, num_sequences)

    def _refuse(self, reason: str) -> None:
        self.rejections[reason] += 1
        raise QueueFullError(reason)


class Reservation:
    """Places held under max_num_queued_reqs; a context manager that releases what is left."""

    def __init__(self, shedder: LoadShedder, num_sequences: int) -> None:
        self._shedder = shedder
        self.num_sequences = num_sequences

    def release(self, num_sequences: int | None = None) -> None:
        """Give back `num_sequences` places (all that are left by default)."""
        count = (
            self.num_sequences if num_sequences is None else min(num_sequences, self.num_sequences)
        )
        self.num_sequences -= count
        self._shedder.num_reserved -= count

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
