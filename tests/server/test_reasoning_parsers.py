"""The reasoning parsers added after deepseek_r1 and qwen3 (engine/reasoning_parsers.py),
against vLLM 0.32's own parsers of the same names.

The expected values are literals produced by running vLLM's parsers (vllm.parser's
ParserManager.get_parser(reasoning_parser_name=...), a DelegatingParser as `vllm serve`
builds it) in a venv with vLLM 0.32 on CPU, on a SmolLM2 tokenizer given every marker as a
special token: `parse()` for the whole answer, `parse_delta()` fed one token at a time
(and four at a time, which gave the same) for the streamed one, and `is_reasoning_end()`
on the prompts' token ids. CI has no vLLM, so they are written here.

aioserve splits on text, so the streamed split is checked at every cut of the answer into
two pieces and at single characters: markers cut mid-way are held back. Where vLLM's whole
and streamed splits differ (a stray end marker after the reasoning ended: its streaming
passes it through as content, its whole parse drops it), aioserve splits a whole answer as
vLLM streams it, so that both agree; those rows are marked STREAMED_ONLY.
"""

from __future__ import annotations

import pytest

from aioserve.engine.thinking_markers import budget_markers
from aioserve.server.reasoning import ReasoningSplitter, reasoning_closed, split_whole
from tests.server.test_reasoning import answer, parsed_by, streamed_fields  # noqa: F401

