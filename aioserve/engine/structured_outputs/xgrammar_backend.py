"""The xgrammar backend: vLLM's default, here for a request or server that asks for
`xgrammar` by name, and for xgrammar's form of structural tags (which only it reads).
aioserve's `auto` prefers outlines and guidance for the rest (compiler.py).

xgrammar compiles a constraint (a JSON schema, EBNF or Lark grammar, regex or structural
tag) against the tokenizer once (the compiler caches it), then a matcher per sequence
computes each step's mask from its state, with a cache of the tokens every state allows.
What it is given follows vLLM's xgrammar backend:

- a JSON schema with any whitespace between tokens (`any_whitespace`), unless
  `disable_any_whitespace`, where the separators are "," and ":" with none around them;
  extra properties are refused where a schema says nothing of them (xgrammar's strict
  mode). `whitespace_pattern` is outlines' and guidance's option: refused here.
- choices as an EBNF grammar of their literals; a grammar as Lark when no line holds
  `::=`, else as EBNF (vLLM's test); a regex as it is.

A schema keyword xgrammar would ignore (json_schemas.keyword_xgrammar_ignores) is refused
by name, where vLLM's `auto` would fall back to guidance.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np
import torch
import xgrammar
from transformers import PreTrainedTokenizerBase

from aioserve.engine.structured_outputs.structural_tags import tagged_structures, uses_triggers


class XgrammarCompiler:
    """xgrammar's compiler for one tokenizer (its vocabulary read once, ~0.2 s)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # aioserve's compiler caches what it compiles, and compiles on one thread.
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, kind: str, spec: str, any_whitespace: bool) -> XgrammarGrammar:
        """The compiled constraint (ValueError with xgrammar's message when it refuses it)."""
        try:
            return XgrammarGrammar(self._compile(kind, spec, any_whitespace))
        except (RuntimeError, ValueError, TypeError) as error:  # xgrammar's errors
            raise ValueError(str(error).strip().splitlines()[0]) from None

    def _compile(self, kind: str, spec: str, any_whitespace: bool) -> xgrammar.CompiledGrammar:
        compiler = self._compiler
        if kind in ("json", "json_object"):
            schema = spec if kind == "json" else '{"type": "object"}'
            separators = None if any_whitespace else (",", ":")
            return compiler.compile_json_schema(
                schema, any_whitespace=any_whitespace, separators=separators
            )
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(json.loads(spec)))
        if kind == "grammar":
            if is_lark(spec):
                return compiler.compile_lark(spec)
            return compiler.compile_grammar(spec)
        if kind == "regex":
            if "\x00" in spec:
                raise ValueError("a regex must not hold a NUL character ('\\x00')")
            return compiler.compile_regex(spec)
        tag = json.loads(spec)
        if uses_triggers(tag):
            items = [
                xgrammar.StructuralTagItem(
                    begin=structure.begin, schema=json.dumps(structure.schema), end=structure.end
                )
                for structure in tagged_structures(tag)
            ]
            return compiler.compile_structural_tag(items, tag["triggers"])
        return compiler.compile_structural_tag(spec)


@dataclass(frozen=True)
class XgrammarGrammar:
    compiled: xgrammar.CompiledGrammar

    def new_matcher(self, max_rollback: int) -> XgrammarMatcher:
        # -1: xgrammar keeps every state, so any rollback is allowed.
        matcher = xgrammar.GrammarMatcher(self.compiled, max_rollback_tokens=-1)
        return XgrammarMatcher(matcher, self.compiled.tokenizer_info.stop_token_ids)


class XgrammarMatcher:
    """A sequence's xgrammar matcher. Once it has accepted a stop token (the constraint has
    ended) it allows stop tokens alone, as the other backends' matchers do, where xgrammar
    itself refuses to be asked again: a request with ignore_eos goes on after its EOS."""

    def __init__(self, matcher: xgrammar.GrammarMatcher, stop_token_ids: list[int]) -> None:
        self._matcher = matcher
        self._stop_token_ids = frozenset(stop_token_ids)
        self._after_end: int | None = None  # tokens accepted after the stop token

    def fill_bitmask(self, words: np.ndarray) -> None:
        if self._after_end is None:
            # xgrammar writes into a torch tensor; this one is a view of the row.
            self._matcher.fill_next_token_bitmask(torch.from_numpy(words).view(1, -1), 0)
            return
        words.fill(0)
        bits = words.view(np.uint32)
        for token_id in self._stop_token_ids:
            bits[token_id // 32] |= np.uint32(1 << (token_id % 32))

    def accept(self, token_id: int) -> bool:
        if self._after_end is not None:
            self._after_end += 1
            return token_id in self._stop_token_ids
        accepted = self._matcher.accept_token(token_id)
        if accepted and self._matcher.is_terminated():
            self._after_end = 0
        return accepted

    def rollback(self, num_tokens: int) -> None:
        if self._after_end is not None:
            # Drafts follow the stop token only under ignore_eos; never the stop token itself.
            self._after_end -= num_tokens
            return
        self._matcher.rollback(num_tokens)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices`."""
    return "root ::= " + " | ".join(f'"{_ebnf_literal(choice)}"' for choice in choices)


def is_lark(grammar: str) -> bool:
    """vLLM's test: a grammar is Lark unless a line (comments aside) defines a rule with
    EBNF's `::=`."""
    lines = (re.sub(r"(#|//).*$", "", line) for line in grammar.split("\n"))
    return not any("::=" in line for line in lines)


_EBNF_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _ebnf_literal(text: str) -> str:
    return "".join(_ebnf_char(char) for char in text)


def _ebnf_char(char: str) -> str:
    if char in _EBNF_ESCAPES:
        return _EBNF_ESCAPES[char]
    if ord(char) < 0x20 or ord(char) == 0x7F:
        return f"\\u{ord(char):04x}"
    return char
