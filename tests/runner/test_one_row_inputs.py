"""A step of one sequence's one token gets the inputs the general path builds for it.

build_host_inputs and build_host_sampling work out such a step (every decode at one
stream) in Python integers rather than numpy calls over the chunks; the arrays they hand
the model thread must be those of the general path, field by field, dtypes included, and
the step's inputs with their strides: a compiled graph guards on its inputs' dtypes and
strides.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from aioserve.runner.sampling_inputs import one_row_sampling, rows_sampling
from aioserve.runner.sequence_slots import SequenceSlots
from aioserve.runner.step_inputs import chunks_inputs, one_token_inputs
from aioserve.runner.step_plan import NewSequence, SamplingSettings, SequenceChunk

BLOCK_SIZE, VOCAB = 4, 100
CPU = torch.device("cpu")

SETTINGS = {
    "greedy": SamplingSettings(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, seed=1),
    "random": SamplingSettings(
        temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=7, logprobs=3
    ),
    "penalties": SamplingSettings(
        temperature=1.0,
        top_k=-1,
        top_p=1.0,
        min_p=0.0,
        seed=3,
        presence_penalty=0.5,
        repetition_penalty=1.2,
        logit_bias={5: 2.0},
    ),
    "min_tokens": SamplingSettings(
        temperature=0.5,
        top_k=5,
        top_p=1.0,
        min_p=0.0,
        seed=4,
        min_tokens=3,
        min_tokens_banned_ids=(2, 9),
        allowed_token_ids=(1, 2, 3, 9),
    ),
}


def _slots() -> SequenceSlots:
    """Slots holding a sequence of each setting, with blocks for 10 tokens."""
    slots = SequenceSlots(max_num_seqs=8, max_blocks_per_seq=8, vocab_size=VOCAB)
    for i, (name, settings) in enumerate(SETTINGS.items()):
        slots.admit(NewSequence(name, [1, 2, 3], [], settings))
        slots.append_blocks(slots.slot(name), [3 * i + 2, 3 * i + 1, 3 * i])
    return slots


def _same(ours: object, theirs: object, strides: bool = False) -> None:
    for field in dataclasses.fields(ours):
        mine, other = getattr(ours, field.name), getattr(theirs, field.name)
        if isinstance(mine, np.ndarray):
            assert mine.dtype == other.dtype, field.name
            np.testing.assert_array_equal(mine, other, err_msg=field.name)
            if strides:  # as tensors, with the strides a compiled graph would guard on
                assert torch.from_numpy(mine).stride() == torch.from_numpy(other).stride()
        elif field.name != "attention_plan":
            assert type(mine) is type(other) and repr(mine) == repr(other), field.name


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("start", [0, 3, 4, 9])  # within, at the end of, across blocks
@pytest.mark.parametrize("token_ids", [[42], None])  # known, or sampled by the last step
@pytest.mark.parametrize("samples", [True, False])
@pytest.mark.parametrize("new_block_ids", [[], [30]])
def test_one_token_inputs_are_the_general_paths(name, start, token_ids, samples, new_block_ids):
    chunk = SequenceChunk(name, start, 1, token_ids, new_block_ids, samples)
    ours_slots, their_slots = _slots(), _slots()
    ours, our_rows = one_token_inputs(chunk, ours_slots, BLOCK_SIZE, CPU, plans_attention=False)
    theirs, their_rows = chunks_inputs([chunk], their_slots, BLOCK_SIZE, CPU, False)
    _same(ours, theirs, strides=True)
    np.testing.assert_array_equal(our_rows, their_rows)
    assert our_rows.dtype == their_rows.dtype
    np.testing.assert_array_equal(ours_slots.block_tables, their_slots.block_tables)
    assert ours.attention_plan is None
    planned, _ = one_token_inputs(chunk, _slots(), BLOCK_SIZE, CPU, plans_attention=True)
    assert planned.attention_plan is not None


def test_a_token_past_the_blocks_is_refused():
    chunk = SequenceChunk("greedy", 12, 1, [42], [], True)  # 3 blocks hold 12 tokens
    with pytest.raises(ValueError, match="past its sequence's KV blocks"):
        one_token_inputs(chunk, _slots(), BLOCK_SIZE, CPU, plans_attention=False)


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("sampled_before", [0, 2, 3])  # min_tokens: banned, banned, free
def test_one_row_sampling_is_the_general_paths(name, sampled_before):
    slots = _slots()
    slot = slots.slot(name)
    slots.num_sampled[slot] = sampled_before
    theirs_slots = copy.deepcopy(slots)
    ours = one_row_sampling(slots, slot)
    theirs = rows_sampling(theirs_slots, np.array([slot], dtype=np.int64))
    _same(ours, theirs)
    assert slots.num_sampled[slot] == theirs_slots.num_sampled[slot] == sampled_before + 1
