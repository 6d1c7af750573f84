"""More of vLLM 0.32's reasoning parsers (engine/reasoning_parsers.py): granite, olmo3,
hunyuan_a13b, ernie45, and those that are marker splits in the grammars of the parsers
before them (glm47, ling3, holo2, mimo, nemotron_v3, step3p5), against vLLM's own parsers.

The expected values are literals produced as test_reasoning_parsers.py's were: vLLM's
parsers (ParserManager.get_parser(reasoning_parser_name=...), a DelegatingParser as `vllm
serve` builds it) in a venv with vLLM 0.32 on CPU, `parse()` for the whole answer and
`parse_delta()` fed one token at a time for the streamed one, `is_reasoning_end()` on the
prompts' token ids, and `reasoning_start_str`/`reasoning_end_str` for the thinking budget.
The tokenizer: SmolLM2's given every marker as a special token; SmolLM2's own for granite
and olmo3, whose markers are plain text (olmo3's parser looks up SmolLM2's "Ġ</", "</",
"think" and ">" tokens); for ernie45, SmolLM2's newline token stood for Ernie's <0x0A>.
vLLM's hunyuan_a13b parser matches the token ids Hunyuan's tokenizer gives its markers
(written in the parser): it was fed the markers as those tokens, the other text a
character a token. Rows marked "chunk-dependent" stream otherwise in vLLM when fed 2, 3
or 5 tokens at a time. CI has no vLLM, so they are written here.

aioserve splits on text, so the streamed split is checked at every cut of the answer into
two pieces, at single characters and in three-character chunks. Where it departs from a
literal, DEPARTURES says what it gives instead, and why.
"""

from __future__ import annotations

import pytest

from aioserve.config.reasoning_names import REASONING_PARSERS, VLLM_OTHER_REASONING_PARSERS
from aioserve.engine.reasoning_parsers import SPECS
from aioserve.engine.thinking_markers import budget_markers
from aioserve.server.reasoning import ReasoningSplitter, reasoning_closed, split_whole
from tests.server.test_reasoning import answer, parsed_by, streamed_fields  # noqa: F401
from tests.server.test_reasoning_parsers import chunkings, streamed

