"""The reasoning parsers aioserve implements (--reasoning-parser), as marker specs that
server/reasoning.py's one splitter runs: each is vLLM 0.32's parser of the same name
reduced to the text markers it splits on. Plain data, here in the engine because the
thinking budget (engine/thinking_markers.py) reads the same markers.

- deepseek_r1: `<think>`…`</think>`; the answer starts in reasoning (the chat template
  opened it); whitespace before a leading `<think>` is dropped.
- qwen3: the same, unless chat_template_kwargs set `enable_thinking` false (then all
  content); a `<tool_call>` also ends the reasoning; an empty reasoning is null.
- mimo: qwen3, but whitespace before a leading `<think>` is kept.
- deepseek_v3: deepseek_r1 when chat_template_kwargs set `thinking` or `enable_thinking`,
  else all content (vLLM's identity parser). holo2: the same, thinking unless either is
  given and neither is true.
- glm45, glm47, ling3, kimi_k2: `<think>`…`</think>`, thinking unless `thinking`/
  `enable_thinking` is given and neither is true; GLM's `<tool_call>` or Kimi's
  `<|tool_calls_section_begin|>` ends the reasoning. minimax_m2: the same, ended by
  `<minimax:tool_call>`, no switch. step3p5: the same, ended by `<tool_call>`, no switch,
  and turns are ChatML's. nemotron_v3: qwen3 that drops the reasoning's trailing
  whitespace, and with `enable_thinking` false or `force_nonempty_content` true gives an
  answer without content its reasoning as content. These drop the reasoning's trailing
  whitespace, and an empty reasoning is null.
- seed_oss: qwen3 with `<seed:think>`…`</seed:think>` and `<seed:tool_call>`.
- mistral: `[THINK]`…`[/THINK]`; the answer starts in content, and content before the
  `[THINK]` stays content; `[TOOL_CALLS]` ends the reasoning (or ends the wait for one).
- step3: all reasoning until `</think>`; a `<think>` is kept as text.
- minimax_m2_append_think: no split; the content is the answer with `<think>` before it.
- ernie45: deepseek_r1, but a whole answer's content is what lies between its
  `<response>` and last `</response>`, where both are there.
- olmo3: `<think>`…`</think>` written as plain text: all reasoning until `</think>`; a
  `<think>` is dropped only where it opens the answer. A whole answer that never closes
  its reasoning is all content, and its empty reasoning or content is null.
- granite: "Here is my thought process:" (or "Here's …") opening the answer starts the
  reasoning, "Here is my response:" (or "Here's …") ends it; an answer that opens
  otherwise is all content. A whole answer that never ends its reasoning is all content.
- hunyuan_a13b: `<think>\n` (or `<think>\n\n`) starts the reasoning, content before it
  stays content; `\n</think>\n<answer>\n` (or without its first newline) ends it. A whole
  answer's content ends at its first `\n</answer>`, a whole answer that never ends its
  reasoning is all content, and its empty reasoning or content is null.

Once the reasoning has ended, the rest of the answer is content as written (vLLM's
streaming passes it through; its non-streamed parse drops a stray end marker or, for
glm45 and mistral, opens a second reasoning: aioserve splits whole answers as streamed).
Where vLLM's own whole and streamed splits part otherwise (the whole answer that never
ends its reasoning, the answer wrappers), aioserve's do the same.
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


def _nemotron_forces_content(kwargs: dict) -> bool:
    """Nemotron V3's rule for an answer without content: its reasoning becomes content."""
    return kwargs.get("enable_thinking") is False or kwargs.get("force_nonempty_content") is True


