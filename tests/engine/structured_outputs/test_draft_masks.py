"""The masks of a constrained sequence with drafts (speculative decoding): row j + 1 must be
the mask of a matcher that took the drafts before it, for both backends and bad words
around them, on the real tokenizer; the rows after a refused draft allow every token; and
the matcher is left where it was, as a fresh one fed the same tokens is.

The reference for each row is an independent matcher (a new one from the same compiled
constraint) fed the sequence's tokens and the drafts before the row, token by token.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest

from aioserve.engine.bad_words import BadWordsMatcher
from aioserve.engine.scheduler import ScheduledChunk, SchedulerOutput
from aioserve.engine.structured_outputs import StructuredOutputsParams as Constraint
from aioserve.engine.structured_outputs.compiler import StructuredOutputCompiler
from aioserve.engine.structured_outputs.params import StructuredOutputsConfig
from aioserve.engine.structured_outputs.step_masks import StepMasks, allows, fill_draft_rows
from aioserve.runner.step_plan import StepPlan

VOCAB = 49152
WORDS = -(-VOCAB // 32)
MAX_DRAFTS = 6
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json-outlines": Constraint(json=PERSON),
    "json-guidance": Constraint(json=PERSON, backend="guidance"),
    "regex-outlines": Constraint(regex=r"[a-z]{3,9}( [a-z]{3,9}){9,12}"),
    "grammar-guidance": Constraint(grammar='start: "SELECT " NAME ", " NAME ", " NAME " FROM "'
                                   ' NAME ";"\nNAME: /[a-z]{2,6}/'),
    "json-xgrammar": Constraint(json=PERSON, backend="xgrammar"),
    "tag-guidance": Constraint(structural_tag={
        "structures": [{"begin": "<f>", "schema": PERSON, "end": "</f>"}], "triggers": ["<f>"],
    }),
}  # fmt: skip


@pytest.fixture(scope="module")
def compiler(tokenizer) -> StructuredOutputCompiler:
    return StructuredOutputCompiler(tokenizer, VOCAB, StructuredOutputsConfig(), MAX_DRAFTS)


def mask_of(matcher) -> np.ndarray:
    words = np.zeros(WORDS, dtype=np.int32)
    matcher.fill_bitmask(words)
    return words


def allowed_tokens(words: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:VOCAB])


def walk(compiler, constraint: Constraint, eos: int, seed: int, length: int) -> list[int]:
    """`length` tokens the constraint allows in a row (no EOS), drawn at random."""
    matcher = compiler.new_matcher(constraint)
    rng = random.Random(seed)
    tokens: list[int] = []
    while len(tokens) < length:
        choices = [t for t in allowed_tokens(mask_of(matcher)).tolist() if t != eos]
        if not choices:
            break
        tokens.append(rng.choice(choices))
        assert matcher.accept(tokens[-1])
    return tokens


def reference_matcher(compiler, constraint: Constraint, bad_words, tokens: list[int]):
    matcher = compiler.new_matcher(constraint)
    if bad_words:
        matcher = BadWordsMatcher(bad_words, matcher, MAX_DRAFTS)
    for token in tokens:
        assert matcher.accept(token)
    return matcher


@pytest.mark.parametrize("with_bad_words", [False, True], ids=["plain", "bad-words"])
@pytest.mark.parametrize("name", CONSTRAINTS)
@pytest.mark.parametrize("seed", range(3))
def test_each_row_is_the_mask_after_the_drafts_before_it(
    compiler, tokenizer, name, with_bad_words, seed
):
    constraint = CONSTRAINTS[name]
    eos = tokenizer.eos_token_id
    path = walk(compiler, constraint, eos, seed, 4 + MAX_DRAFTS)
    assert len(path) == 4 + MAX_DRAFTS
    done, drafts = path[:4], path[4 : 4 + MAX_DRAFTS]
    refused_at = None
    if seed == 1:  # a draft the constraint refuses, in the middle
        refused_at = 2
        allowed_there = set(allowed_tokens(mask_of(
            reference_matcher(compiler, constraint, None, done + drafts[:2])
        )).tolist())  # fmt: skip
        drafts[2] = next(t for t in range(VOCAB) if t not in allowed_there and t != eos)
    # A ban on a path token after its predecessor, where one fits: drafts past it refused.
    bad_words = [[drafts[0], drafts[1]]] if with_bad_words else None
    if with_bad_words:
        refused_at = 1
    matcher = reference_matcher(compiler, constraint, bad_words, done)
    before = mask_of(matcher)

    rows = np.zeros((1 + len(drafts), WORDS), dtype=np.int32)
    rows[0] = mask_of(matcher)
    fill_draft_rows(matcher, rows, drafts)

    last_live = len(drafts) if refused_at is None else refused_at
    dead_end = False
    for j in range(last_live + 1):
        expected = mask_of(reference_matcher(compiler, constraint, bad_words, done + drafts[:j]))
        dead_end = not expected.any()
        if dead_end:  # after the drafts, a dead end allows every token
            expected.fill(-1)
            last_live = j
        np.testing.assert_array_equal(rows[j], expected, err_msg=f"row {j}")
        if dead_end:
            break
    assert (rows[last_live + 1 :] == -1).all()
    if refused_at is not None and not dead_end:
        assert not allows(rows[refused_at], drafts[refused_at])
    # Rolled back: the matcher allows what it allowed, and goes on as a fresh one does.
    np.testing.assert_array_equal(mask_of(matcher), before)
    kept = drafts[: min(2, last_live)]
    for token in kept:
        assert matcher.accept(token)
    expected = mask_of(reference_matcher(compiler, constraint, bad_words, done + kept))
    np.testing.assert_array_equal(mask_of(matcher), expected)


def test_allows_reads_bit_t_of_the_row():
    words = np.zeros(4, dtype=np.int32)
    words.view(np.uint32)[1] = np.uint32(1 << 31)  # token 63
    words[3] = 1  # token 96
    assert [t for t in range(128) if allows(words, t)] == [63, 96]


# --- the rows of a step -------------------------------------------------------------------------


@dataclass
class Sequence:
    """A stand-in request: what StepMasks reads of one."""

    request_id: str
    matcher: object | None
    reasoning_gate: object | None = None
    status: object = field(default_factory=lambda: _Running())


class _Running:
    is_finished = False


class Allowing:
    """A matcher over a 64-token vocabulary that allows `tokens` and the successor of each
    token it took (so that each row shows the drafts before it), and rolls back."""

    def __init__(self, tokens: set[int]) -> None:
        self.taken: list[int] = []
        self.tokens = tokens

    def fill_bitmask(self, words: np.ndarray) -> None:
        words.fill(0)
        for t in self.tokens | {t + 1 for t in self.taken}:
            words.view(np.uint32)[t // 32] |= np.uint32(1 << (t % 32))

    def accept(self, token_id: int) -> bool:
        self.taken.append(token_id)
        return True

    def rollback(self, num_tokens: int) -> None:
        del self.taken[len(self.taken) - num_tokens :]


def test_a_step_has_one_row_a_position_of_each_constrained_chunk():
    constrained = Sequence("b", Allowing({1, 5}))
    chunks = [
        ScheduledChunk(Sequence("a", None), 10, 3, samples=True, drafts=[1, 2]),  # rows 0-2
        ScheduledChunk(Sequence("p", None), 0, 16, samples=False),  # a prompt chunk: no row
        ScheduledChunk(constrained, 20, 4, samples=True, drafts=[5, 6, 9]),  # rows 3-6
        ScheduledChunk(Sequence("c", Allowing({3, 40})), 30, 1, samples=True),  # row 7
    ]
    output = SchedulerOutput(chunks, plan=StepPlan([], [], []))
    masks = StepMasks.plan(output, 64)
    assert output.plan.token_bitmask is masks.bitmask
    assert masks.bitmask.rows.tolist() == [3, 4, 5, 6, 7]
    assert masks.fill() == []
    rows = [set(allowed_tokens(words).tolist()) for words in masks.bitmask.words]
    # Draft 9 is refused by its row: the row after it allows every token.
    assert rows[:3] == [{1, 5}, {1, 5, 6}, {1, 5, 6, 7}]
    assert rows[3] == set(range(64))
    assert rows[4] == {3, 40}
    assert constrained.matcher.taken == []  # rolled back