# (parser, answer, vLLM whole reasoning, whole content, streamed reasoning, streamed content)
VLLM_SPLITS = [
    ('granite', 'Here is my thought process: Two and two. Here is my response: The answer is 4.', ' Two and two. ', ' The answer is 4.', ' Two and two. ', ' The answer is 4.'),  # chunk-dependent
    ('granite', "Here's my thought process:\nx\nHere's my response:\ny", '\nx\n', '\ny', '\nx\n', '\ny'),  # chunk-dependent
    ('granite', "Here is my thought process:a Here's my response:b", 'a ', 'b', 'a ', 'b'),  # chunk-dependent
    ('granite', "Here's my thought process:a Here is my response:b", 'a ', 'b', 'a ', 'b'),  # chunk-dependent
    ('granite', 'Here is my thought process: never closed  ', None, 'Here is my thought process: never closed  ', ' never closed  ', ''),  # chunk-dependent
    ('granite', 'Here is my thought process:Here is my response:Only.', '', 'Only.', '', ':Only.'),  # chunk-dependent
    ('granite', 'Hi Here is my thought process:tHere is my response:ans', 't', 'ans', '', 'Hi Here is my thought process:tHere is my response:ans'),
    ('granite', '  Here is my thought process: a Here is my response: b ', ' a ', ' b ', '', '  Here is my thought process: a Here is my response: b '),
    ('granite', 'no markers at all', None, 'no markers at all', '', 'no markers at all'),
    ('granite', 'Here is my thought process:aHere is my thought process:b Here is my response:c', 'aHere is my thought process:b ', 'c', 'aHere is my thought process:b ', 'c'),  # chunk-dependent
    ('granite', 'Here is my thought process:a Here is my response:b Here is my response:c', 'a ', 'b Here is my response:c', 'a ', 'b Here is my response:c'),  # chunk-dependent
    ('granite', 'Here is my thought process:a Here is my thought b Here is my response:c', 'a Here is my thought b ', 'c', 'a Here is my thought b ', 'c'),  # chunk-dependent
    ('granite', 'Here is my thought process:a: b Here is my response:c', 'a: b ', 'c', 'a: b ', 'c'),  # chunk-dependent
    ('granite', 'Here is my answer: x', None, 'Here is my answer: x', '', 'Here is my answer: x'),
    ('granite', 'Here is my thought process: a Here is my response:', ' a ', None, ' a ', ''),  # chunk-dependent
    ('granite', 'Here is my thought process:a\n\nHere is my response:\n\nb', 'a\n\n', '\n\nb', 'a\n\n', '\n\nb'),  # chunk-dependent
    ('granite', 'Here is my thought process: x: y: z Here is my response: w: v', ' x: y: z ', ' w: v', ' x: y: z ', ' w: v'),  # chunk-dependent
    ('granite', 'Here is my thought process:aHere is my response:b', 'a', 'b', 'a', ':b'),  # chunk-dependent
    ('olmo3', '<think>\nTwo and two.\n</think>\n\nThe answer is 4.', '\nTwo and two.\n', '\n\nThe answer is 4.', '\nTwo and two.\n', '\n\nThe answer is 4.'),  # chunk-dependent
    ('olmo3', 'Two and two.</think>The answer.', 'Two and two.', 'The answer.', 'Two and two.', 'The answer.'),  # chunk-dependent
    ('olmo3', '<think>never closed  \n', None, '<think>never closed  \n', 'never closed  \n', ''),
    ('olmo3', '<think></think>Only.', None, 'Only.', '', 'Only.'),
    ('olmo3', 'Hi <think>t</think>ans', 'Hi <think>t', 'ans', 'Hi', ' ans'),  # chunk-dependent
    ('olmo3', '<think>a<think>b  </think> c', 'a<think>b  ', ' c', 'ab  ', ' c'),  # chunk-dependent
    ('olmo3', 'plan \n<tool_call>call', None, 'plan \n<tool_call>call', 'plan \n<tool_call>call', ''),
    ('olmo3', '  <think> a  </think>  b  ', '  <think> a  ', '  b  ', '  a  ', '   b  '),  # chunk-dependent
    ('olmo3', 'no markers at all', None, 'no markers at all', 'no markers at all', ''),
    ('olmo3', '<think>p</think><tool_call>c', 'p', '<tool_call>c', 'p', '<tool_call>c'),  # chunk-dependent
    ('olmo3', 'x</think>y</think>z', 'x', 'y</think>z', 'x', 'y</think>z'),  # chunk-dependent
    ('olmo3', 'a</think>b<think>c</think>d', 'a', 'b<think>c</think>d', 'a', 'b<think>c</think>d'),  # chunk-dependent
    ('olmo3', '<think>a  </think>', 'a  ', None, 'a  ', ''),
    ('olmo3', '<think>  </think>  ', '  ', '  ', '  ', '  '),  # chunk-dependent
    ('hunyuan_a13b', '<think>\nTwo and two.\n</think>\n<answer>\nThe answer is 4.\n</answer>', 'Two and two.', 'The answer is 4.', 'Two and two.', 'The answer is 4.\n</answer>'),
    ('hunyuan_a13b', '<think>\nTwo and two.\n</think>\n<answer>\nThe answer is 4.', 'Two and two.', 'The answer is 4.', 'Two and two.', 'The answer is 4.'),
    ('hunyuan_a13b', '<think>\nnever closed  ', None, '<think>\nnever closed  ', 'never closed  ', ''),
    ('hunyuan_a13b', '<think>\n\n</think>\n<answer>\nOnly.\n</answer>', None, 'Only.', '', 'Only.\n</answer>'),
    ('hunyuan_a13b', 'Hi <think>\nt\n</think>\n<answer>\nans\n</answer>', None, 'Hi <think>\nt\n</think>\n<answer>\nans', 't', 'Hi ans\n</answer>'),
    ('hunyuan_a13b', '<think>\na<think>\nb\n</think>\n<answer>\nc\n</answer>', 'a<think>\nb', 'c', 'a<think>\nb', 'c\n</answer>'),
    ('hunyuan_a13b', 'no markers at all', None, 'no markers at all', '', 'no markers at all'),
    ('hunyuan_a13b', 'Only an answer.\n</answer>', None, 'Only an answer.', '', 'Only an answer.\n</answer>'),
    ('hunyuan_a13b', '<think>\n\nfast\n</think>\n<answer>\nx\n</answer>', '\nfast', 'x', 'fast', 'x\n</answer>'),
    ('hunyuan_a13b', '<think>\na</think>\n<answer>\nb\n</answer>', None, '<think>\na</think>\n<answer>\nb', 'a', 'b\n</answer>'),
    ('hunyuan_a13b', '<think>\na\n</think>\n<answer>\nb\n</answer>after', 'a', 'b', 'a', 'b\n</answer>after'),
    ('hunyuan_a13b', '<think>\na\n\nb\n\n</think>\n<answer>\n\nc\n\n</answer>', 'a\n\nb\n', '\nc\n', 'a\n\nb\n\n', '\nc\n\n</answer>'),
    ('hunyuan_a13b', '<think>\na\n</think>\nb', None, '<think>\na\n</think>\nb', 'a\n</think>\nb', ''),
    ('hunyuan_a13b', '<think>a\n</think>\n<answer>\nb\n</answer>', None, '<think>a\n</think>\n<answer>\nb', '', '<think>a\n</think>\n<answer>\nb\n</answer>'),
    ('hunyuan_a13b', '<think>\na\n</think>\n<answer>\n\n</answer>', 'a', None, 'a', '\n</answer>'),
    ('hunyuan_a13b', '<think>\na\n</think>\n<answer>\nb\n</think>\n<answer>\nc\n</answer>', 'a', 'b\n</think>\n<answer>\nc', 'a', 'b\n</think>\n<answer>\nc\n</answer>'),
    ('hunyuan_a13b', 'x\n</think>\n<answer>\ny', None, 'x\n</think>\n<answer>\ny', '', 'x\n</think>\n<answer>\ny'),
    ('hunyuan_a13b', '<think>\na\n', None, '<think>\na\n', 'a', ''),
    ('ernie45', '<think>\nTwo and two.\n</think>\n\nThe answer is 4.', '\nTwo and two.\n', '\n\nThe answer is 4.', '\nTwo and two.\n', '\n\nThe answer is 4.'),  # chunk-dependent
    ('ernie45', 'Two and two.</think>The answer.', 'Two and two.', 'The answer.', 'Two and two.', 'The answer.'),
    ('ernie45', '<think>never closed  \n', 'never closed  \n', None, 'never closed  \n', ''),  # chunk-dependent
    ('ernie45', '<think></think>Only.', '', 'Only.', '', 'Only.'),  # chunk-dependent
    ('ernie45', 'Hi <think>t</think>ans', 't', 'ans', 'Hi t', 'ans'),  # chunk-dependent
    ('ernie45', '<think>a<think>b  </think> c', 'a<think>b  ', ' c', 'ab  ', ' c'),  # chunk-dependent
    ('ernie45', 'plan \n<tool_call>call', 'plan \n<tool_call>call', None, 'plan \n<tool_call>call', ''),
    ('ernie45', '  <think> a  </think>  b  ', ' a  ', '  b  ', '   a  ', '  b  '),  # chunk-dependent
    ('ernie45', 'no markers at all', 'no markers at all', None, 'no markers at all', ''),
    ('ernie45', '<think>p</think><tool_call>c', 'p', '<tool_call>c', 'p', '<tool_call>c'),  # chunk-dependent
    ('ernie45', 'x</think>y</think>z', 'x', 'y</think>z', 'x', 'y</think>z'),
    ('ernie45', 'a</think>b<think>c</think>d', 'c', 'd', 'a', 'b<think>c</think>d'),
    ('ernie45', '<think>a  </think>', 'a  ', None, 'a  ', ''),  # chunk-dependent
    ('ernie45', '<think>  </think>  ', '  ', '  ', '  ', '  '),  # chunk-dependent
    ('ernie45', '<think>\nTwo and two.\n</think>\n\n<response>\nThe answer is 4.\n</response>\n', '\nTwo and two.\n', '\nThe answer is 4.\n', '\nTwo and two.\n', '\n\n<response>\nThe answer is 4.\n</response>\n'),  # chunk-dependent
    ('ernie45', 'a</think>\n\nx<response>b</response>c', 'a', 'b', 'a', '\n\nx<response>b</response>c'),  # chunk-dependent
    ('ernie45', 'a</think><response>b', 'a', '<response>b', 'a', '<response>b'),  # chunk-dependent
    ('ernie45', 'a</think><response></response>', 'a', None, 'a', '<response></response>'),  # chunk-dependent
    ('ernie45', 'a</think><response>b</response>c</response>', 'a', 'b</response>c', 'a', '<response>b</response>c</response>'),  # chunk-dependent
    ('glm47', '<think>\nTwo and two.\n</think>\n\nThe answer is 4.', '\nTwo and two.', '\n\nThe answer is 4.', '\nTwo and two.', '\n\nThe answer is 4.'),
    ('glm47', 'Two and two.</think>The answer.', 'Two and two.', 'The answer.', 'Two and two.', 'The answer.'),
    ('glm47', '<think>never closed  \n', 'never closed', None, 'never closed', ''),
    ('glm47', '<think></think>Only.', None, 'Only.', '', 'Only.'),
    ('glm47', 'Hi <think>t</think>ans', 'Hi t', 'ans', 'Hi t', 'ans'),
    ('glm47', '<think>a<think>b  </think> c', 'ab', ' c', 'ab', ' c'),
    ('glm47', 'plan \n<tool_call>call', 'plan', '<tool_call>call', 'plan', '<tool_call>call'),
    ('glm47', '  <think> a  </think>  b  ', '   a', '  b  ', '   a', '  b  '),
    ('glm47', 'no markers at all', 'no markers at all', None, 'no markers at all', ''),
    ('glm47', '<think>p</think><tool_call>c', 'p', '<tool_call>c', 'p', '<tool_call>c'),
    ('glm47', 'x</think>y</think>z', 'x', 'yz', 'x', 'y</think>z'),  # chunk-dependent
    ('glm47', 'a</think>b<think>c</think>d', 'ac', 'bd', 'a', 'b<think>c</think>d'),  # chunk-dependent
    ('glm47', '<think>a  </think>', 'a', None, 'a', ''),
    ('glm47', '<think>  </think>  ', None, '  ', '', '  '),
    ('ling3', '<think>\nTwo and two.\n</think>\n\nThe answer is 4.', '\nTwo and two.', '\n\nThe answer is 4.', '\nTwo and two.', '\n\nThe answer is 4.'),
    ('ling3', 'Two and two.</think>The answer.', 'Two and two.', 'The answer.', 'Two and two.', 'The answer.'),
    ('ling3', '<think>never closed  \n', 'never closed', None, 'never closed', ''),
    ('ling3', '<think></think>Only.', None, 'Only.', '', 'Only.'),
    ('ling3', 'Hi <think>t</think>ans', 'Hi t', 'ans', 'Hi t', 'ans'),
    ('ling3', '<think>a<think>b  </think> c', 'ab', ' c', 'ab', ' c'),
    ('ling3', 'plan \n<tool_call>call', 'plan', '<tool_call>call', 'plan', '<tool_call>call'),
    ('ling3', '  <think> a  </think>  b  ', '   a', '  b  ', '   a', '  b  '),
    ('ling3', 'no markers at all', 'no markers at all', None, 'no markers at all', ''),
    ('ling3', '<think>p</think><tool_call>c', 'p', '<tool_call>c', 'p', '<tool_call>c'),
    ('ling3', 'x</think>y</think>z', 'x', 'yz', 'x', 'y</think>z'),  # chunk-dependent
    ('ling3', 'a</think>b<think>c</think>d', 'ac', 'bd', 'a', 'b<think>c</think>d'),  # chunk-dependent
    ('ling3', '<think>a  </think>', 'a', None, 'a', ''),
    ('ling3', '<think>  </think>  ', None, '  ', '', '  '),
    ('holo2', '<think>\nTwo and two.\n</think>\n\nThe answer is 4.', '\nTwo and two.\n', '\n\nThe answer is 4.', '\nTwo and two.\n', '\n\nThe answer is 4.'),  # chunk-dependent
    ('holo2', 'Two and two.</think>The answer.', 'Two and two.', 'The answer.', 'Two and two.', 'The answer.'),
    ('holo2', '<think>never closed  \n', 'never closed  \n', None, 'never closed  \n', ''),  # chunk-dependent
    ('holo2', '<think></think>Only.', '', 'Only.', '', 'Only.'),
    ('holo2', 'Hi <think>t</think>ans', 't', 'ans', 'Hi t', 'ans'),  # chunk-dependent
    ('holo2', '<think>a<think>b  </think> c', 'a<think>b  ', ' c', 'ab  ', ' c'),  # chunk-dependent
    ('holo2', 'plan \n<tool_call>call', 'plan \n<tool_call>call', None, 'plan \n<tool_call>call', ''),
    ('holo2', '  <think> a  </think>  b  ', ' a  ', '  b  ', '   a  ', '  b  '),  # chunk-dependent
    ('holo2', 'no markers at all', 'no markers at all', None, 'no markers at all', ''),
    ('holo2', '<think>p</think><tool_call>c', 'p', '<tool_call>c', 'p', '<tool_call>c'),  # chunk-dependent
    ('holo2', 'x</think>y</think>z', 'x', 'y</think>z', 'x', 'y</think>z'),
    ('holo2', 'a</think>b<think>c</think>d', 'c', 'd', 'a', 'b<think>c</think>d'),  # chunk-dependent
    ('holo2', '<think>a  </think>', 'a  ', None, 'a  ', ''),  # chunk-dependent
    ('holo2', '<think>  </think>  ', '  ', '  ', '  ', '  '),  # chunk-dependent
    ('mimo', '<think>\nTwo and two.\n</think>\n\nThe answer is 4.', '\nTwo and two.\n', '\n\nThe answer is 4.', '\nTwo and two.\n', '\n\nThe answer is 4.'),
    ('mimo', 'Two and two.</think>The answer.', 'Two and two.', 'The answer.', 'Two and two.', 'The answer.'),
    ('mimo', '<think>never closed  \n', 'never closed  \n', None, 'never closed  \n', ''),
    ('mimo', '<think></think>Only.', None, 'Only.', '', 'Only.'),
    ('mimo', 'Hi <think>t</think>ans', 'Hi t', 'ans', 'Hi t', 'ans'),
    ('mimo', '<think>a<think>b  </think> c', 'ab  ', ' c', 'ab  ', ' c'),
    ('mimo', 'plan \n<tool_call>call', 'plan \n', '<tool_call>call', 'plan \n', '<tool_call>call'),
    ('mimo', '  <think> a  </think>  b  ', '   a  ', '  b  ', '   a  ', '  b  '),
    ('mimo', 'no markers at all', 'no markers at all', None, 'no markers at all', ''),
    ('mimo', '<think>p</think><tool_call>c', 'p', '<tool_call>c', 'p', '<tool_call>c'),
    ('mimo', 'x</think>y</think>z', 'x', 'yz', 'x', 'y</think>z'),  # chunk-dependent
    ('mimo', 'a</think>b<think>c</think>d', 'a', 'b<think>cd', 'a', 'b<think>c</think>d'),
    ('mimo', '<think>a  </think>', 'a  ', None, 'a  ', ''),
    ('mimo', '<think>  </think>  ', '  ', '  ', '  ', '  '),
    ('nemotron_v3', '<think>\nTwo and two.\n</think>\n\nThe answer is 4.', '\nTwo and two.', '\n\nThe answer is 4.', '\nTwo and two.', '\n\nThe answer is 4.'),
    ('nemotron_v3', 'Two and two.</think>The answer.', 'Two and two.', 'The answer.', 'Two and two.', 'The answer.'),
    ('nemotron_v3', '<think>never closed  \n', 'never closed', None, 'never closed', ''),
    ('nemotron_v3', '<think></think>Only.', None, 'Only.', '', 'Only.'),
    ('nemotron_v3', 'Hi <think>t</think>ans', 'Hi t', 'ans', 'Hi t', 'ans'),
    ('nemotron_v3', '<think>a<think>b  </think> c', 'ab', ' c', 'ab', ' c'),
    ('nemotron_v3', 'plan \n<tool_call>call', 'plan', '<tool_call>call', 'plan', '<tool_call>call'),
    ('nemotron_v3', '  <think> a  </think>  b  ', '   a', '  b  ', '   a', '  b  '),
    ('nemotron_v3', 'no markers at all', 'no markers at all', None, 'no markers at all', ''),
    ('nemotron_v3', '<think>p</think><tool_call>c', 'p', '<tool_call>c', 'p', '<tool_call>c'),
    ('nemotron_v3', 'x</think>y</think>z', 'x', 'yz', 'x', 'y</think>z'),  # chunk-dependent
    ('nemotron_v3', 'a</think>b<think>c</think>d', 'a', 'b<think>cd', 'a', 'b<think>c</think>d'),
    ('nemotron_v3', '<think>a  </think>', 'a', None, 'a', ''),
    ('nemotron_v3', '<think>  </think>  ', None, '  ', '', '  '),
    ('step3p5', '<think>\nTwo and two.\n</think>\n\nThe answer is 4.', '\nTwo and two.', '\n\nThe answer is 4.', '\nTwo and two.', '\n\nThe answer is 4.'),
    ('step3p5', 'Two and two.</think>The answer.', 'Two and two.', 'The answer.', 'Two and two.', 'The answer.'),
    ('step3p5', '<think>never closed  \n', 'never closed', None, 'never closed', ''),
    ('step3p5', '<think></think>Only.', None, 'Only.', '', 'Only.'),
    ('step3p5', 'Hi <think>t</think>ans', 'Hi t', 'ans', 'Hi t', 'ans'),
    ('step3p5', '<think>a<think>b  </think> c', 'ab', ' c', 'ab', ' c'),
    ('step3p5', 'plan \n<tool_call>call', 'plan', '<tool_call>call', 'plan', '<tool_call>call'),
    ('step3p5', '  <think> a  </think>  b  ', '   a', '  b  ', '   a', '  b  '),
    ('step3p5', 'no markers at all', 'no markers at all', None, 'no markers at all', ''),
    ('step3p5', '<think>p</think><tool_call>c', 'p', '<tool_call>c', 'p', '<tool_call>c'),
    ('step3p5', 'x</think>y</think>z', 'x', 'yz', 'x', 'y</think>z'),  # chunk-dependent
    ('step3p5', 'a</think>b<think>c</think>d', 'a', 'b<think>cd', 'a', 'b<think>c</think>d'),
    ('step3p5', '<think>a  </think>', 'a', None, 'a', ''),
    ('step3p5', '<think>  </think>  ', None, '  ', '', '  '),
]  # fmt: skip

