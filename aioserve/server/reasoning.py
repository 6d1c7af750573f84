"""Reasoning parsers (--reasoning-parser): a chat answer's `<think>…</think>` part goes to
the message's `reasoning` field, the rest to `content`, streamed or not.

Both parsers vLLM 0.32 names here split on the text, not on token ids, so the split is the
same whatever the token boundaries (a marker cut across tokens, or across stream chunks,
is held back until it is whole) and a marker never reaches either field:

- deepseek_r1: the answer starts in reasoning (the chat template opens the `<think>`);
  `</think>` ends it, and what follows is content. A `<think>` inside the reasoning is
  dropped. An answer that never closes its reasoning is all reasoning, content null.
- qwen3: the same, unless the request's chat_template_kwargs set `enable_thinking` false:
  then the model does not think, and the answer is all content. A `<tool_call>` also ends
  the reasoning (the call then goes to the tool parser), and an empty reasoning is null.

Where the rendered prompt already closed the reasoning (its last think marker is
`</think>`; for qwen3, within the last ChatML turn), the answer is all content, as vLLM's
streaming sees it; aioserve splits a whole answer the same way, so that streamed and
not-streamed answers agree. Whitespace around the markers is kept, as vLLM keeps it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

REASONING_PARSERS = ("deepseek_r1", "qwen3")
THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"
_CHATML_TURN_BOUNDARIES = ("<|im_start|>", "<|im_end|>")

_AT_START, _REASONING, _CONTENT = range(3)


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""


def thinks(parser: str, chat_template_kwargs: dict | None) -> bool:
    """Whether an answer starts with reasoning under `parser` ("": no parser)."""
    if not parser:
        return False
    return parser != "qwen3" or bool((chat_template_kwargs or {}).get("enable_thinking", True))


def reasoning_closed(parser: str, prompt: str) -> bool:
    """Whether a rendered prompt ends its reasoning itself (its last `<think>` is closed),
    as vLLM's parsers check the prompt: the answer then starts with content. qwen3 looks
    at the last turn only (vLLM stops at a ChatML turn boundary); deepseek_r1 at it all."""
    if parser == "qwen3":
        turn_start = max(prompt.rfind(mark) + len(mark) for mark in _CHATML_TURN_BOUNDARIES)
        prompt = prompt[max(turn_start, 0) :]
    return prompt.rfind(THINK_END) > prompt.rfind(THINK_START)


class ReasoningSplitter:
    """Splits one answer's text, fed in pieces, into reasoning and content."""

    def __init__(
        self, parser: str, chat_template_kwargs: dict | None = None, prompt_closed: bool = False
    ) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}")
        self.parser = parser
        self.thinking = thinks(parser, chat_template_kwargs) and not prompt_closed
        self._ends = (THINK_END, TOOL_CALL_START) if parser == "qwen3" else (THINK_END,)
        self._state = _AT_START if self.thinking else _CONTENT
        self._held = ""  # the start of what may be a marker, not yet given to either field
        self._fed = 0  # characters of the answer fed so far
        # Where in the answer the reasoning ended: after its `</think>`, or at a `<tool_call>`.
        self.reasoning_end_at: int | None = None if self.thinking else 0

    @property
    def in_reasoning(self) -> bool:
        return self._state != _CONTENT

    def feed(self, text: str, last: bool = False) -> Split:
        """The reasoning and content that `text`, the answer's next piece, completes; with
        `last`, also what was held back, which the end shows was not a marker after all."""
        split = Split()
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
                if THINK_START.startswith(stripped) and stripped != THINK_START:
                    self._held = pending  # a start marker may still be arriving
                    break
                if stripped.startswith(THINK_START):
                    start += len(pending) - len(stripped) + len(THINK_START)
                    pending = stripped[len(THINK_START) :]
                self._state = _REASONING
                continue
            at, marker = _first_marker(pending, (THINK_START, *self._ends))
            if marker:
                split.reasoning += pending[:at]
                if marker == TOOL_CALL_START:  # the call itself goes on to the tool parser
                    cut = at
                else:
                    cut = at + len(marker)
                if marker != THINK_START:
                    self._state = _CONTENT
                    self.reasoning_end_at = start + cut
                pending, start = pending[cut:], start + cut
                continue
            keep = max(_partial_marker_length(pending, m) for m in (THINK_START, *self._ends))
            split.reasoning += pending[: len(pending) - keep]
            self._held = pending[len(pending) - keep :]
            break
        if last:
            held, self._held = self._held, ""
            if self._state == _CONTENT:
                split.content += held
            else:
                split.reasoning += held
        return split


def split_whole(splitter: ReasoningSplitter, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole answer fed to a new `splitter` (which then knows
    where the reasoning ended); None for a field the answer has nothing for (content is
    null until the reasoning ends, as in vLLM; qwen3's empty reasoning too)."""
    split = splitter.feed(text, last=True)
    reasoning = split.reasoning if splitter.thinking else None
    if splitter.parser == "qwen3" and not reasoning:
        reasoning = None
    return reasoning, split.content or None


def count_reasoning_tokens(
    splitter: ReasoningSplitter, token_ids: Sequence[int], decode: Callable[[list[int]], str]
) -> int:
    """How many of a whole answer's tokens (already fed to `splitter`) its reasoning took,
    the marker that ends it included: the shortest run of tokens whose text reaches the
    reasoning's end, found by bisection on the decoded prefixes."""
    end = splitter.reasoning_end_at
    if end is None:
        return len(token_ids)
    if end == 0:
        return 0
    lengths = _LazyPrefixLengths(token_ids, decode)
    return bisect.bisect_left(lengths, end, lo=1, hi=len(token_ids))


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