# (parser, answer, vLLM whole reasoning, whole content, streamed reasoning, streamed content)
VLLM_SPLITS = [
    ('mistral', '[THINK]\nTwo and two.\n[/THINK]\n\nThe answer is 4.', '\nTwo and two.', '\n\nThe answer is 4.', '\nTwo and two.', '\n\nThe answer is 4.'),
    ('mistral', 'Two and two.[/THINK]The answer.', None, 'Two and two.The answer.', '', 'Two and two.The answer.'),
    ('mistral', '[THINK]never closed  \n', 'never closed', None, 'never closed', ''),
    ('mistral', '[THINK][/THINK]Only.', None, 'Only.', '', 'Only.'),
    ('mistral', 'Hi [THINK]t[/THINK]ans', 't', 'Hi ans', 't', 'Hi ans'),
    ('mistral', '[THINK]a[THINK]b  [/THINK] c', 'ab', ' c', 'ab', ' c'),
    ('mistral', 'plan \n[TOOL_CALLS]call', None, 'plan \n[TOOL_CALLS]call', '', 'plan \n[TOOL_CALLS]call'),
    ('mistral', '  [THINK] a  [/THINK]  b  ', ' a', '    b  ', ' a', '    b  '),
    ('mistral', 'no markers at all', None, 'no markers at all', '', 'no markers at all'),
    ('mistral', '[THINK]p[/THINK][TOOL_CALLS]c', 'p', '[TOOL_CALLS]c', 'p', '[TOOL_CALLS]c'),
    ('mistral', 'x[/THINK]y[/THINK]z', None, 'xyz', '', 'xyz'),
    ('mistral', 'a[/THINK]b[THINK]c[/THINK]d', 'c', 'abd', 'c', 'abd'),
    ('glm45', '<think>\nTwo and two.\n</think>\n\nThe answer is 4.', '\nTwo and two.', '\n\nThe answer is 4.', '\nTwo and two.', '\n\nThe answer is 4.'),
    ('glm45', 'Two and two.</think>The answer.', 'Two and two.', 'The answer.', 'Two and two.', 'The answer.'),
    ('glm45', '<think>never closed  \n', 'never closed', None, 'never closed', ''),
    ('glm45', '<think></think>Only.', None, 'Only.', '', 'Only.'),
    ('glm45', 'Hi <think>t</think>ans', 'Hi t', 'ans', 'Hi t', 'ans'),
    ('glm45', '<think>a<think>b  </think> c', 'ab', ' c', 'ab', ' c'),
    ('glm45', 'plan \n<tool_call>call', 'plan', '<tool_call>call', 'plan', '<tool_call>call'),
    ('glm45', '  <think> a  </think>  b  ', '   a', '  b  ', '   a', '  b  '),
    ('glm45', 'no markers at all', 'no markers at all', None, 'no markers at all', ''),
    ('glm45', '<think>p</think><tool_call>c', 'p', '<tool_call>c', 'p', '<tool_call>c'),
    ('glm45', 'x</think>y</think>z', 'x', 'yz', 'x', 'y</think>z'),
    ('seed_oss', '<seed:think>\nTwo and two.\n</seed:think>\n\nThe answer is 4.', '\nTwo and two.\n', '\n\nThe answer is 4.', '\nTwo and two.\n', '\n\nThe answer is 4.'),
    ('seed_oss', 'Two and two.</seed:think>The answer.', 'Two and two.', 'The answer.', 'Two and two.', 'The answer.'),
    ('seed_oss', '<seed:think>never closed  \n', 'never closed  \n', None, 'never closed  \n', ''),
    ('seed_oss', '<seed:think></seed:think>Only.', None, 'Only.', '', 'Only.'),
    ('seed_oss', 'Hi <seed:think>t</seed:think>ans', 'Hi t', 'ans', 'Hi t', 'ans'),
    ('seed_oss', '<seed:think>a<seed:think>b  </seed:think> c', 'ab  ', ' c', 'ab  ', ' c'),
    ('seed_oss', 'plan \n<seed:tool_call>call', 'plan \n', '<seed:tool_call>call', 'plan \n', '<seed:tool_call>call'),
    ('seed_oss', '  <seed:think> a  </seed:think>  b  ', '   a  ', '  b  ', '   a  ', '  b  '),
    ('seed_oss', 'no markers at all', 'no markers at all', None, 'no markers at all', ''),
    ('seed_oss', '<seed:think>p</seed:think><seed:tool_call>c', 'p', '<seed:tool_call>c', 'p', '<seed:tool_call>c'),
    ('seed_oss', 'x</seed:think>y</seed:think>z', 'x', 'yz', 'x', 'y</seed:think>z'),
    ('kimi_k2', '<think>\nTwo and two.\n</think>\n\nThe answer is 4.', '\nTwo and two.', '\n\nThe answer is 4.', '\nTwo and two.', '\n\nThe answer is 4.'),
    ('kimi_k2', 'Two and two.</think>The answer.', 'Two and two.', 'The answer.', 'Two and two.', 'The answer.'),
    ('kimi_k2', '<think>never closed  \n', 'never closed', None, 'never closed', ''),
    ('kimi_k2', '<think></think>Only.', None, 'Only.', '', 'Only.'),
    ('kimi_k2', 'Hi <think>t</think>ans', 'Hi t', 'ans', 'Hi t', 'ans'),
    ('kimi_k2', '<think>a<think>b  </think> c', 'ab', ' c', 'ab', ' c'),
    ('kimi_k2', 'plan \n<|tool_calls_section_begin|>call', 'plan', '<|tool_calls_section_begin|>call', 'plan', '<|tool_calls_section_begin|>call'),
    ('kimi_k2', '  <think> a  </think>  b  ', '   a', '  b  ', '   a', '  b  '),
    ('kimi_k2', 'no markers at all', 'no markers at all', None, 'no markers at all', ''),
    ('kimi_k2', '<think>p</think><|tool_calls_section_begin|>c', 'p', '<|tool_calls_section_begin|>c', 'p', '<|tool_calls_section_begin|>c'),
    ('kimi_k2', 'x</think>y</think>z', 'x', 'yz', 'x', 'y</think>z'),
    ('minimax_m2', '<think>\nTwo and two.\n</think>\n\nThe answer is 4.', '\nTwo and two.', '\n\nThe answer is 4.', '\nTwo and two.', '\n\nThe answer is 4.'),
    ('minimax_m2', 'Two and two.</think>The answer.', 'Two and two.', 'The answer.', 'Two and two.', 'The answer.'),
    ('minimax_m2', '<think>never closed  \n', 'never closed', None, 'never closed', ''),
    ('minimax_m2', '<think></think>Only.', None, 'Only.', '', 'Only.'),
    ('minimax_m2', 'Hi <think>t</think>ans', 'Hi t', 'ans', 'Hi t', 'ans'),
    ('minimax_m2', '<think>a<think>b  </think> c', 'ab', ' c', 'ab', ' c'),
    ('minimax_m2', 'plan \n<minimax:tool_call>call', 'plan', '<minimax:tool_call>call', 'plan', '<minimax:tool_call>call'),
    ('minimax_m2', '  <think> a  </think>  b  ', '   a', '  b  ', '   a', '  b  '),
    ('minimax_m2', 'no markers at all', 'no markers at all', None, 'no markers at all', ''),
    ('minimax_m2', '<think>p</think><minimax:tool_call>c', 'p', '<minimax:tool_call>c', 'p', '<minimax:tool_call>c'),
    ('minimax_m2', 'x</think>y</think>z', 'x', 'yz', 'x', 'y</think>z'),
    ('step3', '<think>\nTwo and two.\n</think>\n\nThe answer is 4.', '<think>\nTwo and two.\n', '\n\nThe answer is 4.', '<think>\nTwo and two.\n', '\n\nThe answer is 4.'),
    ('step3', 'Two and two.</think>The answer.', 'Two and two.', 'The answer.', 'Two and two.', 'The answer.'),
    ('step3', '<think>never closed  \n', '<think>never closed  \n', None, '<think>never closed  \n', ''),
    ('step3', '<think></think>Only.', '<think>', 'Only.', '<think>', 'Only.'),
    ('step3', 'Hi <think>t</think>ans', 'Hi <think>t', 'ans', 'Hi <think>t', 'ans'),
    ('step3', '<think>a<think>b  </think> c', '<think>a<think>b  ', ' c', '<think>a<think>b  ', ' c'),
    ('step3', 'plan \n<tool_call>call', 'plan \n<tool_call>call', None, 'plan \n<tool_call>call', ''),
    ('step3', '  <think> a  </think>  b  ', '  <think> a  ', '  b  ', '  <think> a  ', '  b  '),
    ('step3', 'no markers at all', 'no markers at all', None, 'no markers at all', ''),
    ('step3', '<think>p</think><tool_call>c', '<think>p', '<tool_call>c', '<think>p', '<tool_call>c'),
    ('step3', 'x</think>y</think>z', 'x', 'y</think>z', 'x', 'y</think>z'),
    ('deepseek_v3', '<think>\nTwo and two.\n</think>\n\nThe answer is 4.', None, '<think>\nTwo and two.\n</think>\n\nThe answer is 4.', '', '<think>\nTwo and two.\n</think>\n\nThe answer is 4.'),
    ('deepseek_v3', 'Two and two.</think>The answer.', None, 'Two and two.</think>The answer.', '', 'Two and two.</think>The answer.'),
    ('deepseek_v3', '<think>never closed  \n', None, '<think>never closed  \n', '', '<think>never closed  \n'),
    ('deepseek_v3', '<think></think>Only.', None, '<think></think>Only.', '', '<think></think>Only.'),
    ('deepseek_v3', 'Hi <think>t</think>ans', None, 'Hi <think>t</think>ans', '', 'Hi <think>t</think>ans'),
    ('deepseek_v3', '<think>a<think>b  </think> c', None, '<think>a<think>b  </think> c', '', '<think>a<think>b  </think> c'),
    ('deepseek_v3', 'plan \n<tool_call>call', None, 'plan \n<tool_call>call', '', 'plan \n<tool_call>call'),
    ('deepseek_v3', '  <think> a  </think>  b  ', None, '  <think> a  </think>  b  ', '', '  <think> a  </think>  b  '),
    ('deepseek_v3', 'no markers at all', None, 'no markers at all', '', 'no markers at all'),
    ('deepseek_v3', '<think>p</think><tool_call>c', None, '<think>p</think><tool_call>c', '', '<think>p</think><tool_call>c'),
    ('deepseek_v3', 'x</think>y</think>z', None, 'x</think>y</think>z', '', 'x</think>y</think>z'),
    ('minimax_m2_append_think', '<think>\nTwo and two.\n</think>\n\nThe answer is 4.', None, '<think><think>\nTwo and two.\n</think>\n\nThe answer is 4.', '', '<think><think>\nTwo and two.\n</think>\n\nThe answer is 4.'),
    ('minimax_m2_append_think', 'Two and two.</think>The answer.', None, '<think>Two and two.</think>The answer.', '', '<think>Two and two.</think>The answer.'),
    ('minimax_m2_append_think', '<think>never closed  \n', None, '<think><think>never closed  \n', '', '<think><think>never closed  \n'),
    ('minimax_m2_append_think', '<think></think>Only.', None, '<think><think></think>Only.', '', '<think><think></think>Only.'),
    ('minimax_m2_append_think', 'Hi <think>t</think>ans', None, '<think>Hi <think>t</think>ans', '', '<think>Hi <think>t</think>ans'),
    ('minimax_m2_append_think', '<think>a<think>b  </think> c', None, '<think><think>a<think>b  </think> c', '', '<think><think>a<think>b  </think> c'),
    ('minimax_m2_append_think', 'plan \n<tool_call>call', None, '<think>plan \n<tool_call>call', '', '<think>plan \n<tool_call>call'),
    ('minimax_m2_append_think', '  <think> a  </think>  b  ', None, '<think>  <think> a  </think>  b  ', '', '<think>  <think> a  </think>  b  '),
    ('minimax_m2_append_think', 'no markers at all', None, '<think>no markers at all', '', '<think>no markers at all'),
    ('minimax_m2_append_think', '<think>p</think><tool_call>c', None, '<think><think>p</think><tool_call>c', '', '<think><think>p</think><tool_call>c'),
    ('minimax_m2_append_think', 'x</think>y</think>z', None, '<think>x</think>y</think>z', '', '<think>x</think>y</think>z'),
]  # fmt: skip

