"""Reasoning parsers (--reasoning-parser): a chat answer's reasoning part goes to the
message's `reasoning` field, the rest to `content`, streamed or not. Each parser is a marker
spec (engine/reasoning_parsers.py, which says what each does); this module's one splitter
runs them all.

The parsers vLLM 0.32 names here split on the text, so the split is the same whatever the
token boundaries: a marker cut across tokens, or across stream chunks, is held back until
it is whole, and a marker never reaches either field (a start marker inside the reasoning
is dropped; a tool-call marker that ends the reasoning stays in the content, for the tool
parser). An answer that never closes its reasoning is all reasoning, content null.

Where the rendered prompt already closed the reasoning (its last think marker is the end
marker, within the last turn for parsers whose template marks turns), the answer is all
content, as vLLM's streaming sees it; aioserve splits a whole answer the same way, so that
streamed and not-streamed answers agree. Whitespace around the markers is kept, as vLLM
keeps it, but for the parsers that drop the reasoning's trailing whitespace.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from aioserve.engine.reasoning_parsers import SPECS, THINK_END, THINK_START, ParserSpec

__all__ = ["THINK_END", "THINK_START"]

_AT_START, _BEFORE, _REASONING, _CONTENT = range(4)


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""


def _spec(parser: str) -> ParserSpec:
    if parser not in SPECS:
        raise ValueError(f"unknown reasoning parser {parser!r}")
    return SPECS[parser]


def thinks(parser: str, chat_template_kwargs: dict | None) -> bool:
    """Whether an answer starts with (or waits for) reasoning under `parser` ("": none)."""
    return bool(parser) and _spec(parser).thinking(chat_template_kwargs)


def reasoning_end_marker(parser: str) -> str:
    """The marker after which a reasoning answer's constrained part starts."""
    return _spec(parser).end


def reasoning_closed(parser: str, prompt: str) -> bool:
    """Whether a rendered prompt ends its reasoning itself (its last start marker is
    closed), as vLLM's parsers check the prompt: the answer then starts with content.
    Parsers whose template marks turns look at the last turn only (vLLM stops at a turn
    boundary); step3, which has no start marker, at any end marker in the prompt."""
    spec = _spec(parser)
    if spec.turn_boundaries:
        turn_start = max(prompt.rfind(mark) + len(mark) for mark in spec.turn_boundaries)
        prompt = prompt[max(turn_start, 0) :]
    if not spec.start:
        return spec.end in prompt
    return prompt.rfind(spec.end) > prompt.rfind(spec.start)


