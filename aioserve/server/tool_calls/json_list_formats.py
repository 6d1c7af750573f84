"""Tool-call formats whose calls are a JSON list of `{"name", "arguments"}` objects.

- `granite` (IBM Granite 3.x): `<|tool_call|>` (3.0, a special token) or `<tool_call>`
  (3.1, text), then the list; no closing marker, the list's `]` ends it. The arguments
  are the model's own text of each `arguments` object; text before the marker (and, when
  streamed, after the list) is content; a whole output keeps only the text before the
  marker, stripped, as vLLM's parser engine does (vllm/parser/granite.py).
- `phi4_mini_json` (Phi-4-mini): `functools[...]`; the arguments (or parameters)
  re-serialised; a whole output with calls has no content
  (vllm/tool_parsers/phi4mini_tool_parser.py).
- `xlam` (Salesforce xLAM): the list as the whole output, after `</think>`, in a ```json
  fence, after `[TOOL_CALLS]` (up to the line's end) or inside `<tool_call>...</tool_call>`;
  the content is the output without the block, stripped; object arguments re-serialised,
  string ones kept (vllm/tool_parsers/xlam_tool_parser.py).
"""

from __future__ import annotations

import json
import re

from aioserve.server.tool_calls.parsers import (
    CallSoFar,
    ParsedOutput,
    ToolParser,
    calls_in_array,
    canonical_prefix,
    content_until,
    register_tool_parser,
    reserialised,
    skip_whitespace,
)
from aioserve.server.tool_calls.partial_json import value_end


@register_tool_parser("granite")
class GraniteParser(ToolParser):
    name = "granite"
    skip_special_tokens = False
    markers = ("<|tool_call|>", "<tool_call>")

    def read_whole(self, text: str) -> ParsedOutput:
        parsed = self.read(text, final=True)
        if parsed.has_calls:
            parsed.content = content_until(text, self.markers, True)[0].strip()
        return parsed

    def parse(self, text: str, final: bool) -> ParsedOutput:
        content, start = content_until(text, self.markers, final)
        parsed = ParsedOutput(content)
        if start < 0:
            return parsed
        marker = next(marker for marker in self.markers if text.startswith(marker, start))
        pos = skip_whitespace(text, start + len(marker))
        if pos < len(text):
            if text[pos] != "[":
                raise ValueError("granite's calls are a JSON list")
            parsed.calls = calls_in_array(text, pos, ("arguments",), missing_arguments="{}")
            if any(call.complete and not call.arguments.startswith("{") for call in parsed.calls):
                raise ValueError("a granite call's arguments are a JSON object")
            end = value_end(text, pos)
            if end is not None:
                if not parsed.calls:
                    raise ValueError("a granite list of no calls")
                parsed.content += text[end:]
        if final and not parsed.has_calls:
            return ParsedOutput(text)
        return parsed


@register_tool_parser("phi4_mini_json")
class Phi4MiniJsonParser(ToolParser):
    name = "phi4_mini_json"
    marker = "functools["

    def read_whole(self, text: str) -> ParsedOutput:
        parsed = self.read(text, final=True)
        if parsed.has_calls:
            parsed.content = ""  # vLLM drops the text around the list
        return parsed

    def parse(self, text: str, final: bool) -> ParsedOutput:
        content, start = content_until(text, self.marker, final)
        parsed = ParsedOutput(content)
        if start < 0:
            return parsed
        pos = start + len(self.marker) - 1
        if final and value_end(text, pos) is None:
            raise ValueError("the list of calls is not closed")
        parsed.calls = calls_in_array(text, pos, ("arguments", "parameters"))
        for call in parsed.calls:
            call.arguments = canonical_prefix(call.arguments, call.complete)
        return parsed


_XLAM_BLOCKS = (
    re.compile(r"```(?:json)?\s*([\s\S]*?)```"),
    re.compile(r"\[TOOL_CALLS\]([\s\S]*?)(?=\n|$)"),
    re.compile(r"<tool_call>([\s\S]*?)</tool_call>"),
)
_THINK_END = "</think>"


