"""One choice's output as it streams: content deltas and OpenAI `tool_calls` deltas.

`ToolCallStream.feed` takes each new piece of text and reads the whole output so far with
the request's parser (parsers.py); what it returns is what is new since the last feed: the
content, and for each call its first delta (index, id, type, the name once, and the
arguments so far) or the next piece of its arguments. A call is announced only once its
name is complete, and calls are announced in order. With `parallel_tool_calls: false`
only the first call is sent, as vLLM filters it (maybe_filter_parallel_tool_calls).
"""

from __future__ import annotations

from typing import Any

from aioserve.server.tool_calls.parsers import ParsedOutput, ToolParser


def tool_call_objects(
    parsed: ParsedOutput, parser: ToolParser, single_call: bool = False
) -> list[dict[str, Any]]:
    """The calls of a finished output as a message's `tool_calls` (the first only with
    `single_call`)."""
    calls = parsed.calls[:1] if single_call else parsed.calls
    return [
        {
            "id": parser.new_call_id(),
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for call in calls
    ]


class ToolCallStream:
    def __init__(self, parser: ToolParser, single_call: bool = False) -> None:
        self.parser = parser
        self.single_call = single_call
        self.text = ""
        self.made_calls = False  # a call was sent (it stays made if its end fails to parse)
        self._content_sent = 0
        self._arguments_sent: list[int] = []

    def feed(self, piece: str, last: bool) -> tuple[str | None, list[dict[str, Any]] | None]:
        """(new content or None, new tool_calls deltas or None)."""
        self.text += piece
        parsed = self.parser.read(self.text, last)
        if last and self._arguments_sent and not parsed.has_calls:
            # A call already streamed turned out unfinished or not JSON (cut by max_tokens,
            # say): its text is not sent again as content.
            return None, None
        content = parsed.content[self._content_sent :] or None
        self._content_sent = max(self._content_sent, len(parsed.content))
        deltas = []
        for index, call in enumerate(parsed.calls):
            if call.name is None:
                break
            if index == len(self._arguments_sent):
                self._arguments_sent.append(len(call.arguments))
                self.made_calls = True
                deltas.append(
                    {
                        "index": index,
                        "id": self.parser.new_call_id(),
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                )
                continue
            new = call.arguments[self._arguments_sent[index] :]
            if new:
                self._arguments_sent[index] = len(call.arguments)
                deltas.append({"index": index, "function": {"arguments": new}})
        if self.single_call:
            deltas = [delta for delta in deltas if delta["index"] == 0]
        return content, deltas or None
