"""Reasoning parsers (--reasoning-parser): a chat answer's `<think>…</think>` part goes to
the message's `reasoning` field, the rest to `content`, streamed or not.

Both parsers vLLM 0.32 names here split on the text, not on token ids, so the split is the
same whatever the token boundaries (a marker cut across tokens, or across stream chunks,
is held back until it is whole) and a marker never reaches either field:

- deepseek_r1: the answer starts in reasoning (the chat template opens the `<think>`; a
  leading `<think>` in the output is dropped); `</think>` ends it, and what follows is
  content. An answer that never closes its reasoning is all reasoning, content null.
- qwen3: the same, unless the request's chat_template_kwargs set `enable_thinking` false:
  then the model does not think, and the answer is all content.

Whitespace around the markers is kept, as vLLM keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass

REASONING_PARSERS = ("deepseek_r1", "qwen3")
THINK_START = "<think>"
THINK_END = "</think>"

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


def reasoning_closed(prompt: str) -> bool:
    """Whether a rendered prompt ends its reasoning itself (its last `<think>` is closed),
    as vLLM's parsers check the prompt: the answer then starts with content."""
    return prompt.rfind(THINK_END) > prompt.rfind(THINK_START)


class ReasoningSplitter:
    """Splits one answer's text, fed in pieces, into reasoning and content."""

    def __init__(self, parser: str, chat_template_kwargs: dict | None = None) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}")
        self.thinking = thinks(parser, chat_template_kwargs)
        self._state = _AT_START if self.thinking else _CONTENT
        self._held = ""  # the start of what may be a marker, not yet given to either field

    def feed(self, text: str, last: bool = False) -> Split:
        """The reasoning and content that `text`, the answer's next piece, completes; with
        `last`, also what was held back, which the end shows was not a marker after all."""
        split = Split()
        pending = self._held + text
        self._held = ""
        while pending:
            if self._state == _CONTENT:
                split.content += pending
                break
            if self._state == _AT_START:
                stripped = pending.lstrip()
                if THINK_START.startswith(stripped):  # a start marker still arriving
                    self._held = pending
                    break
                if stripped.startswith(THINK_START):
                    pending = stripped[len(THINK_START) :]
                self._state = _REASONING
                continue
            end = pending.find(THINK_END)
            if end >= 0:
                split.reasoning += pending[:end]
                pending = pending[end + len(THINK_END) :]
                self._state = _CONTENT
                continue
            keep = _partial_marker_length(pending, THINK_END)
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


def split_answer(
    parser: str, text: str, chat_template_kwargs: dict | None = None
) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole answer; None for a field the answer has nothing for
    (content is null until the reasoning ends, as in vLLM)."""
    splitter = ReasoningSplitter(parser, chat_template_kwargs)
    split = splitter.feed(text, last=True)
    return (split.reasoning if splitter.thinking else None), (split.content or None)


def _partial_marker_length(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