@register_tool_parser("xlam")
class XlamParser(ToolParser):
    """Streamed, a block opens at one of `openers` (or a `[` that starts the output or
    follows `</think>`) and its list is read as it grows; the text after its closer is
    content again."""

    name = "xlam"
    openers = {"```": "```", "[TOOL_CALLS]": "\n", "<tool_call>": "</tool_call>"}

    def read_whole(self, text: str) -> ParsedOutput:
        content, calls_text = _xlam_block(text)
        try:
            value = json.loads(calls_text) if calls_text is not None else None
        except ValueError:
            return ParsedOutput(text)
        if not isinstance(value, list):
            return ParsedOutput(text)
        calls = []
        for item in value:
            if not (isinstance(item, dict) and "name" in item and "arguments" in item):
                continue  # vLLM skips an item that is not a call
            name, arguments = item["name"], item["arguments"]
            if isinstance(arguments, dict):
                arguments = reserialised(arguments)
            if not (isinstance(name, str) and isinstance(arguments, str)):
                return ParsedOutput(text)
            calls.append(CallSoFar(name, arguments, complete=True))
        return ParsedOutput(content or "", calls) if calls else ParsedOutput(text)

    def parse(self, text: str, final: bool) -> ParsedOutput:
        parsed = self._parse(text, final)
        if final and not parsed.has_calls:
            return ParsedOutput(text)  # a list of no call, or a block held back, is content
        return parsed

    def _parse(self, text: str, final: bool) -> ParsedOutput:
        list_start = self._leading_list(text, final)
        if list_start is None:
            return ParsedOutput("")  # could still become a list of calls
        if list_start >= 0:
            parsed = ParsedOutput(text[:list_start], self._calls(text, list_start))
            end = value_end(text, list_start)
            if final and (end is None or text[end:].strip()):
                raise ValueError("a bare list of calls must be the whole output")
            return parsed
        content, start = content_until(text, tuple(self.openers), final)
        parsed = ParsedOutput(content)
        if start < 0:
            return parsed
        opener = next(opener for opener in self.openers if text.startswith(opener, start))
        pos = skip_whitespace(text, start + len(opener))
        if opener == "```" and text.startswith("json", pos):
            pos = skip_whitespace(text, pos + len("json"))
        if pos >= len(text) or "json".startswith(text[pos:]):
            return parsed
        if text[pos] != "[":
            raise ValueError("an xlam block holds a JSON list")
        parsed.calls = self._calls(text, pos)
        end = value_end(text, pos)
        if end is None:
            if final:
                raise ValueError("an xlam block's list is not closed")
            return parsed
        closer = self.openers[opener]
        after = end if closer == "\n" else skip_whitespace(text, end)
        if after == len(text) and (closer == "\n" or not final):
            return parsed
        if text.startswith(closer, after):
            # The line's end after [TOOL_CALLS] is content, as vLLM's pattern leaves it.
            parsed.content += text[after if closer == "\n" else after + len(closer) :]
        elif final or not closer.startswith(text[after:]):
            raise ValueError("text between an xlam block's list and its end")
        return parsed

    def _leading_list(self, text: str, final: bool) -> int | None:
        """Where the list that starts the output (or follows `</think>`) starts; -1 if
        there is none; None while the text so far could still become one."""
        think = text.find(_THINK_END)
        pos = skip_whitespace(text, think + len(_THINK_END) if think >= 0 else 0)
        if pos >= len(text):
            return -1 if final else None
        if text[pos] != "[" or "[TOOL_CALLS]".startswith(text[pos : pos + 12]):
            return -1
        return pos

    def _calls(self, text: str, pos: int) -> list[CallSoFar]:
        calls = calls_in_array(text, pos, ("arguments",))
        for call in calls:
            call.arguments = canonical_prefix(call.arguments, call.complete)
        return calls


def _xlam_block(text: str) -> tuple[str | None, str | None]:
    """(content, the JSON text of the calls or None), as vLLM's
    xLAMToolParser.preprocess_model_output finds them."""
    think = text.find(_THINK_END)
    if think >= 0:
        content = text[: think + len(_THINK_END)].strip()
        after = text[think + len(_THINK_END) :].strip()
        if _is_json(after):
            return content, after
        for pattern in _XLAM_BLOCKS:
            for found in pattern.findall(after):
                if _is_json(found):
                    return content, found
    for pattern in _XLAM_BLOCKS:
        for found in pattern.findall(text):
            if _is_json(found):
                return pattern.sub("", text).strip(), found
    if text.strip().startswith("[") and _is_json(text):
        return None, text
    return text, None


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