STREAMED_ONLY = {"x</think>y</think>z", "x</seed:think>y</seed:think>z"}

# (parser, rendered prompt, whether vLLM's is_reasoning_end sees the reasoning closed)
VLLM_PROMPTS = [
    ('mistral', '[INST]hi[/INST][THINK]', False),
    ('mistral', '[INST]hi[/INST][THINK]a[/THINK]', True),
    ('mistral', '[INST]hi[/INST]', False),
    ('glm45', '<|user|>hi<|assistant|><think>', False),
    ('glm45', '<|user|>hi<|assistant|><think></think>', True),
    ('glm45', '<think>a</think><|user|>hi<|assistant|>', False),
    ('seed_oss', '<seed:bos>user hi<seed:eos><seed:bos>assistant<seed:think>', False),
    ('seed_oss', '<seed:bos>assistant<seed:think></seed:think>', True),
    ('seed_oss', '<seed:think>a</seed:think><seed:eos><seed:bos>assistant', False),
    ('kimi_k2', '<|im_start|>assistant<think>', False),
    ('kimi_k2', '<|im_start|>assistant<think></think>', True),
    ('kimi_k2', '<think>a</think><|im_end|><|im_start|>assistant', True),
    ('minimax_m2', 'assistant<think>', False),
    ('minimax_m2', 'assistant<think></think>', True),
    ('minimax_m2', '<think>a</think> user: hi', True),
    ('step3', '<think>a</think>user<think>', True),
    ('step3', 'assistant<think>', False),
    ('step3', 'assistant:', False),
]  # fmt: skip