# Where vLLM's whole and streamed splits differ, aioserve splits a whole answer as vLLM
# streams it, as for the parsers before these: a stray end marker after the reasoning
# ended is content; text before a start marker stays where the stream puts it; a start
# marker inside the reasoning is dropped (granite's streaming sees its marker only where
# it opens the answer, its whole parse anywhere).
WHOLE_AS_STREAMED = {
    ('granite', 'Hi Here is my thought process:tHere is my response:ans'),
    ('granite', '  Here is my thought process: a Here is my response: b '),
    ('ernie45', 'Hi <think>t</think>ans'),
    ('ernie45', '<think>a<think>b  </think> c'),
    ('ernie45', 'a</think>b<think>c</think>d'),
    ('holo2', 'Hi <think>t</think>ans'),
    ('holo2', '<think>a<think>b  </think> c'),
    ('holo2', 'a</think>b<think>c</think>d'),
    *((parser, 'x</think>y</think>z') for parser in ('glm47', 'ling3', 'mimo', 'nemotron_v3', 'step3p5')),
    *((parser, 'a</think>b<think>c</think>d') for parser in ('glm47', 'ling3', 'mimo', 'nemotron_v3', 'step3p5')),
}  # fmt: skip

# Where vLLM's one-token stream depends on where the tokens are cut, aioserve streams as
# vLLM splits the whole answer: granite's stream gives the ':' of "Here is my response:"
# to the content when that marker is glued to the word before it; olmo3's drops or moves
# text around a <think> that is not where the answer opens; whitespace before a leading
# <think> (holo2 and ernie45 are deepseek_r1's parser, whose split aioserve's deepseek_r1
# already follows).
STREAMED_AS_WHOLE = {
    ('granite', 'Here is my thought process:Here is my response:Only.'),
    ('granite', 'Here is my thought process:aHere is my response:b'),
    ('olmo3', 'Hi <think>t</think>ans'),
    ('olmo3', '<think>a<think>b  </think> c'),
    ('olmo3', '  <think> a  </think>  b  '),
    ('ernie45', '  <think> a  </think>  b  '),
    ('holo2', '  <think> a  </think>  b  '),
}  # fmt: skip

