"""Stop strings: end a request when its output text contains one of the `stop` strings.

The output processor feeds each piece of text the detokenizer emits to
`StopStringMatcher.process`, which returns the part that is safe to send to the client now
and, once a stop string has appeared, which one. Matching runs across piece boundaries: each
call searches the new piece together with the last `longest - 1` characters before it
(`longest` being the longest stop string's length), so a call costs O(longest + piece).

Semantics (vLLM's, which are the specification):

- The output ends right before the stop string, or right after it with
  `include_stop_str_in_output`; nothing after it is ever emitted.
- Without `include_stop_str_in_output` the last `longest - 1` characters are held back while
  streaming, since they could be the start of a stop string, and `flush()` releases them when
  the request ends for another reason (length, EOS). With it nothing is held back (as vLLM
  v1): a partial stop string in the output is harmless because the whole one would be kept.
- When several stop strings occur, the one that is complete first in the text wins (the
  moment the text contains a stop string, the request stops); among several that end at the
  same character, the one that starts first (the longest). This depends only on the text,
  not on how it was split into pieces. vLLM instead takes the first in list order among
  those found in a step's new text, which can depend on how many tokens a step produced.
- Empty strings in `stop` are ignored (they would match before any output).
- Text produced before `min_tokens` are out is not searched (`emit_unchecked`), but it is
  held back as any other, and its end stays in view: a stop string that starts there and
  ends in checked text still stops the request and cuts the output at its start, as
  vLLM's look-back does; none of it was emitted.
"""

from __future__ import annotations


class StopStringMatcher:
    """Finds the first stop string in a stream of text pieces and trims the output to it."""

    def __init__(self, stop: list[str], include_stop_str_in_output: bool) -> None:
        self._stop = [s for s in dict.fromkeys(stop) if s]
        self._include = include_stop_str_in_output
        # A stop string not yet complete can only have started in the last `context` chars.
        self._context = max((len(s) for s in self._stop), default=1) - 1
        # The last `context` characters fed in. The first `_sent` of them were emitted
        # already (all of them with include_stop_str_in_output); the rest are held back.
        self._tail = ""
        self._sent = 0
        self._stopped = False

    def emit_unchecked(self, new_text: str) -> str:
        """Take text that may not stop the request (before min_tokens): returns the part
        safe to emit now, holding back its end as `process` does."""
        if not self._stop or self._stopped:
            return new_text
        return self._hold_back(self._tail + new_text, new_text)

    def process(self, new_text: str) -> tuple[str, str | None]:
        """Feed the detokenizer's newest piece.

        Returns the text safe to emit now and the stop string this piece completed (None
        while no stop string has appeared). After a match every call returns ("", None).
        """
        if self._stopped or not new_text:
            return "", None
        if not self._stop:
            return new_text, None
        text = self._tail + new_text
        first_unsent = self._sent
        match = self._first_match(text, len(self._tail))
        if match is not None:
            start, stop_str = match
            end = start + len(stop_str) if self._include else start
            self._stopped = True
            self._tail, self._sent = "", 0
            return text[first_unsent:end], stop_str  # empty if it ends in sent text
        return self._hold_back(text, new_text), None

    def _hold_back(self, text: str, new_text: str) -> str:
        """Keep the last `context` characters of `text` (the tail and `new_text`) as the
        tail; return what may be emitted now: all of `new_text` with
        include_stop_str_in_output, else the unsent text before the new tail."""
        first_unsent = self._sent
        self._tail = text[-self._context :] if self._context else ""
        if self._include:
            self._sent = len(self._tail)
            return new_text
        safe_end = len(text) - len(self._tail)
        self._sent = max(0, first_unsent - safe_end)
        return text[first_unsent:safe_end]

    def flush(self) -> str:
        """The held-back text, at the end of a request that no stop string ended."""
        held = self._tail[self._sent :]
        self._tail, self._sent = "", 0
        return held

    def _first_match(self, text: str, new_from: int) -> tuple[int, str] | None:
        """(start, stop string) of the occurrence that ends first, the longest on a tie.

        Only occurrences that end in the new text (at or after `new_from`) count: one wholly
        inside the tail was either seen already or came before min_tokens.
        """
        found = []
        for stop_str in self._stop:
            start = text.find(stop_str, max(0, new_from - len(stop_str) + 1))
            if start >= 0:
                found.append((start + len(stop_str), start, stop_str))
        if not found:
            return None
        _, start, stop_str = min(found)
        return start, stop_str
