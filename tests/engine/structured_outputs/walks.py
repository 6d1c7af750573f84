"""Random walks through a matcher on SmolLM2's tokenizer: the structured-output tests'
way of drawing outputs that a constraint allows without running a model.

From each mask draw an allowed token (seeded), advance, and stop on EOS; the decoded
text is then checked by an independent reader of the constraint (`re.fullmatch`,
`jsonschema`, `lark`).
"""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest

VOCAB = 49152


def allowed(words: np.ndarray) -> np.ndarray:
    """The token ids a bitmask row allows."""
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:VOCAB])


@functools.cache
def _blank_tokens(tokenizer) -> np.ndarray:
    """Whether each token of the vocabulary decodes to whitespace alone."""
    return np.array([not tokenizer.decode([t]).strip() for t in range(VOCAB)])


def random_walk(
    compiler, tokenizer, constraint, seed: int, limit: int = 120, prefix: str = "",
    skip_blanks: bool = False,
) -> str:  # fmt: skip
    """The text of a seeded walk through `constraint`'s matcher, after `prefix`'s tokens
    (each of which must be allowed). With `skip_blanks`, whitespace tokens are drawn only
    when nothing else is allowed: xgrammar's JSON allows any whitespace, and the hundreds
    of whitespace tokens would otherwise fill the walk."""
    matcher = compiler.new_matcher(constraint)
    rng = random.Random(seed)
    words = np.zeros(-(-VOCAB // 32), dtype=np.int32)
    tokens = tokenizer.encode(prefix, add_special_tokens=False) if prefix else []
    for token in tokens:
        matcher.fill_bitmask(words)
        assert token in allowed(words), f"{tokenizer.decode([token])!r} of the prefix is masked"
        assert matcher.accept(token)
    for _ in range(limit):
        matcher.fill_bitmask(words)
        choices = allowed(words)
        assert choices.size, "the matcher allows nothing before the end"
        if skip_blanks and not _blank_tokens(tokenizer)[choices].all():
            choices = choices[~_blank_tokens(tokenizer)[choices]]
        # Prefer ending once allowed half the time, so that walks stay short.
        eos = tokenizer.eos_token_id
        if eos in choices and rng.random() < 0.5:
            token = eos
        else:
            token = int(rng.choice(choices.tolist()))
        assert matcher.accept(token)
        if token == eos:
            return tokenizer.decode(tokens)
        tokens.append(token)
    pytest.fail(f"no EOS after {limit} tokens: {tokenizer.decode(tokens)!r}")