# hunyuan_a13b, spelled out: (whole reasoning, whole content, streamed reasoning, content).
# Its whole parse knows one spelling of each marker and its stream two; aioserve takes both
# spellings whole and streamed, and cuts a whole answer's content at its `\n</answer>` as
# vLLM's whole parse does. vLLM's stream matches the markers token by token, so that a
# newline that breaks one is passed on with it (the marker then found is the one without
# its newline), and it never gives what it held back for a marker that did not come;
# aioserve matches the text, and gives what it held at the end.
DEPARTURES = {
    ('hunyuan_a13b', 'Hi <think>\nt\n</think>\n<answer>\nans\n</answer>'): ('t', 'Hi ans', 't', 'Hi ans\n</answer>'),
    ('hunyuan_a13b', '<think>\n\nfast\n</think>\n<answer>\nx\n</answer>'): ('fast', 'x', 'fast', 'x\n</answer>'),
    ('hunyuan_a13b', '<think>\na</think>\n<answer>\nb\n</answer>'): ('a', 'b', 'a', 'b\n</answer>'),
    ('hunyuan_a13b', '<think>\na\n\nb\n\n</think>\n<answer>\n\nc\n\n</answer>'): ('a\n\nb\n', '\nc\n', 'a\n\nb\n', '\nc\n\n</answer>'),
    ('hunyuan_a13b', '<think>\na\n'): (None, '<think>\na\n', 'a\n', ''),
}  # fmt: skip