@dataclass(frozen=True)
class ParserSpec:
    """How one parser splits an answer."""

    start: str = THINK_START  # dropped where it appears in the reasoning; "" keeps it text
    end: str = THINK_END
    # Other spellings of the start and end markers (the longest that matches is taken).
    other_starts: tuple[str, ...] = ()
    other_ends: tuple[str, ...] = ()
    # Markers (tool calls') that end the reasoning and stay in the content, for the tool parser.
    implicit_ends: tuple[str, ...] = ()
    thinks: Callable[[dict], bool] | None = None  # the chat_template_kwargs switch, if any
    opens_in_content: bool = False  # the answer is content until its start marker
    start_opens_only: bool = False  # a start marker counts only where it opens the answer
    start_kept_in_reasoning: bool = False  # a start marker in the reasoning is text
    end_before_reasoning_is_text: bool = False  # else an end marker before its start is dropped
    space_before_start_dropped: bool = False  # whitespace before a leading start marker
    strip_trailing_space: bool = False  # the reasoning's trailing whitespace is dropped
    null_empty_reasoning: bool = False  # a whole answer's empty reasoning is null
    content_prefix: str = ""  # put before the content (and no split at all)
    # A whole answer (not a stream) that never ends its reasoning is all content, as written.
    unclosed_whole_is_content: bool = False
    # A whole answer's content is what lies between the first of these and the last of the
    # second, where both are there in that order (the stream keeps them).
    answer_wrapper: tuple[str, str] | None = None
    answer_end: str = ""  # a whole answer's content ends where this first appears
    # The chat_template_kwargs under which an answer without content has its reasoning as
    # content: whole, the two swap where the content is empty or blank; streamed, a
    # reasoning that never ended is given again as content at the end.
    reasoning_as_content: Callable[[dict], bool] | None = None
    # How a rendered prompt is seen to have ended the reasoning: "last", its last marker
    # (within the last turn, where the template marks turns) is an end marker; "any_end",
    # it holds an end marker anywhere; "never".
    prompt_rule: str = "last"
    turn_boundaries: tuple[str, ...] = ()  # the prompt's reasoning is read after the last
    budget_markers: bool = True  # whether vLLM's thinking budget knows start and end

    def thinking(self, chat_template_kwargs: dict | None) -> bool:
        """Whether an answer starts with (or waits for) a reasoning."""
        if self.content_prefix:
            return False
        return self.thinks is None or self.thinks(chat_template_kwargs or {})

    @property
    def starts(self) -> tuple[str, ...]:
        return (self.start, *self.other_starts) if self.start else ()

    @property
    def ends(self) -> tuple[str, ...]:
        return (self.end, *self.other_ends)


_CHATML = ("<|im_start|>", "<|im_end|>")
_ENGINE = {"strip_trailing_space": True, "null_empty_reasoning": True}
_GLM = {
    "implicit_ends": ("<tool_call>",),
    "thinks": _either_switch(True),
    "turn_boundaries": ("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"),
    **_ENGINE,
}
_QWEN3 = {
    "implicit_ends": ("<tool_call>",),
    "thinks": _enable_thinking,
    "null_empty_reasoning": True,
    "turn_boundaries": _CHATML,
}

SPECS: dict[str, ParserSpec] = {
    "deepseek_r1": ParserSpec(space_before_start_dropped=True),
    "qwen3": ParserSpec(space_before_start_dropped=True, **_QWEN3),
    "mimo": ParserSpec(**_QWEN3),
    "nemotron_v3": ParserSpec(
        **_QWEN3, strip_trailing_space=True, reasoning_as_content=_nemotron_forces_content
    ),
    "step3p5": ParserSpec(**{**_QWEN3, **_ENGINE, "thinks": None}),
    "deepseek_v3": ParserSpec(
        thinks=_either_switch(False), space_before_start_dropped=True, budget_markers=False
    ),
    "holo2": ParserSpec(thinks=_either_switch(True), space_before_start_dropped=True),
    "glm45": ParserSpec(**_GLM),
    "glm47": ParserSpec(**_GLM),
    "ling3": ParserSpec(**_GLM),
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
    "step3": ParserSpec(start="", prompt_rule="any_end"),
    "ernie45": ParserSpec(
        space_before_start_dropped=True, answer_wrapper=("<response>", "</response>")
    ),
    "olmo3": ParserSpec(
        start_opens_only=True,
        null_empty_reasoning=True,
        unclosed_whole_is_content=True,
        prompt_rule="any_end",
    ),
    "granite": ParserSpec(
        start="Here is my thought process:",
        end="Here is my response:",
        other_starts=("Here's my thought process:",),
        other_ends=("Here's my response:",),
        opens_in_content=True,
        start_opens_only=True,
        unclosed_whole_is_content=True,
        prompt_rule="never",
        budget_markers=False,
    ),
    "hunyuan_a13b": ParserSpec(
        start="<think>\n",
        end="\n</think>\n<answer>\n",
        other_starts=("<think>\n\n",),
        other_ends=("</think>\n<answer>\n",),
        opens_in_content=True,
        start_kept_in_reasoning=True,
        end_before_reasoning_is_text=True,
        null_empty_reasoning=True,
        unclosed_whole_is_content=True,
        answer_end="\n</answer>",
        prompt_rule="never",
        budget_markers=False,
    ),
}


def budget_markers(parser: str) -> tuple[str, str]:
    """The start and end strings vLLM's thinking budget takes from `parser` (its
    reasoning_start_str and reasoning_end_str); ("", "") when it gives none."""
    spec = SPECS.get(parser)
    if spec is None or not spec.budget_markers:
        return "", ""
    return spec.start or THINK_START, spec.end
