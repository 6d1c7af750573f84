"""Incremental detokenization: one request's output token ids in, text pieces out.

The output processor calls `IncrementalDetokenizer.add_tokens` for each request after each
engine step, on the event loop, so a step must cost O(window), never a re-decode of the
whole output. The method is the sliding window vLLM uses (`detokenize_incrementally`, and
tokenizers' `DecodeStream` behind its v1 fast path):

- The window holds the token ids from the start of the previous piece's tokens onwards.
  `prefix_text` is the decode of the window up to `read` (the tokens already turned into
  text); decoding the whole window and dropping the first `len(prefix_text)` characters
  gives the new text. Decoding from a few tokens back, rather than the new tokens alone,
  keeps the characters that depend on their left neighbour right: sentencepiece decoders
  (Llama, Mistral) drop a leading "▁" space at the start of a decode, so the first new
  token alone would lose its space.
- While the decoded window ends with U+FFFD, the last tokens hold only part of a UTF-8
  character (byte-level BPE and byte-fallback tokens split emoji and CJK characters), so
  nothing is emitted until a later token completes it.
- The window starts in the prompt's last tokens, so the first output token decodes as it
  does in the decode of prompt + output.

The decode of a window is the tokenizer's own: for fast tokenizers the Rust `decode` that
`tokenizer.decode` calls (where `spaces_between_special_tokens` has no effect); for slow
(Python) tokenizers vLLM's path: added tokens verbatim, the runs between them through
`convert_tokens_to_string`, the parts joined with a space when
`spaces_between_special_tokens`. Neither applies `clean_up_tokenization_spaces` (as vLLM).

For fast tokenizers the `tokenizers` library's own `DecodeStream` runs the same window in
Rust, at about half the cost of the two decodes per token made from Python. A stream starts
from the window as it stands after a piece, and hands back to the Python rule at the first
token that emits nothing (an unfinished character, an empty decode) or whose decode does
not extend the prefix's; the Python rule decides from there (it also bounds the wait for
invalid bytes, which the stream does not), and a new stream takes over after its next
piece. Either way the pieces are the same.

Byte-level tokenizers (a lone ByteLevel decoder: GPT-2, Llama 3, Qwen, SmolLM2) decode by
concatenating each token's bytes, so right after a piece (the window fully read, its text
ending on a whole character) a token whose bytes form whole characters by themselves adds
exactly its own text: the piece is looked up in a table of every token's standalone decode,
built once per tokenizer, instead of decoding a window (~0.3 against ~1.3 µs a token). Any
other token goes through the stream or the Python rule as above, from the same window.

The pieces joined equal what the output adds to the decode of the prompt (for byte-level
tokenizers, the plain decode of the output tokens), except that tokens still pending when
the request ends (an unfinished character) are never emitted, as in vLLM. Where the prompt
(given as token ids) ends inside a character, the output is decoded on its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import ByteLevel, DecodeStream
from transformers import PreTrainedTokenizerBase

# Prompt tokens decoded ahead of the first output token (vLLM uses the same count).
PROMPT_CONTEXT_TOKENS = 5
# How far back to look for a prompt suffix that decodes without U+FFFD (vLLM: 23).
MAX_PROMPT_CONTEXT_TOKENS = 24
# A UTF-8 character is at most 4 bytes and every byte-carrying token holds at least one,
# so a window this far behind has invalid bytes, not an unfinished character: emit it
# (with its U+FFFD, as the full decode shows it) rather than let the window grow forever.
MAX_PENDING_TOKENS = 32

_REPLACEMENT_CHAR = "\ufffd"

try:
    DecodeStream(ids=[], skip_special_tokens=False)
    _HAS_DECODE_STREAM = True
except TypeError:  # tokenizers < 0.22: a stream cannot start from given ids
    _HAS_DECODE_STREAM = False


class IncrementalDetokenizer:
    """Turns one request's output token ids into text, a piece per call."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._skip_special_tokens = skip_special_tokens
        self._backend: Tokenizer | None = None  # the Rust tokenizer a DecodeStream can drive
        # Each token's text where it is whole characters by itself (byte-level tokenizers).
        self._whole_texts: list[str | None] | None = None
        if tokenizer.is_fast:
            self._decode = _fast_decoder(tokenizer, skip_special_tokens)
            backend = tokenizer.backend_tokenizer
            if isinstance(backend, Tokenizer):
                if _HAS_DECODE_STREAM:
                    self._backend = backend
                if isinstance(backend.decoder, ByteLevel):
                    self._whole_texts = _whole_token_texts(backend, skip_special_tokens)
        else:
            self._decode = _slow_decoder(
                tokenizer, skip_special_tokens, spaces_between_special_tokens
            )
        self._window = self._prompt_context(prompt_token_ids)
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        # Right after a piece whose text ends on a whole character, the stream that would
        # take over is made only when a token needs it (`_at_clean_piece_end`).
        self._stream: DecodeStream | None = None
        self._at_clean_piece_end = not self._prefix_text.endswith(_REPLACEMENT_CHAR)
        self._pieces: list[str] = []

    @classmethod
    def resumed(
        cls,
        tokenizer: PreTrainedTokenizerBase,
        window: Sequence[int],
        read: int,
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> IncrementalDetokenizer:
        """A detokenizer that goes on where another left off: its `window` (token ids)
        and how many of them were read (`window_state`). Decodes as that one would have."""
        detokenizer = cls(
            tokenizer,
            (),
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
        )
        detokenizer._window = list(window)
        detokenizer._read = min(max(read, 0), len(window))
        detokenizer._prefix_text = detokenizer._decode(detokenizer._window[: detokenizer._read])
        detokenizer._at_clean_piece_end = detokenizer._read == len(window) and not (
            detokenizer._prefix_text.endswith(_REPLACEMENT_CHAR)
        )
        return detokenizer

    @property
    def window_state(self) -> tuple[list[int], int]:
        """(the window's token ids, how many of them are read): all `resumed` needs."""
        return list(self._window), self._read

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """The new text these tokens complete ("" while a UTF-8 character is incomplete)."""
        if len(token_ids) == 1:  # the usual decode step
            new_text = self._add_token(token_ids[0])
        else:
            new_text = "".join([self._add_token(token_id) for token_id in token_ids])
        if new_text:
            self._pieces.append(new_text)
        return new_text

    @property
    def output_text(self) -> str:
        """All text emitted so far: the pieces joined."""
        return "".join(self._pieces)

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The shortest prompt suffix (of at least PROMPT_CONTEXT_TOKENS) that decodes cleanly.

        A suffix that starts or ends inside a character decodes with U+FFFD, and with
        byte-fallback decoders a broken run of byte tokens turns wholly into U+FFFD, which
        would garble the first output characters. Where no short suffix is clean (a prompt
        given as token ids that ends inside a character), the output decodes on its own.
        """
        n = len(prompt_token_ids)
        for length in range(min(n, PROMPT_CONTEXT_TOKENS), min(n, MAX_PROMPT_CONTEXT_TOKENS) + 1):
            context = list(prompt_token_ids[n - length :])
            if _REPLACEMENT_CHAR not in self._decode(context):
                return context
        return []

    def _add_token(self, token_id: int) -> str:
        window = self._window
        if self._at_clean_piece_end:
            texts = self._whole_texts
            piece = texts[token_id] if texts is not None and token_id < len(texts) else None
            if piece:  # its text follows the prefix's as it stands: slide past it at once
                self._window = [token_id]
                self._read = 1
                self._prefix_text = piece
                self._stream = None
                return piece
            if self._stream is None and self._backend is not None:
                self._stream = DecodeStream(
                    ids=list(window), skip_special_tokens=self._skip_special_tokens
                )
            self._at_clean_piece_end = False
        window.append(token_id)
        if self._stream is not None:
            try:
                piece = self._stream.step(self._backend, token_id)
            except Exception:  # its InvalidPrefix: the decode does not extend the prefix's
                piece = None
            if piece is not None:
                # Slide (as below): the tokens just read become the left context.
                del window[: self._read]
                self._read = len(window)
                self._at_clean_piece_end = True  # a stream emits only whole characters
                return piece
            # Back to the Python rule, from the same window; the stream kept its prefix text.
            self._stream = None
            self._prefix_text = self._decode(window[: self._read])
        text = self._decode(window)
        pending = len(window) - self._read
        if pending < MAX_PENDING_TOKENS and (
            len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT_CHAR)
        ):
            return ""
        piece = text[len(self._prefix_text) :]
        # Slide: the tokens just read become the left context of the next step.
        del window[: self._read]
        self._read = len(window)
        self._prefix_text = self._decode(window)
        # A DecodeStream decodes its ids as its prefix text on its first step, and would not
        # take one ending in U+FFFD: then the Python rule keeps the window until its next piece.
        self._stream = None
        self._at_clean_piece_end = not self._prefix_text.endswith(_REPLACEMENT_CHAR)
        return piece


@functools.cache
def _whole_token_texts(backend: Tokenizer, skip_special_tokens: bool) -> list[str | None]:
    """Each token's decode on its own where it is whole characters (no U+FFFD), else None;
    "" for a token that decodes to nothing. One batched decode of the vocabulary, ~50 ms for
    49k tokens, kept for the process."""
    texts = backend.decode_batch(
        [[token_id] for token_id in range(backend.get_vocab_size(with_added_tokens=True))],
        skip_special_tokens=skip_special_tokens,
    )
    return [None if _REPLACEMENT_CHAR in text else text for text in texts]


def _fast_decoder(
    tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool
) -> Callable[[list[int]], str]:
    # The Rust decode behind `tokenizer.decode`; ids outside the vocabulary (a model's
    # padded embedding rows) decode to nothing.
    return functools.partial(
        tokenizer.backend_tokenizer.decode, skip_special_tokens=skip_special_tokens
    )


def _slow_decoder(
    tokenizer: PreTrainedTokenizerBase,
    skip_special_tokens: bool,
    spaces_between_special_tokens: bool,
) -> Callable[[list[int]], str]:
    vocab_size = len(tokenizer)
    added_tokens = set(tokenizer.get_added_vocab())
    separator = " " if spaces_between_special_tokens else ""

    def decode(token_ids: list[int]) -> str:
        known_ids = [i for i in token_ids if 0 <= i < vocab_size]
        tokens = tokenizer.convert_ids_to_tokens(known_ids, skip_special_tokens=skip_special_tokens)
        parts: list[str] = []
        run: list[str] = []
        for token in tokens:
            if token in added_tokens:
                if run:
                    parts.append(tokenizer.convert_tokens_to_string(run))
                    run = []
                parts.append(token)
            else:
                run.append(token)
        if run:
            parts.append(tokenizer.convert_tokens_to_string(run))
        return separator.join(parts)

    return decode
