"""The engine's view of one sequence being generated: its tokens, progress and status.

A user request with `n > 1` becomes n of these (one per sample), sharing the prompt; the
output processor gathers them back into one `RequestOutput`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from aioserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from aioserve.engine.block_hashing import BlockHash
    from aioserve.engine.lora_requests import LoRARequest
    from aioserve.engine.multimodal import ImageRows
    from aioserve.engine.structured_outputs.matchers import Matcher
    from aioserve.engine.structured_outputs.step_masks import ReasoningGate
    from aioserve.models.lora_adapter import LoRAAdapter


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"
    FINISHED_REPETITION = "repetition"  # a repeated token pattern (repetition_detection)

    is_finished: bool
    finish_reason: str | None

    def __init__(self, value: str) -> None:
        # Plain attributes rather than properties: read for every sequence on every step.
        self.is_finished = self.name.startswith("FINISHED")
        # vLLM's finish_reason string ("stop", "length", ...), None while unfinished.
        self.finish_reason = value if self.is_finished else None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    """The seed of this sequence's random stream: the request's own, or one the engine drew."""
    eos_token_ids: frozenset[int]
    max_tokens: int
    """Output tokens allowed: the request's max_tokens capped by the context left."""
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_index: int = 0
    """Position in arrival order: breaks ties between equal priorities."""
    eos_token_id: int | None = None
    """The tokenizer's own EOS, which ends the request with no stop_reason; the other
    `eos_token_ids` (a generation config's) report themselves, as vLLM, which adds them to
    the request's stop token ids."""
    pooling: bool = False
    """A pooling request: its prompt runs in one step, which ends it with a pooled vector
    instead of a token (pooling_params.py)."""
    token_type_ids: list[int] | None = None
    """A pooling prompt's segment of each token (0, or 1 for a BERT pair's second text)."""
    cache_salt: str | None = None
    """Salts the prefix cache's hashes of its blocks (kv_cache_manager.py): only requests
    with the same salt share cached blocks with it."""
    prompt_embeds: torch.Tensor | None = None
    """Its prompt as embeddings, one row a prompt token, whose tokens are then placeholders
    (prompt_embeds.py); None: a prompt of tokens."""
    images: tuple[ImageRows, ...] = ()
    """Its prompt's images: each one's features, which take the rows of its placeholder
    tokens (multimodal.py)."""
    lora: LoRARequest | None = None
    """The LoRA adapter it runs with (lora_requests.py); None: the base model."""
    lora_adapter: LoRAAdapter | None = None
    """That adapter's weights, read before the request was added."""

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Tokens whose KV is in the cache (prompt and output alike)."""
    num_cached_prompt_tokens: int = 0
    """Prompt tokens served from the prefix cache at the last admission."""
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the request, as vLLM reports it."""
    num_preemptions: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    """Chained hashes of this sequence's full blocks, extended as tokens are appended."""
    num_pending_tokens: int = 0
    """Tokens sampled by scheduled steps whose results the host has not seen yet."""
    in_runner: bool = False
    """The runner holds this sequence (it was admitted and has not left since)."""
    num_blocks_sent: int = 0
    """How many blocks of its table the runner has been told about."""
    num_registered_blocks: int = 0
    """Leading blocks of its table already offered to the prefix cache."""
    matcher: Matcher | None = None
    """Its structured output's matcher, or its bad words' around it (engine/bad_words.py),
    advanced by each token it keeps (None: unconstrained)."""
    reasoning_gate: ReasoningGate | None = None
    """Holds the matcher back while the output still reasons (step_masks.py)."""
    _history: np.ndarray | None = field(default=None, repr=False)
    """Prompt and output tokens as an array, for the n-gram lookup (`token_history`)."""
    _history_len: int = 0

    @property
    def lora_id(self) -> int:
        """Its adapter's id, 0 without one."""
        return 0 if self.lora is None else self.lora.lora_int_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_planned_tokens(self) -> int:
        """Prompt, output and pending tokens: where the sequence will be once its steps end."""
        return self.num_tokens + self.num_pending_tokens

    def token_ids_range(self, start: int, end: int) -> list[int]:
        """Tokens start..end of prompt + output, without building the whole list."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]

    def token_history(self) -> np.ndarray:
        """Its prompt and output tokens as one int64 array, kept between calls (the n-gram
        lookup of speculative decoding reads them every step): each call copies only the
        tokens appended since the last, into room that doubles when it runs out."""
        num_prompt = len(self.prompt_token_ids)
        length = num_prompt + len(self.output_token_ids)
        history = self._history
        if history is None or history.size < length:
            grown = np.empty(max(2 * length, 64), dtype=np.int64)
            if history is None:
                grown[:num_prompt] = self.prompt_token_ids
                self._history_len = num_prompt
            else:
                grown[: self._history_len] = history[: self._history_len]
            history = self._history = grown
        start = self._history_len
        if start < length:
            history[start:length] = self.output_token_ids[start - num_prompt :]
            self._history_len = length
        return history[:length]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
