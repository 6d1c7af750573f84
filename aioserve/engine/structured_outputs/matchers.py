"""Two of the structured-output backends (xgrammar_backend.py holds the third), and the
matcher each gives a request.

- **outlines** (`outlines_core`): a regex, or a JSON schema turned into one, compiled to an
  index of every token allowed in every state of its automaton. Compiling takes a while
  (0.1 s to seconds, once per constraint: the compiler caches it); a step's mask is then a
  copy out of the index, ~6 µs a row.
- **guidance** (`llguidance`, which outlines itself uses for context-free grammars):
  grammars (Lark or GBNF), JSON schemas beyond what outlines' regexes enforce (numeric
  bounds, ...), any JSON object and structural tags of the trigger form
  (structural_tags.py). Nothing to compile ahead; each mask is computed from
  the parser's state, ~40 µs a row.

A matcher follows one sequence: `fill_bitmask` writes the tokens allowed next into one row
of the sampler's bitmask (bit t % 32 of int32 word t // 32, token_bitmask.py), `accept`
advances it by the token sampled, `rollback` takes back its last accepted tokens (a
speculative step's masks follow its drafts, then return: step_masks.py). Both backends
know a token by its bytes, read once from the tokenizer (`TokenBytes`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

import llguidance
import llguidance.hf
import numpy as np
import outlines_core
from outlines_core.json_schema import build_regex_from_schema
from transformers import PreTrainedTokenizerBase

from aioserve.engine.structured_outputs.structural_tags import TaggedStructure


class Matcher(Protocol):
    def fill_bitmask(self, words: np.ndarray) -> None:
        """Write the tokens allowed next into `words` (int32, one bitmask row)."""

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False when the constraint does not allow it."""

    def rollback(self, num_tokens: int) -> None:
        """Take back the last `num_tokens` accepted tokens (none of them EOS)."""


class TokenBytes:
    """The tokenizer as the backends need it, built once per tokenizer (~0.4 s)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        self.guidance = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.eos_token_id = self.guidance.eos_token
        token_ids: dict[bytes, list[int]] = {}
        special = []
        for token_id in range(min(vocab_size, len(tokenizer))):
            if self.guidance.is_special_token(token_id):
                special.append(token_id)
            else:
                token_ids.setdefault(self.guidance.decode_bytes([token_id]), []).append(token_id)
        self.outlines = outlines_core.Vocabulary(self.eos_token_id, token_ids)
        # The special tokens' texts, as grammars name them (guidance_tag_grammar).
        self.special_tokens = frozenset(tokenizer.convert_ids_to_tokens(special))


# -- outlines -----------------------------------------------------------------------------------


def json_schema_regex(schema: dict[str, Any], whitespace: str) -> str:
    """The regex outlines makes of a JSON schema (ValueError for one it cannot take)."""
    return build_regex_from_schema(json.dumps(schema), whitespace)


@dataclass(frozen=True)
class OutlinesIndex:
    index: outlines_core.Index
    eos_token_id: int

    @classmethod
    def compile(cls, regex: str, tokens: TokenBytes) -> OutlinesIndex:
        """The index of `regex` (ValueError when the regex is invalid or the vocabulary
        cannot spell it)."""
        return cls(outlines_core.Index(regex, tokens.outlines), tokens.eos_token_id)

    def new_matcher(self, max_rollback: int) -> OutlinesMatcher:
        guide = outlines_core.Guide(self.index, max_rollback=max_rollback)
        return OutlinesMatcher(guide, self.eos_token_id)


class OutlinesMatcher:
    def __init__(self, guide: outlines_core.Guide, eos_token_id: int) -> None:
        self._guide = guide
        self._eos_token_id = eos_token_id

    def fill_bitmask(self, words: np.ndarray) -> None:
        self._guide.write_mask_into(words.ctypes.data, words.size, words.itemsize)

    def accept(self, token_id: int) -> bool:
        # The guide allows EOS in a final state but never advances by it.
        if token_id == self._eos_token_id:
            return self._guide.is_finished()
        try:
            # Without return_tokens=False, advance lists every token allowed next: a Python
            # list of up to the whole vocabulary (1.4 ms a token on SmolLM2's 49,152).
            self._guide.advance(token_id, return_tokens=False)
        except ValueError:
            return False
        return True

    def rollback(self, num_tokens: int) -> None:
        self._guide.rollback_state(num_tokens)


# -- guidance -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GuidanceGrammar:
    grammar: str  # llguidance's serialized grammar
    tokenizer: llguidance.LLTokenizer

    @classmethod
    def compile(cls, grammar: str, tokens: TokenBytes) -> GuidanceGrammar:
        """Checked once here (ValueError with llguidance's message when it is refused)."""
        problem = llguidance.LLMatcher.validate_grammar(grammar, tokens.guidance)
        if problem:
            raise ValueError(problem)
        return cls(grammar, tokens.guidance)

    def new_matcher(self, max_rollback: int) -> GuidanceMatcher:
        # An LLMatcher keeps its whole history: any rollback is allowed.
        return GuidanceMatcher(llguidance.LLMatcher(self.tokenizer, self.grammar))


class GuidanceMatcher:
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def fill_bitmask(self, words: np.ndarray) -> None:
        self._matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)

    def accept(self, token_id: int) -> bool:
        return self._matcher.consume_token(token_id) and not self._matcher.is_error()

    def rollback(self, num_tokens: int) -> None:
        if not self._matcher.rollback(num_tokens):
            raise RuntimeError(self._matcher.get_error())


def guidance_json_grammar(schema: dict[str, Any], whitespace: str) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema), defaults={"whitespace_pattern": whitespace}
    )


def guidance_tag_grammar(
    structures: list[TaggedStructure], whitespace: str, special_tokens: frozenset[str]
) -> str:
    """A structural tag's trigger form in llguidance's Lark: free text (TEXT), in which a
    trigger opens its structure — begin's rest, the JSON (`whitespace` between its tokens),
    end — after which text is free again. A trigger is lazy: the text takes the shortest
    match, so the structure starts as soon as the trigger is written. A trigger or end that
    is one of the tokenizer's `special_tokens` is matched as that token (the model writes it
    as one token, which text never matches)."""

    def piece(text: str) -> str:
        if text in special_tokens:
            return text
        return json.dumps(text) if text else ""

    rules = [
        "%llguidance {}",
        "start: (" + " | ".join(f"tag_{i}" for i in range(len(structures))) + ")* TEXT",
        "TEXT: /(.|\\n)*/",
    ]
    for i, structure in enumerate(structures):
        schema = {**structure.schema, "x-guidance": {"whitespace_pattern": whitespace}}
        rest = structure.begin[len(structure.trigger) :]
        body = f"{piece(rest)} %json {json.dumps(schema)} {piece(structure.end)}"
        if structure.trigger in special_tokens:
            rules.append(f"tag_{i}: TEXT {structure.trigger} {body}")
        else:
            rules.append(f"tag_{i}_trigger[lazy]: TEXT {json.dumps(structure.trigger)}")
            rules.append(f"tag_{i}: tag_{i}_trigger {body}")
    return "\n".join(rules) + "\n"


def guidance_grammar(kind: str, spec: str) -> str:
    """A "grammar" (Lark or GBNF), a "regex" or a "choice" (a JSON list) for llguidance."""
    return llguidance.grammar_from(kind, spec)