def streamed(parser: str, pieces: list[str], kwargs: dict | None = None) -> tuple[str, str]:
    splitter = ReasoningSplitter(parser, kwargs)
    splits = [splitter.feed(piece, i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    return "".join(s.reasoning for s in splits), "".join(s.content for s in splits)


def chunkings(answer: str) -> list[list[str]]:
    """Every cut into two pieces, single characters, and three-character chunks."""
    cuts = [[answer[:i], answer[i:]] for i in range(len(answer) + 1)]
    return [*cuts, list(answer), [answer[i : i + 3] for i in range(0, len(answer), 3)] or [""]]


@pytest.mark.parametrize(
    ("parser", "answer", "reasoning", "content", "streamed_reasoning", "streamed_content"),
    VLLM_SPLITS,
)
def test_the_split_is_vllms(
    parser, answer, reasoning, content, streamed_reasoning, streamed_content
):
    if answer in STREAMED_ONLY and parser != "step3":
        reasoning, content = streamed_reasoning or None, streamed_content or None
    assert split_whole(ReasoningSplitter(parser), answer) == (reasoning, content)
    for pieces in chunkings(answer):
        assert streamed(parser, pieces) == (streamed_reasoning, streamed_content), pieces


@pytest.mark.parametrize(
    ("parser", "kwargs", "thinks"),
    [
        ("glm45", {"thinking": False}, False),
        ("glm45", {"enable_thinking": False, "thinking": True}, True),
        ("kimi_k2", {"enable_thinking": False}, False),
        ("seed_oss", {"enable_thinking": False}, False),
        ("seed_oss", {"thinking": False}, True),  # seed_oss reads enable_thinking only
        ("deepseek_v3", {"thinking": True}, True),
        ("deepseek_v3", {"enable_thinking": True}, True),
        ("deepseek_v3", {}, False),
    ],
)
def test_chat_template_kwargs_switch_the_reasoning(parser, kwargs, thinks):
    """vLLM: thinking off gives the whole answer as content (its parse()); its streaming,
    fed token ids, also drops the special-token markers, which aioserve keeps as text."""
    start, end = (
        ("<seed:think>", "</seed:think>") if parser == "seed_oss" else ("<think>", "</think>")
    )
    answer = f"{start}x{end}y"
    expected = ("x", "y") if thinks else (None, answer)
    assert split_whole(ReasoningSplitter(parser, kwargs), answer) == expected
    for pieces in chunkings(answer):
        assert streamed(parser, pieces, kwargs) == (expected[0] or "", expected[1]), pieces


@pytest.mark.parametrize(("parser", "prompt", "closed"), VLLM_PROMPTS)
def test_a_prompt_that_closed_the_reasoning_is_seen_as_vllm_sees_it(parser, prompt, closed):
    assert reasoning_closed(parser, prompt) is closed
    answer = "a</think>b"
    splitter = ReasoningSplitter(parser, prompt_closed=closed)
    if closed:
        assert split_whole(splitter, answer) == (None, answer)


@pytest.mark.parametrize(
    ("parser", "markers"),
    [
        ("mistral", ("[THINK]", "[/THINK]")),
        ("glm45", ("<think>", "</think>")),
        ("seed_oss", ("<seed:think>", "</seed:think>")),
        ("kimi_k2", ("<think>", "</think>")),
        ("minimax_m2", ("<think>", "</think>")),
        ("step3", ("<think>", "</think>")),
        ("deepseek_v3", ("", "")),  # vLLM builds it without chat_template_kwargs: no thinking
        ("minimax_m2_append_think", ("", "")),
    ],
)
def test_the_thinking_budget_takes_vllms_markers(parser, markers):
    """vLLM's reasoning_start_str and reasoning_end_str for each parser."""
    assert budget_markers(parser) == markers


def test_through_the_server(parsed_by, openai_server):  # noqa: F811
    """The default model writes no markers: mistral waits for a [THINK] that never comes
    (all content); glm45 without thinking is all content; minimax_m2_append_think puts
    <think> before the content; streamed through the openai client and not."""
    plain = answer(openai_server)["content"]
    for parser, kwargs, content in [
        ("mistral", {}, plain),
        ("glm45", {"chat_template_kwargs": {"thinking": False}}, plain),
        ("minimax_m2_append_think", {}, "<think>" + plain),
    ]:
        url = parsed_by(parser)
        message = answer(url, **kwargs)
        assert (message["reasoning"], message["content"]) == (None, content), parser
        assert streamed_fields(url, **kwargs) == ("", content), parser
    url = parsed_by("glm45")
    assert answer(url)["reasoning"] == plain.rstrip()
