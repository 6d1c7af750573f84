"""The batch as custom logits processors see it (runner/custom_logits.py).

A mirror processor applies each BatchUpdate as the interface documents it (removed, then
added, then moved; a swap needs both indices held, a one-way move an empty target) and
must then hold, at every index, the sequence of that row: over random runs where
sequences come, leave, skip steps, change order and come back after a preemption. Then
what `apply` and `record` do around the sampler: the raw logits untouched, argmax-invariant
processors skipped on all-greedy steps only, sampled tokens appended to the lists the
processors were given.
"""

from __future__ import annotations

import random

import pytest
import torch

from aioserve.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
from aioserve.runner.custom_logits import CustomLogitsProcessors
from aioserve.runner.step_plan import NewSequence, SamplingSettings

SETTINGS = SamplingSettings(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, seed=0)


class Mirror(LogitsProcessor):
    """Keeps index -> (params, output list) by the interface's rules, strictly."""

    def __init__(self, config=None, device=None, is_pin_memory=False, invariant=False):
        self.at: dict[int, tuple[object, list[int]]] = {}
        self.batch_size = 0
        self.invariant = invariant
        self.applied = 0

    def is_argmax_invariant(self) -> bool:
        return self.invariant

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            assert index in self.at, f"removed index {index} holds nothing"
            del self.at[index]
        for index, params, _prompt, output in batch_update.added:
            self.at[index] = (params, output)
        for a, b, how in batch_update.moved:
            if how is MoveDirectionality.SWAP:
                assert a in self.at and b in self.at, (a, b)
                self.at[a], self.at[b] = self.at[b], self.at[a]
            else:
                assert a in self.at and b not in self.at, (a, b)
                self.at[b] = self.at.pop(a)
        self.batch_size = batch_update.batch_size

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        self.applied += 1
        logits[:, 0] += 1.0
        return logits


def _sequence(seq_id: str, params: object, output: list[int] | None = None) -> NewSequence:
    return NewSequence(seq_id, [1, 2, 3], list(output or []), SETTINGS, params=params)


@pytest.mark.parametrize("seed", range(20))
def test_a_mirror_holds_each_rows_sequence_after_every_update(seed):
    rng = random.Random(seed)
    mirror = Mirror()
    custom = CustomLogitsProcessors([mirror])
    live: dict[str, object] = {}  # seq id -> its params object (one per admission)
    names = [f"s{i}" for i in range(12)]
    for step in range(60):
        for seq_id in list(live):
            if rng.random() < 0.12:  # finished or preempted
                custom.forget(seq_id)
                del live[seq_id]
        for seq_id in names:
            if seq_id not in live and rng.random() < 0.2:  # new, or back after a preemption
                live[seq_id] = object()
                custom.admit(_sequence(seq_id, live[seq_id], [step] * rng.randrange(3)))
        rows = [s for s in live if rng.random() < 0.8]  # some sequences do not sample
        rng.shuffle(rows)
        if not rows:
            continue
        planned = custom.plan_rows(rows)
        mirror.update_state(planned.update)
        assert mirror.batch_size == len(rows)
        assert sorted(mirror.at) == list(range(len(rows))), "stale or missing indices"
        for row, seq_id in enumerate(rows):
            params, output = mirror.at[row]
            assert params is live[seq_id], (step, row, seq_id)
            assert output is planned.outputs[row]
        CustomLogitsProcessors.record(planned, torch.arange(len(rows)) + 100 * step)


def test_an_unchanged_batch_gives_no_update_and_a_preempted_sequence_is_added_again():
    custom = CustomLogitsProcessors([Mirror()])
    first, second = object(), object()
    custom.admit(_sequence("a", first))
    custom.admit(_sequence("b", second, [7]))
    update = custom.plan_rows(["a", "b"]).update
    assert [(i, p, o) for i, p, _, o in update.added] == [(0, first, []), (1, second, [7])]
    assert custom.plan_rows(["a", "b"]).update is None
    swapped = custom.plan_rows(["b", "a"]).update
    assert (swapped.removed, swapped.added) == ([], [])
    assert swapped.moved == [(1, 0, MoveDirectionality.SWAP)]
    # "a" preempted and back with its tokens: removed and added again, at its old index.
    custom.forget("a")
    again = object()
    custom.admit(_sequence("a", again, [4, 5]))
    update = custom.plan_rows(["b", "a"]).update
    assert update.removed == [] and update.moved == []
    assert [(i, p, o) for i, p, _, o in update.added] == [(1, again, [4, 5])]
    # "b" leaves: "a" moves into its place.
    custom.forget("b")
    update = custom.plan_rows(["a"]).update
    assert update.removed == [0]
    assert update.moved == [(1, 0, MoveDirectionality.UNIDIRECTIONAL)]
    assert update.batch_size == 1


def test_apply_leaves_the_raw_logits_and_skips_invariant_processors_when_all_greedy():
    changing, invariant = Mirror(), Mirror(invariant=True)
    custom = CustomLogitsProcessors([changing, invariant])
    custom.admit(_sequence("a", object()))
    rows = custom.plan_rows(["a"])
    raw = torch.zeros(1, 8, dtype=torch.bfloat16)
    processed = custom.apply(rows, raw, all_greedy=True)
    assert processed.dtype == torch.float32
    assert processed[0, 0] == 1.0 and raw[0, 0] == 0.0
    assert (changing.applied, invariant.applied) == (1, 0)
    float_raw = torch.zeros(1, 8)
    processed = custom.apply(custom.plan_rows(["a"]), float_raw, all_greedy=False)
    assert processed[0, 0] == 2.0 and float_raw[0, 0] == 0.0  # a copy even in float32
    assert (changing.applied, invariant.applied) == (2, 1)


def test_record_appends_to_the_lists_processors_hold():
    custom = CustomLogitsProcessors([Mirror()])
    custom.admit(_sequence("a", object(), [3]))
    custom.admit(_sequence("b", object()))
    rows = custom.plan_rows(["b", "a"])
    held = {i: o for i, _, _, o in rows.update.added}
    CustomLogitsProcessors.record(rows, torch.tensor([11, 12]))
    CustomLogitsProcessors.record(custom.plan_rows(["b", "a"]), torch.tensor([21, 22]))
    assert held[0] == [11, 21] and held[1] == [3, 12, 22]
