"""Prompts whose answers copy much of the prompt, for speculative decoding's benchmarks.

Each asks to rewrite one function of Python's standard library (its source as this Python
has it) with type hints, as one JSON line {"prompt": ...} of a `vllm bench serve
--dataset-name custom` file: the answer repeats most of the function, which is what an
n-gram lookup drafts from (engine/speculation.py).

    python bench/copying_prompts.py > /tmp/copying.jsonl
"""

from __future__ import annotations

import inspect
import json
import shlex
import string
import textwrap

FUNCTIONS = [
    textwrap.dedent,
    textwrap.indent,
    textwrap.shorten,
    textwrap.TextWrapper._split_chunks,
    textwrap.TextWrapper._fix_sentence_endings,
    textwrap.TextWrapper._handle_long_word,
    string.capwords,
    string.Formatter.vformat,
    string.Formatter.get_field,
    string.Formatter.convert_field,
    string.Template.substitute,
    shlex.quote,
    shlex.split,
    shlex.join,
    json.JSONEncoder.encode,
    inspect.cleandoc,
]


def prompts() -> list[str]:
    return [
        "Rewrite this Python function with type hints. Reply with the whole function only.\n\n"
        f"```python\n{inspect.getsource(function)}```"
        for function in FUNCTIONS
    ]


if __name__ == "__main__":
    for prompt in prompts():
        print(json.dumps({"prompt": prompt}))
