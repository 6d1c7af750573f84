"""One choice's output as it streams: content deltas and OpenAI `tool_calls` deltas.

`ToolCallStream.feed` takes each new piece of text and reads the whole output so far with
the request's parser (parsers.py); what it returns is what is new since the last feed: the
content, and for each call its first delta (index, id, type, the name once, and the
arguments so far) or the next piece of its arguments. A call is announced only once its
name is complete, and calls are announced in order.
"""

from __future__ import annotations

import uuid
from typing import Any

from aioserve.server.tool_calls.parsers import ParsedOutput, ToolParser


def new_tool_call_id() -> str:
    """vLLM's form of a tool call's id."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_call_objects(parsed: ParsedOutput) -> list[dict[str, Any]]:
    """The calls of a finished output as a message's `tool_calls`."""
    return [
        {
            "id": new_tool_call_id(),
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for call in parsed.calls
    ]


class ToolCallStream:
    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.made_calls = False
        self._content_sent = 0
        self._arguments_sent: list[int] = []

    def feed(self, piece: str, last: bool) -> tuple[str | None, list[dict[str, Any]] | None]:
        """(new content or None, new tool_calls deltas or None)."""
        self.text += piece
        parsed = self.parser.read(self.text, last)
        if last and self._arguments_sent and not parsed.has_calls:
            # A call already streamed turned out unfinished or not JSON (cut by max_tokens,
            # say): its text is not sent again as content, and no call was made.
            self.made_calls = False
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
                        "id": new_tool_call_id(),
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                )
                continue
            new = call.arguments[self._arguments_sent[index] :]
            if new:
                self._arguments_sent[index] = len(call.arguments)
                deltas.append({"index": index, "function": {"arguments": new}})
        return content, deltas or None