class ReasoningSplitter:
    """Splits one answer's text, fed in pieces, into reasoning and content."""

    def __init__(
        self, parser: str, chat_template_kwargs: dict | None = None, prompt_closed: bool = False
    ) -> None:
        self.parser = parser
        self.spec = spec = _spec(parser)
        self.thinking = spec.thinking(chat_template_kwargs) and not prompt_closed
        if not self.thinking:
            self._state = _CONTENT
        elif spec.opens_in_content:
            self._state = _BEFORE
        else:
            self._state = _AT_START if spec.space_before_start_dropped else _REASONING
        starts = (spec.start,) if spec.start else ()
        self._markers = (*starts, spec.end, *spec.implicit_ends)
        self._prefix = spec.content_prefix
        self._held = ""  # the start of what may be a marker, not yet given to either field
        self._space = ""  # the reasoning's trailing whitespace, held where it is dropped
        self._fed = 0  # characters of the answer fed so far
        # Where in the answer the reasoning started (a start marker that opened it, when the
        # answer starts in content) and ended: after its end marker, or at a tool call's.
        self.reasoning_start_at = 0
        self.reasoning_end_at: int | None = None if self.thinking else 0

    @property
    def in_reasoning(self) -> bool:
        return self._state != _CONTENT

    def feed(self, text: str, last: bool = False) -> Split:
        """The reasoning and content that `text`, the answer's next piece, completes; with
        `last`, also what was held back, which the end shows was not a marker after all."""
        split = Split(content=self._prefix)
        self._prefix = ""
        pending = self._held + text
        start = self._fed - len(self._held)  # where `pending` starts in the answer
        self._fed += len(text)
        self._held = ""
        while pending:
            if self._state == _CONTENT:
                split.content += pending
                break
            if self._state == _AT_START:
                stripped = pending.lstrip()
                marker = self.spec.start
                if marker.startswith(stripped) and stripped != marker:
                    self._held = pending  # a start marker may still be arriving
                    break
                if stripped.startswith(marker):
                    start += len(pending) - len(stripped) + len(marker)
                    pending = stripped[len(marker) :]
                self._state = _REASONING
                continue
            at, marker = _first_marker(pending, self._markers)
            if not marker:
                keep = max(_partial_marker_length(pending, m) for m in self._markers)
                self._add(split, pending[: len(pending) - keep])
                self._held = pending[len(pending) - keep :]
                break
            self._add(split, pending[:at])
            # A tool call's marker goes on, as content, to the tool parser.
            cut = at if marker in self.spec.implicit_ends else at + len(marker)
            if marker == self.spec.start and self._state == _BEFORE:
                self._state = _REASONING
                self.reasoning_start_at = start + at
            elif marker != self.spec.start and (
                marker != self.spec.end or self._state == _REASONING
            ):
                if self._state == _BEFORE:
                    self.reasoning_start_at = start + at
                self._state = _CONTENT
                self._space = ""
                self.reasoning_end_at = start + cut
            pending, start = pending[cut:], start + cut
        if last:
            held, self._held = self._held, ""
            if self._state == _BEFORE:
                self.reasoning_end_at = 0  # no reasoning came
            self._add(split, held)
        return split

    def _add(self, split: Split, text: str) -> None:
        """Give `text` to the field the splitter is in."""
        if self._state in (_CONTENT, _BEFORE):
            split.content += text
        elif not self.spec.strip_trailing_space:
            split.reasoning += text
        else:
            text = self._space + text
            kept = text.rstrip()
            self._space = text[len(kept) :]
            split.reasoning += kept


def split_whole(splitter: ReasoningSplitter, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole answer fed to a new `splitter` (which then knows
    where the reasoning ended); None for a field the answer has nothing for (content is
    null until the reasoning ends, as in vLLM; an empty reasoning too, for the parsers
    whose vLLM parser nulls it)."""
    split = splitter.feed(text, last=True)
    reasoning = split.reasoning if splitter.thinking else None
    if splitter.spec.null_empty_reasoning and not reasoning:
        reasoning = None
    return reasoning, split.content or None


def count_reasoning_tokens(
    splitter: ReasoningSplitter, token_ids: Sequence[int], decode: Callable[[list[int]], str]
) -> int:
    """How many of a whole answer's tokens (already fed to `splitter`) its reasoning took,
    its markers included: the tokens from the shortest run whose text reaches the
    reasoning's start to the shortest that reaches its end, found by bisection on the
    decoded prefixes."""
    end = splitter.reasoning_end_at
    if end == 0:
        return 0
    lengths = _LazyPrefixLengths(token_ids, decode)
    ends = len(token_ids) if end is None else _tokens_to(lengths, end)
    return ends - _tokens_to(lengths, splitter.reasoning_start_at)


def _tokens_to(lengths: _LazyPrefixLengths, at: int) -> int:
    """The fewest tokens whose text reaches character `at` of the answer."""
    if at == 0:
        return 0
    return bisect.bisect_left(lengths, at, lo=1, hi=len(lengths) - 1)


class _LazyPrefixLengths:
    """len(decode(token_ids[:k])) for k, computed when bisection asks for it."""

    def __init__(self, token_ids: Sequence[int], decode: Callable[[list[int]], str]) -> None:
        self._ids = list(token_ids)
        self._decode = decode

    def __len__(self) -> int:
        return len(self._ids) + 1

    def __getitem__(self, k: int) -> int:
        return len(self._decode(self._ids[:k]))


def _first_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """The first of `markers` in `text` and where it starts; (-1, "") when none is there."""
    found = [(text.find(m), m) for m in markers if m in text]
    return min(found) if found else (-1, "")


def _partial_marker_length(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
