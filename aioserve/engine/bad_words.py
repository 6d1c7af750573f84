"""vLLM's `bad_words`: words a request's output must not contain, banned token by token.

Each word becomes token sequences as vLLM 0.32 makes them (`SamplingParams.
update_from_tokenizer`): the word as written (leading spaces stripped), and with one
leading space when that tokenizes to as many tokens starting with another one (the word in
the middle of text). At each step a sequence's last token is banned when the output's last
tokens are the sequence's others: a one-token sequence always, a longer one once its
prefix has just been generated (vLLM's `apply_bad_words`, over the output's tokens only).

The bans reach the sampler as a token bitmask, through the structured outputs' step masks
(structured_outputs/step_masks.py): `BadWordsMatcher` is a matcher that allows every
token but the banned ones, wrapped around the request's structured-output matcher when it
has one. A request that reasons before a structured answer (its reasoning gate closed)
gets no bans until its reasoning ends, as its constraint does.
"""

from __future__ import annotations

import functools
import os

import numpy as np
from transformers import PreTrainedTokenizerBase

from aioserve.engine.admission import InvalidRequest
from aioserve.engine.request import Request
from aioserve.engine.sampling_params import SamplingParams
from aioserve.engine.structured_outputs.compiler import StructuredOutputCompiler
from aioserve.engine.structured_outputs.matchers import Matcher
from aioserve.engine.structured_outputs.step_masks import ReasoningGate


def constrain(
    request: Request,
    params: SamplingParams,
    compiler: StructuredOutputCompiler,
    bad_words: list[list[int]] | None,
) -> None:
    """Give a new sequence its constraints: the matcher of its structured output (with its
    reasoning gate) and its `bad_words` token sequences' bans, wrapped around it."""
    if params.structured_outputs is not None:
        request.matcher = compiler.new_matcher(params.structured_outputs)
        if params.reasoning_end is not None:
            request.reasoning_gate = ReasoningGate(params.reasoning_end)
    if bad_words:
        request.matcher = BadWordsMatcher(bad_words, request.matcher, compiler.max_drafts)


def max_num_bad_words() -> int:
    """vLLM's cap on a request's token sequences (VLLM_MAX_NUM_BAD_WORDS)."""
    return int(os.environ.get("VLLM_MAX_NUM_BAD_WORDS", "128"))


def bad_words_token_ids(
    tokenizer: PreTrainedTokenizerBase, words: list[str], vocab_size: int
) -> list[list[int]]:
    """The token sequences that spell `words` (see above); InvalidRequest, naming
    `bad_words`, for a word of no tokens, too many sequences, or tokens past the model's
    vocabulary."""
    sequences: list[list[int]] = []
    for word in words:
        for prefix in ("", " "):
            ids = tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
            if not ids:
                if not prefix:
                    raise InvalidRequest(
                        "bad_words entries must tokenize to at least one token.",
                        "bad_words",
                        words,
                    )
                continue
            if prefix and (ids[0] == sequences[-1][0] or len(ids) != len(sequences[-1])):
                continue
            sequences.append(ids)
            if len(sequences) > max_num_bad_words():
                raise InvalidRequest(
                    f"Too many bad words after tokenization: {len(sequences)}. The max "
                    f"number is {max_num_bad_words()}.",
                    "bad_words",
                    words,
                )
    invalid = [t for ids in sequences for t in ids if not 0 <= t < vocab_size]
    if invalid:
        raise InvalidRequest(
            f"The model vocabulary size is {vocab_size}, but the following tokens were "
            f"specified as bad: {invalid}.",
            "bad_words",
            words,
        )
    return sequences


def bad_words_of(
    tokenizer: PreTrainedTokenizerBase | None, params: SamplingParams, vocab_size: int
) -> list[list[int]] | None:
    """The request's banned token sequences (bad_words_token_ids); None without bad_words.
    (A request with bad_words has a tokenizer: engine/admission.py refuses it otherwise.)"""
    if not params.bad_words:
        return None
    return _cached_token_ids(tokenizer, tuple(params.bad_words), vocab_size)


@functools.lru_cache(maxsize=256)
def _cached_token_ids(
    tokenizer: PreTrainedTokenizerBase, words: tuple[str, ...], vocab_size: int
) -> list[list[int]]:
    # A request's words are asked for by the server's check of each of its prompts and
    # again as it is admitted: tokenized once. The matchers only read the result.
    return bad_words_token_ids(tokenizer, list(words), vocab_size)


class BadWordsMatcher:
    """A matcher that bans the last token of every sequence whose other tokens end the
    output, around an optional structured-output matcher whose mask it narrows."""

    def __init__(
        self, sequences: list[list[int]], inner: Matcher | None = None, max_rollback: int = 0
    ) -> None:
        self.sequences = sequences
        self.inner = inner
        # The output's last tokens: as many as a prefix needs, and as many again as a
        # rollback may take back.
        self._tail: list[int] = []
        tail_length = max(len(ids) for ids in sequences) - 1
        self._kept_length = tail_length + max_rollback if tail_length else 0

    def fill_bitmask(self, words: np.ndarray) -> None:
        if self.inner is None:
            words.fill(-1)
        else:
            self.inner.fill_bitmask(words)
        tail = self._tail
        for ids in self.sequences:
            prefix = len(ids) - 1
            if prefix > len(tail) or (prefix and tail[len(tail) - prefix :] != ids[:prefix]):
                continue
            # Token t is bit t % 32 of word t // 32 (step_plan.TokenBitmask).
            banned = ids[-1]
            words.view(np.uint32)[banned // 32] &= np.uint32(0xFFFFFFFF ^ (1 << (banned % 32)))

    def accept(self, token_id: int) -> bool:
        if self._kept_length:
            self._tail.append(token_id)
            del self._tail[: -self._kept_length]
        return self.inner is None or self.inner.accept(token_id)

    def rollback(self, num_tokens: int) -> None:
        del self._tail[len(self._tail) - num_tokens :]
        if self.inner is not None:
            self.inner.rollback(num_tokens)