@pytest.mark.parametrize(
    ("parser", "answer", "reasoning", "content", "streamed_reasoning", "streamed_content"),
    VLLM_SPLITS,
)
def test_the_split_is_vllms(
    parser, answer, reasoning, content, streamed_reasoning, streamed_content
):
    key = (parser, answer)
    if key in WHOLE_AS_STREAMED:
        reasoning, content = streamed_reasoning or None, streamed_content or None
    if key in STREAMED_AS_WHOLE:
        streamed_reasoning, streamed_content = reasoning or "", content or ""
    if key in DEPARTURES:
        reasoning, content, streamed_reasoning, streamed_content = DEPARTURES[key]
    assert split_whole(ReasoningSplitter(parser), answer) == (reasoning, content)
    for pieces in chunkings(answer):
        assert streamed(parser, pieces) == (streamed_reasoning, streamed_content), pieces


def test_every_departure_is_a_row():
    rows = {(parser, answer) for parser, answer, *_ in VLLM_SPLITS}
    assert WHOLE_AS_STREAMED | STREAMED_AS_WHOLE | DEPARTURES.keys() <= rows


# (parser, chat_template_kwargs, answer, vLLM whole (reasoning, content), streamed).
# vLLM's stream of an answer that does not think drops the markers that are special tokens
# (aioserve keeps them as text: test_reasoning_parsers.py), so those rows give its whole.
VLLM_SWITCHES = [
    ('glm47', {'thinking': False}, '<think>x</think>y', (None, '<think>x</think>y')),
    ('glm47', {'enable_thinking': False}, 'x y', (None, 'x y')),
    ('glm47', {'thinking': False, 'enable_thinking': True}, '<think>x</think>  ', ('x', '  ')),
    ('ling3', {'thinking': False}, '<think>x</think>y', (None, '<think>x</think>y')),
    ('ling3', {'enable_thinking': False}, '<think>x y  ', (None, '<think>x y  ')),
    ('holo2', {'thinking': False}, '<think>x</think>y', (None, '<think>x</think>y')),
    ('holo2', {'enable_thinking': False}, 'x</think>', (None, 'x</think>')),
    ('holo2', {'thinking': True}, '<think>x y  ', ('x y  ', None)),
    ('holo2', {}, '', ('', None)),
    ('mimo', {'enable_thinking': False}, '<think>x</think>y', (None, '<think>x</think>y')),
    ('mimo', {'thinking': False}, '<think>x</think>  ', ('x', '  ')),  # mimo reads enable_thinking only
    ('step3p5', {'enable_thinking': False}, '<think>x y  ', ('x y', None)),  # always thinks
    ('olmo3', {'enable_thinking': False}, '<think>x</think>y', ('x', 'y')),
    ('ernie45', {'enable_thinking': False}, 'x</think>', ('x', None)),
    ('nemotron_v3', {'enable_thinking': False}, '<think>x</think>y', (None, '<think>x</think>y')),
    ('nemotron_v3', {'enable_thinking': False}, '', ('', None)),
    ('nemotron_v3', {'force_nonempty_content': False}, '<think>x y  ', ('x y', None)),
]  # fmt: skip


