"""The reasoning parsers aioserve implements (--reasoning-parser), as marker specs that
server/reasoning.py's one splitter runs: each is vLLM 0.32's parser of the same name
reduced to the text markers it splits on. Plain data, here in the engine because the
thinking budget (engine/thinking_markers.py) reads the same markers.

- deepseek_r1: `<think>`…`</think>`; the answer starts in reasoning (the chat template
  opened it); whitespace before a leading `<think>` is dropped.
- qwen3: the same, unless chat_template_kwargs set `enable_thinking` false (then all
  content); a `<tool_call>` also ends the reasoning; an empty reasoning is null.
- deepseek_v3: deepseek_r1 when chat_template_kwargs set `thinking` or `enable_thinking`,
  else all content (vLLM's identity parser).
- glm45, kimi_k2: `<think>`…`</think>`, thinking unless `thinking`/`enable_thinking` is
  given and neither is true; GLM's `<tool_call>` or Kimi's `<|tool_calls_section_begin|>`
  ends the reasoning. minimax_m2: the same, ended by `<minimax:tool_call>`, no switch.
  These three drop the reasoning's trailing whitespace, and an empty reasoning is null.
- seed_oss: qwen3 with `<seed:think>`…`</seed:think>` and `<seed:tool_call>`.
- mistral: `[THINK]`…`[/THINK]`; the answer starts in content, and content before the
  `[THINK]` stays content; `[TOOL_CALLS]` ends the reasoning (or ends the wait for one).
- step3: all reasoning until `</think>`; a `<think>` is kept as text.
- minimax_m2_append_think: no split; the content is the answer with `<think>` before it.

Once the reasoning has ended, the rest of the answer is content as written (vLLM's
streaming passes it through; its non-streamed parse drops a stray end marker or, for
glm45 and mistral, opens a second reasoning: aioserve splits whole answers as streamed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"


def _enable_thinking(kwargs: dict) -> bool:
    """qwen3's switch: thinking unless `enable_thinking` is false."""
    return bool(kwargs.get("enable_thinking", True))


def _either_switch(default: bool) -> Callable[[dict], bool]:
    """GLM's, Kimi's and DeepSeek V3's switch: `default` when neither `thinking` nor
    `enable_thinking` is given, else whether either is true."""

    def thinks(kwargs: dict) -> bool:
        thinking, enable = kwargs.get("thinking"), kwargs.get("enable_thinking")
        if thinking is None and enable is None:
            return default
        return bool(thinking) or bool(enable)

    return thinks


@dataclass(frozen=True)
class ParserSpec:
    """How one parser splits an answer."""

    start: str = THINK_START  # dropped where it appears in the reasoning; "" keeps it text
    end: str = THINK_END
    # Markers (tool calls') that end the reasoning and stay in the content, for the tool parser.
    implicit_ends: tuple[str, ...] = ()
    thinks: Callable[[dict], bool] | None = None  # the chat_template_kwargs switch, if any
    opens_in_content: bool = False  # the answer is content until its start marker
    space_before_start_dropped: bool = False  # whitespace before a leading start marker
    strip_trailing_space: bool = False  # the reasoning's trailing whitespace is dropped
    null_empty_reasoning: bool = False  # a whole answer's empty reasoning is null
    content_prefix: str = ""  # put before the content (and no split at all)
    turn_boundaries: tuple[str, ...] = ()  # the prompt's reasoning is read after the last
    budget_markers: bool = True  # whether vLLM's thinking budget knows start and end

    def thinking(self, chat_template_kwargs: dict | None) -> bool:
        """Whether an answer starts with (or waits for) a reasoning."""
        if self.content_prefix:
            return False
        return self.thinks is None or self.thinks(chat_template_kwargs or {})


_CHATML = ("<|im_start|>", "<|im_end|>")
_ENGINE = {"strip_trailing_space": True, "null_empty_reasoning": True}

SPECS: dict[str, ParserSpec] = {
    "deepseek_r1": ParserSpec(space_before_start_dropped=True),
    "qwen3": ParserSpec(
        implicit_ends=("<tool_call>",),
        thinks=_enable_thinking,
        space_before_start_dropped=True,
        null_empty_reasoning=True,
        turn_boundaries=_CHATML,
    ),
    "deepseek_v3": ParserSpec(
        thinks=_either_switch(False), space_before_start_dropped=True, budget_markers=False
    ),
    "glm45": ParserSpec(
        implicit_ends=("<tool_call>",),
        thinks=_either_switch(True),
        turn_boundaries=("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"),
        **_ENGINE,
    ),
    "kimi_k2": ParserSpec(
        implicit_ends=("<|tool_calls_section_begin|>",), thinks=_either_switch(True), **_ENGINE
    ),
    "minimax_m2": ParserSpec(implicit_ends=("<minimax:tool_call>",), **_ENGINE),
    "minimax_m2_append_think": ParserSpec(content_prefix=THINK_START, budget_markers=False),
    "mistral": ParserSpec(
        start="[THINK]",
        end="[/THINK]",
        implicit_ends=("[TOOL_CALLS]",),
        opens_in_content=True,
        **_ENGINE,
    ),
    "seed_oss": ParserSpec(
        start="<seed:think>",
        end="</seed:think>",
        implicit_ends=("<seed:tool_call>",),
        thinks=_enable_thinking,
        null_empty_reasoning=True,
        turn_boundaries=("<seed:bos>", "<seed:eos>"),
    ),
    "step3": ParserSpec(start=""),
}


def budget_markers(parser: str) -> tuple[str, str]:
    """The start and end strings vLLM's thinking budget takes from `parser` (its
    reasoning_start_str and reasoning_end_str); ("", "") when it gives none."""
    spec = SPECS.get(parser)
    if spec is None or not spec.budget_markers:
        return "", ""
    return spec.start or THINK_START, spec.end
