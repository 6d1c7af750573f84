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
    boundary); some look for an end marker anywhere in the prompt (step3, olmo3), and some
    never see the prompt's reasoning closed (granite, hunyuan_a13b)."""
    spec = _spec(parser)
    if spec.prompt_rule == "never":
        return False
    if spec.turn_boundaries:
        marks = [mark for mark in spec.turn_boundaries if mark in prompt]
        prompt = prompt[max((prompt.rfind(mark) + len(mark) for mark in marks), default=0) :]
    last_end = max(prompt.rfind(marker) for marker in spec.ends)
    if spec.prompt_rule == "any_end":
        return last_end >= 0
    return last_end > max((prompt.rfind(marker) for marker in spec.starts), default=-1)


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
        elif spec.start_opens_only or spec.space_before_start_dropped:
            self._state = _AT_START
        else:
            self._state = _BEFORE if spec.opens_in_content else _REASONING
        # The markers looked for before the reasoning opens (an end marker there is
        # dropped, unless the spec keeps it as text), and in the reasoning (a start marker
        # there is dropped, unless the spec keeps it as text).
        starts = () if spec.start_opens_only else spec.starts
        stray_ends = () if spec.end_before_reasoning_is_text else spec.ends
        self._before_markers = (*starts, *stray_ends, *spec.implicit_ends)
        if spec.start_kept_in_reasoning:
            starts = ()
        self._reasoning_markers = (*starts, *spec.ends, *spec.implicit_ends)
        self._prefix = spec.content_prefix
        self._reasoning_as_content = bool(
            spec.reasoning_as_content and spec.reasoning_as_content(chat_template_kwargs or {})
        )
        self._reasoning = ""  # the reasoning given so far, where it may be given as content
        self._held = ""  # the start of what may be a marker, not yet given to either field
        self._space = ""  # the reasoning's trailing whitespace, held where it is dropped
        self._fed = 0  # characters of the answer fed so far
        # Where in the answer the reasoning started (a start marker that opened it, when the
        # answer starts in content) and ended: after its end marker, or at a tool call's.
        self.reasoning_start_at = 0
        self.reasoning_end_at: int | None = None if self.thinking else 0
        self.opened = self._state == _REASONING  # whether a reasoning began

    @property
    def in_reasoning(self) -> bool:
        return self._state != _CONTENT

    def feed(self, text: str, last: bool = False, *, whole: bool = False) -> Split:
        """The reasoning and content that `text`, the answer's next piece, completes; with
        `last`, also what was held back, which the end shows was not a marker after all.
        `whole` (split_whole's) says the answer is not streamed."""
        split = Split(content=self._prefix)
        self._prefix = ""
        pending = self._held + text
        start = self._fed - len(self._held)  # where `pending` starts in the answer
        self._fed += len(text)
        self._held = ""
        while pending or (last and self._state == _AT_START):
            if self._state == _CONTENT:
                split.content += pending
                break
            if self._state == _AT_START:
                stripped = pending.lstrip() if self.spec.space_before_start_dropped else pending
                if not last and any(
                    m.startswith(stripped) and m != stripped for m in self.spec.starts
                ):
                    self._held = pending  # a start marker may still be arriving
                    break
                marker = _longest_prefix(stripped, self.spec.starts)
                if marker:
                    skipped = len(pending) - len(stripped)
                    self.reasoning_start_at = start + skipped
                    start += skipped + len(marker)
                    pending = stripped[len(marker) :]
                    self._state, self.opened = _REASONING, True
                elif not self.spec.opens_in_content:
                    self._state, self.opened = _REASONING, True
                elif self.spec.start_opens_only:
                    self._state, self.reasoning_end_at = _CONTENT, 0  # no reasoning comes
                else:
                    self._state = _BEFORE
                continue
            markers = self._before_markers if self._state == _BEFORE else self._reasoning_markers
            at, marker = _first_marker(pending, markers)
            if marker and not last and _may_grow(pending[at:], markers):
                self._add(split, pending[:at])
                self._held = pending[at:]  # a longer marker may still be arriving
                break
            if not marker:
                keep = max(_partial_marker_length(pending, m) for m in markers)
                self._add(split, pending[: len(pending) - keep])
                self._held = pending[len(pending) - keep :]
                break
            self._add(split, pending[:at])
            # A tool call's marker goes on, as content, to the tool parser.
            cut = at if marker in self.spec.implicit_ends else at + len(marker)
            if marker in self.spec.starts and self._state == _BEFORE:
                self._state, self.opened = _REASONING, True
                self.reasoning_start_at = start + at
            elif marker not in self.spec.starts and (
                marker not in self.spec.ends or self._state == _REASONING
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
            if self._reasoning_as_content and self.reasoning_end_at is None and not whole:
                # The reasoning again, as content, with the trailing whitespace it dropped.
                split.content += self._reasoning + split.reasoning + self._space
        if self._reasoning_as_content:
            self._reasoning += split.reasoning
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
    whose vLLM parser nulls it). The parsers whose vLLM parser splits a whole answer
    otherwise than a stream (engine/reasoning_parsers.py) do so here too."""
    spec = splitter.spec
    split = splitter.feed(text, last=True, whole=True)
    reasoning: str | None = split.reasoning if splitter.opened else None
    content = split.content
    if splitter.reasoning_end_at is None and spec.unclosed_whole_is_content:
        splitter.reasoning_end_at = 0  # none of it counts as reasoning
        reasoning, content = None, text
    if spec.answer_wrapper and content:
        opening, closing = spec.answer_wrapper
        begins, ends = content.find(opening), content.rfind(closing)
        if 0 <= begins < ends:
            content = content[begins + len(opening) : ends]
    if spec.answer_end and spec.answer_end in content:
        content = content[: content.index(spec.answer_end)]
    if spec.null_empty_reasoning and not reasoning:
        reasoning = None
    if splitter._reasoning_as_content and not content.strip():
        # (vLLM's empty content is null, but the answer as written where it does not think.)
        swapped = content if content or not splitter.thinking else None
        reasoning, content = swapped, reasoning or ""
    return reasoning, content or None


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
    """The first of `markers` in `text` (the longest of those that start there) and where
    it starts; (-1, "") when none is there."""
    found = [(text.find(m), -len(m), m) for m in markers if m in text]
    if not found:
        return -1, ""
    at, _, marker = min(found)
    return at, marker


def _longest_prefix(text: str, markers: tuple[str, ...]) -> str:
    """The longest of `markers` that `text` starts with; "" when none."""
    return max((m for m in markers if text.startswith(m)), key=len, default="")


def _may_grow(text: str, markers: tuple[str, ...]) -> bool:
    """Whether `text`, which starts with a whole marker, may be the start of a longer one."""
    return any(len(m) > len(text) and m.startswith(text) for m in markers)


def _partial_marker_length(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