@pytest.mark.parametrize(("parser", "kwargs", "answer", "whole"), VLLM_SWITCHES)
def test_chat_template_kwargs_switch_the_reasoning(parser, kwargs, answer, whole):
    assert split_whole(ReasoningSplitter(parser, kwargs), answer) == whole
    for pieces in chunkings(answer):
        assert streamed(parser, pieces, kwargs) == (whole[0] or "", whole[1] or ""), pieces


# nemotron_v3 with force_nonempty_content (or enable_thinking false): an answer without
# content has its reasoning as content; whole, the two swap where the content is empty or
# blank; streamed, a reasoning that never ended comes again as content at the end, with
# the trailing whitespace the reasoning dropped. (parser, answer, vLLM whole, streamed)
VLLM_FORCED = [
    ('<think>x</think>y', ('x', 'y'), ('x', 'y')),
    ('x y', (None, 'x y'), ('x y', 'x y')),
    ('<think>x y  ', (None, 'x y'), ('x y', 'x y  ')),
    ('<think>x</think>  ', ('  ', 'x'), ('x', '  ')),
    ('x</think>', (None, 'x'), ('x', '')),
    ('', (None, None), ('', '')),
]  # fmt: skip


@pytest.mark.parametrize(("answer", "whole", "streamed_split"), VLLM_FORCED)
def test_nemotron_v3_can_force_its_reasoning_into_the_content(answer, whole, streamed_split):
    kwargs = {"force_nonempty_content": True}
    assert split_whole(ReasoningSplitter("nemotron_v3", kwargs), answer) == whole
    for pieces in chunkings(answer):
        assert streamed("nemotron_v3", pieces, kwargs) == streamed_split, pieces


