"""runner/thinking_budget.py: the forced end of a thought, against vLLM 0.32's rule written
out plainly over the whole sequence, and the rows the runner masks."""

from __future__ import annotations

import random

import torch

from aioserve.runner.step_plan import NewSequence, SamplingSettings
from aioserve.runner.thinking_budget import ThinkingBudgets, ThinkingMarkers, Thought


def reference_forced_token(tokens: list[int], budget: int, markers: ThinkingMarkers) -> int | None:
    """vLLM 0.32's rule (model runner v2's thinking budget), from scratch on every call."""

    def last(marker: tuple[int, ...]) -> int:
        starts = [
            i
            for i in range(len(tokens) - len(marker) + 1)
            if tuple(tokens[i : i + len(marker)]) == marker
        ]
        return starts[-1] if starts else -1

    start, end = last(markers.start), last(markers.natural_end)
    if start < 0 or start <= end:
        return None
    if len(tokens) - (start + len(markers.start)) < budget:
        return None
    prefix = max(
        (k for k in range(1, len(markers.end)) if tokens[-k:] == list(markers.end[:k])),
        default=0,
    )
    return markers.end[prefix]


def _random_markers(rng: random.Random) -> ThinkingMarkers:
    def marker() -> tuple[int, ...]:
        return tuple(rng.randrange(6) for _ in range(rng.randint(1, 3)))

    end = marker()
    natural = end if rng.random() < 0.5 else end[-rng.randint(1, len(end)) :]
    return ThinkingMarkers(start=marker(), end=end, natural_end=natural)


def test_the_incremental_scan_forces_what_the_rule_forces():
    forced_runs = ended_runs = 0
    for seed in range(300):
        rng = random.Random(seed)
        markers = _random_markers(rng)
        budget = rng.randint(0, 5)
        prompt = [rng.randrange(6) for _ in range(rng.randint(0, 12))]
        if rng.random() < 0.5:
            prompt += markers.start  # thinking from the prompt
        thought = Thought(budget, list(prompt), markers)
        tokens, forced = list(prompt), []
        for _ in range(40):
            want = reference_forced_token(tokens, budget, markers)
            assert thought.forced_token() == want, (seed, tokens, markers, budget)
            token = want if want is not None else rng.randrange(6)
            forced.append(want is not None)
            tokens.append(token)
            thought.tokens.append(token)
        forced_runs += any(forced)
        # Forcing that stopped: the thought ended.
        ended_runs += any(a and not b for a, b in zip(forced, forced[1:], strict=False))
    assert forced_runs > 100 and ended_runs > 50


def test_a_thought_is_cut_at_its_budget_and_ended_with_the_forced_marker():
    markers = ThinkingMarkers(start=(7,), end=(8, 9), natural_end=(9,))
    thought = Thought(3, [1, 2, 7], markers)  # the prompt opened the thought
    out = []
    for free in (4, 5, 6, None, None, 4, 7, 5, 6, 3, None, None):
        forced = thought.forced_token()
        token = forced if forced is not None else free
        assert (forced is None) == (free is not None), (out, forced)
        out.append(token)
        thought.tokens.append(token)
    # Three tokens of thought, then 8 9; free until the next 7 opens a thought of 3 more.
    assert out == [4, 5, 6, 8, 9, 4, 7, 5, 6, 3, 8, 9]


def test_a_budget_of_zero_forces_at_once_and_an_ended_thought_is_left_alone():
    markers = ThinkingMarkers(start=(7,), end=(9,), natural_end=(9,))
    assert Thought(0, [1, 7], markers).forced_token() == 9
    assert Thought(0, [1, 7, 3, 9], markers).forced_token() is None
    assert Thought(0, [1, 2], markers).forced_token() is None


def test_a_forced_end_continues_from_the_part_already_written():
    markers = ThinkingMarkers(start=(7,), end=(5, 6, 9), natural_end=(9,))
    assert Thought(2, [7, 1, 2], markers).forced_token() == 5
    assert Thought(2, [7, 1, 2, 5], markers).forced_token() == 6
    assert Thought(2, [7, 1, 2, 5, 6], markers).forced_token() == 9


def _new_sequence(seq_id: str, prompt: list[int], budget: int | None) -> NewSequence:
    settings = SamplingSettings(
        temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, seed=1, thinking_token_budget=budget
    )
    return NewSequence(seq_id, prompt, [], settings)


def test_the_runner_masks_forced_rows_and_records_every_budgeted_row():
    budgets = ThinkingBudgets(ThinkingMarkers(start=(7,), end=(9,), natural_end=(9,)))
    budgets.admit(_new_sequence("a", [1, 7], 0))  # forced now
    budgets.admit(_new_sequence("b", [1, 7], 5))  # thinking, within its budget
    budgets.admit(_new_sequence("c", [1, 7], None))  # no budget: not tracked
    rows = budgets.plan_rows(["c", "a", "b"], [0, 1, 3])  # c drafted two tokens
    assert rows.rows == [1, 3]
    logits = torch.randn(4, 12)
    masked = ThinkingBudgets.apply(rows, logits)
    assert masked is not logits
    assert torch.equal(masked[[0, 2, 3]], logits[[0, 2, 3]])
    assert masked[1, 9] == 0 and torch.isinf(masked[1, torch.arange(12) != 9]).all()
    ThinkingBudgets.record(rows, torch.tensor([3, 9, 4, 5]))
    assert [t.tokens for t in rows.thoughts] == [[1, 7, 9], [1, 7, 5]]
    assert ThinkingBudgets.apply(rows, logits) is logits  # a's thought ended; b's has room
    budgets.forget("a")
    assert budgets.plan_rows(["a", "c"], [0, 1]) is None
