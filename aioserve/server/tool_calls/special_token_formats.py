"""Tool-call formats framed by a model's special tokens (kept in the text for them).

- `internlm` (InternLM2): content, then `<|action_start|><|plugin|>` and one JSON object
  `{"name": ..., "parameters" (or "arguments"): {...}}`, up to `<|action_end|>`; one call
  per output, the text after it dropped; the arguments re-serialised, `{}` when absent
  (vllm/tool_parsers/internlm2_tool_parser.py).
- `deepseek_v3` (DeepSeek-V3): content, then `<｜tool▁calls▁begin｜>` and per call
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGUMENTS\\n```<｜tool▁call▁end｜>`,
  then `<｜tool▁calls▁end｜>`; the arguments are the model's text, on one line, passed on
  unchecked as vLLM's pattern takes them; text after the calls is content only when
  streamed (vllm/tool_parsers/deepseekv3_tool_parser.py).
"""

from __future__ import annotations

from aioserve.server.tool_calls.parsers import (
    CallSoFar,
    ParsedOutput,
    ToolParser,
    call_from_object,
    canonical_prefix,
    content_until,
    held_back,
    register_tool_parser,
    skip_whitespace,
)


@register_tool_parser("internlm")
class InternLMParser(ToolParser):
    name = "internlm"
    skip_special_tokens = False
    start, end = "<|action_start|><|plugin|>", "<|action_end|>"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        content, start = content_until(text, self.start, final)
        parsed = ParsedOutput(content)
        if start < 0:
            return parsed
        if text.count(self.start) > 1:
            raise ValueError("InternLM makes one call per output")
        pos = text.find("{", start + len(self.start))
        if pos < 0:
            if final:
                raise ValueError("no call object after the plugin marker")
            return parsed
        call, end = call_from_object(text, pos, ("parameters", "arguments"), "{}")
        if end is not None:
            rest = text[end:].lstrip()
            if not rest.startswith(self.end) and (final or not self.end.startswith(rest)):
                raise ValueError("text after the call object")
        call.arguments = canonical_prefix(call.arguments, call.complete)
        parsed.calls = [call]
        return parsed


@register_tool_parser("deepseek_v3")
class DeepSeekV3Parser(ToolParser):
    name = "deepseek_v3"
    structural_form = "deepseek_r1"
    skip_special_tokens = False
    json_arguments = False
    calls_begin, calls_end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    call_begin, separator = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>"
    arguments_open, arguments_close = "```json\n", "\n```<｜tool▁call▁end｜>"

    def read_whole(self, text: str) -> ParsedOutput:
        parsed = self.read(text, final=True)
        if parsed.has_calls:
            parsed.content = text[: text.find(self.calls_begin)]
        return parsed

    def parse(self, text: str, final: bool) -> ParsedOutput:
        content, start = content_until(text, self.calls_begin, final)
        parsed = ParsedOutput(content)
        pos = start + len(self.calls_begin)
        while start >= 0:
            pos = skip_whitespace(text, pos)
            if text.startswith(self.calls_end, pos):
                parsed.content += text[pos + len(self.calls_end) :]
                break
            rest = text[pos:]
            if not rest or self.calls_end.startswith(rest) or self.call_begin.startswith(rest):
                break
            if not rest.startswith(self.call_begin):
                raise ValueError("expected a call or the end of the calls")
            call, pos = self._call(text, pos + len(self.call_begin))
            if call is not None:
                parsed.calls.append(call)
            if pos < 0:
                break
        return parsed

    def _call(self, text: str, pos: int) -> tuple[CallSoFar | None, int]:
        """The call whose head starts at `pos` (None until its name is whole), and the
        index after it (-1 while it is unfinished)."""
        line_end = text.find("\n", pos)
        head = text[pos : line_end if line_end >= 0 else len(text)]
        if line_end < 0:
            return None, -1
        if self.separator not in head:
            raise ValueError("a call's head is TYPE<｜tool▁sep｜>NAME")
        name = head[head.rindex(self.separator) + len(self.separator) :]
        opened = line_end + 1
        if not text.startswith(self.arguments_open, opened):
            if self.arguments_open.startswith(text[opened:]):
                return CallSoFar(name, ""), -1
            raise ValueError("a call's arguments open with ```json")
        value = opened + len(self.arguments_open)
        close = text.find(self.arguments_close, value)
        arguments = text[value : close if close >= 0 else len(text)]
        if close < 0:
            arguments = arguments[: len(arguments) - held_back(arguments, self.arguments_close)]
        if "\n" in arguments:
            raise ValueError("a call's arguments are one line")
        if close < 0:
            return CallSoFar(name, arguments), -1
        return CallSoFar(name, arguments, complete=True), close + len(self.arguments_close)