# (parser, rendered prompt, whether vLLM's is_reasoning_end sees the reasoning closed)
VLLM_PROMPTS = [
    ('ernie45', '<|im_start|>assistant\n<think>', False),
    ('ernie45', '<|im_start|>assistant\n<think></think>', True),
    ('ernie45', '<think>a</think><|im_end|><|im_start|>assistant\n', True),
    ('ernie45', '<think>a</think>b<think>', False),
    ('glm47', '<|im_start|>assistant\n<think></think>', True),
    ('glm47', '<think>a</think><|im_end|><|im_start|>assistant\n', True),
    ('glm47', '<think>a</think><|user|>hi<|assistant|>', False),
    ('ling3', '<|im_start|>assistant\n<think></think>', True),
    ('ling3', '<think>a</think><|user|>hi<|assistant|>', False),
    ('ling3', '<|user|>hi<|assistant|><think>', False),
    ('holo2', '<|im_start|>assistant\n<think></think>', True),
    ('holo2', '<think>a</think><|im_end|><|im_start|>assistant\n', True),
    ('holo2', '<think>a</think>b<think>', False),
    ('mimo', '<|im_start|>assistant\n<think></think>', True),
    ('mimo', '<think>a</think><|im_end|><|im_start|>assistant\n', False),
    ('mimo', '<think>a</think><|user|>hi<|assistant|>', True),
    ('nemotron_v3', '<|im_start|>assistant\n<think></think>', True),
    ('nemotron_v3', '<think>a</think><|im_end|><|im_start|>assistant\n', False),
    ('step3p5', '<|im_start|>assistant\n<think></think>', True),
    ('step3p5', '<think>a</think><|im_end|><|im_start|>assistant\n', False),
    ('step3p5', '<|im_start|>assistant\n<think>', False),
    ('olmo3', '<|im_start|>assistant\n<think>', False),
    ('olmo3', '<think>a</think><|im_end|><|im_start|>assistant\n', True),
    ('olmo3', '<think>a</think>b<think>', True),  # any </think> in the prompt
    ('olmo3', 'assistant:', False),
    ('granite', 'Here is my thought process: a Here is my response:', False),  # never
    ('granite', '<think>a</think><|im_end|><|im_start|>assistant\n', False),
    ('hunyuan_a13b', '<think>\na\n</think>\n<answer>\nb\n</answer>', False),  # never
    ('hunyuan_a13b', 'assistant:', False),
]  # fmt: skip


@pytest.mark.parametrize(("parser", "prompt", "closed"), VLLM_PROMPTS)
def test_a_prompt_that_closed_the_reasoning_is_seen_as_vllm_sees_it(parser, prompt, closed):
    assert reasoning_closed(parser, prompt) is closed


@pytest.mark.parametrize(
    "prompt",
    ["<|im_start|>assistant\n<think></think>", "<think>a</think><|user|>hi<|assistant|>"],
)
def test_olmo3_sees_an_end_marker_that_vllms_tokens_hide(prompt):
    """vLLM's olmo3 looks for `</think>` as the tokens "</", "think", ">": where the text
    around it glues a "<" or ">" to them ("></", "><"), it sees no end (its
    is_reasoning_end gave False on both). aioserve reads the text."""
    assert reasoning_closed("olmo3", prompt)


@pytest.mark.parametrize(
    ("parser", "markers"),
    [
        ("granite", ("", "")),  # vLLM's parser names none
        ("hunyuan_a13b", ("", "")),
        ("olmo3", ("<think>", "</think>")),
        ("ernie45", ("<think>", "</think>")),
        *((p, ("<think>", "</think>")) for p in ("glm47", "ling3", "holo2", "mimo")),
        *((p, ("<think>", "</think>")) for p in ("nemotron_v3", "step3p5")),
    ],
)
def test_the_thinking_budget_takes_vllms_markers(parser, markers):
    """vLLM's reasoning_start_str and reasoning_end_str for each parser."""
    assert budget_markers(parser) == markers


def test_the_parsers_named_are_those_implemented():
    """--reasoning-parser takes the parsers with a spec; vLLM's others are refused by name."""
    assert set(REASONING_PARSERS) == set(SPECS)
    assert not set(REASONING_PARSERS) & set(VLLM_OTHER_REASONING_PARSERS)
    assert len(set(REASONING_PARSERS)) == len(REASONING_PARSERS)


def test_reasoning_tokens_of_a_whole_answer_left_as_content_are_none():
    """olmo3's whole answer that never closes its reasoning is all content: none of its
    tokens count as reasoning."""
    splitter = ReasoningSplitter("olmo3")
    assert split_whole(splitter, "<think>never closed") == (None, "<think>never closed")
    assert splitter.reasoning_end_at == 0


def test_through_the_server(parsed_by, openai_server):  # noqa: F811
    """The default model writes no markers: granite and hunyuan_a13b wait for a start
    that never comes (all content); olmo3's reasoning never ends, which its whole answer
    gives as content and its stream as reasoning, as vLLM's do."""
    plain = answer(openai_server)["content"]
    for parser in ("granite", "hunyuan_a13b"):
        url = parsed_by(parser)
        message = answer(url)
        assert (message["reasoning"], message["content"]) == (None, plain), parser
        assert streamed_fields(url) == ("", plain), parser
    url = parsed_by("olmo3")
    message = answer(url)
    assert (message["reasoning"], message["content"]) == (None, plain)
    assert streamed_fields(url) == (plain, "")


@pytest.mark.parametrize(
    ("parser", "marker"),
    [("granite", "Here is my response:"), ("hunyuan_a13b", "\n</think>\n<answer>\n"),
     ("mistral", "[/THINK]"), ("olmo3", "</think>")],
)  # fmt: skip
def test_the_generate_routes_constraint_waits_for_the_parsers_own_end(parser, marker):
    """/inference/v1/generate with `reasoning_ended: false`: the structured output starts
    after the parser's end marker (vLLM's reasoning parser decides the end)."""
    from types import SimpleNamespace

    from aioserve.server.generate_request import _reasoning_end

    settings = SimpleNamespace(
        reasoning_parser=parser, structured_outputs=SimpleNamespace(enable_in_reasoning=False)
    )
    state = SimpleNamespace(engine=SimpleNamespace(settings=settings, tokenizer=None))
    params = SimpleNamespace(structured_outputs=object())
    assert _reasoning_end(state, {"reasoning_ended": False}, params, []) == marker
