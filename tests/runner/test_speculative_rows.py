"""A speculative step's sampling rows (runner/speculative_rows.py) against plain loops: the
rows and logits positions of chunks with drafts, which rows each chunk keeps, and the
penalties' counts that see the drafts before each row."""

from __future__ import annotations

import numpy as np
import torch

from aioserve.runner.sequence_slots import SlotTensors
from aioserve.runner.speculative_rows import (
    NO_DRAFT,
    draft_rows,
    expand_logits_indices,
    kept_rows,
    penalty_state_with_drafts,
    record_kept,
)
from aioserve.runner.step_plan import SequenceChunk


def _chunk(seq_id: str, tokens: list[int], num_drafts: int = 0, samples: bool = True):
    return SequenceChunk(seq_id, 10, len(tokens), tokens, [], samples, num_drafts)


CHUNKS = [
    _chunk("a", [1, 2, 3], samples=False),  # a prompt chunk that does not sample
    _chunk("b", [4, 5, 6], num_drafts=2),  # last token 4, drafts 5 6
    _chunk("c", [7]),  # an ordinary decode
    _chunk("d", [8, 9], num_drafts=1),
]


def test_rows_of_chunks_with_drafts():
    rows = draft_rows(CHUNKS)
    assert rows.first_rows.tolist() == [0, 3, 4]
    assert rows.chunk_of_row.tolist() == [0, 0, 0, 1, 2, 2]
    assert rows.offsets.tolist() == [0, 1, 2, 0, 0, 1]
    assert rows.drafts.tolist() == [5, 6, NO_DRAFT, NO_DRAFT, 9, NO_DRAFT]
    # Logits rows: the step's tokens are a a a b b b c d d; the sampling chunks' last
    # tokens at 5, 6 and 8.
    logits = expand_logits_indices(np.array([5, 6, 8]), rows)
    assert logits.tolist() == [3, 4, 5, 6, 7, 8]
    assert draft_rows([_chunk("c", [7]), _chunk("e", [1, 2])]) is None


def _kept_by_loop(token_ids: list[int], drafts: list[int], first_rows: list[int]) -> list[int]:
    kept = []
    ends = first_rows[1:] + [len(token_ids)]
    for first, end in zip(first_rows, ends, strict=True):
        n = 1
        while first + n - 1 < end - 1 and token_ids[first + n - 1] == drafts[first + n - 1]:
            n += 1
        kept.append(n)
    return kept


def test_kept_rows_against_a_loop():
    rng = np.random.default_rng(0)
    for _ in range(300):
        chunks = []
        for i in range(rng.integers(1, 6)):
            num_drafts = int(rng.integers(0, 5))
            tokens = rng.integers(0, 3, 1 + num_drafts).tolist()
            chunks.append(_chunk(str(i), tokens, num_drafts))
        if not any(c.num_drafts for c in chunks):
            continue
        rows = draft_rows(chunks)
        token_ids = torch.from_numpy(rng.integers(0, 3, rows.num_rows))
        kept = kept_rows(token_ids, rows)
        expected = _kept_by_loop(token_ids.tolist(), rows.drafts.tolist(), rows.first_rows.tolist())
        assert kept.num_kept.tolist() == expected
        assert kept.last_rows.tolist() == [
            f + n - 1 for f, n in zip(rows.first_rows, expected, strict=True)
        ]
        flags = [0] * rows.num_rows
        for first, n in zip(rows.first_rows.tolist(), expected, strict=True):
            flags[first : first + n] = [1] * n
        assert kept.kept.tolist() == flags


def test_penalties_count_the_drafts_before_each_row_and_record_only_kept_tokens():
    vocab = 12
    state = SlotTensors(4, vocab, torch.device("cpu"))
    state.output_counts = torch.zeros(4, vocab, dtype=torch.int32)
    state.prompt_mask = torch.zeros(4, vocab, dtype=torch.bool)
    state.output_counts[2, 5] = 1  # sequence b (slot 2) sampled 5 once already
    state.prompt_mask[2, 11] = True
    rows = draft_rows(CHUNKS)
    slots = torch.tensor([2, 2, 2, 0, 3, 3])  # b's rows, c's, d's
    # Every row uses penalties but c's.
    penalty_rows = np.array([0, 1, 2, 4, 5])
    counts, mask, state_rows = penalty_state_with_drafts(state, slots, rows, penalty_rows)
    expected = state.output_counts[slots].clone()
    expected[1, 5] += 1  # b's second row has seen draft 5
    expected[2, 5] += 1  # its third, drafts 5 and 6
    expected[2, 6] += 1
    expected[5, 9] += 1  # d's second row, draft 9
    assert state_rows.tolist() == [0, 1, 2, 0, 3, 4]  # c reads the first copy
    assert torch.equal(counts[state_rows[penalty_rows]], expected[penalty_rows])
    assert torch.equal(mask[state_rows[penalty_rows]], state.prompt_mask[slots][penalty_rows])
    assert counts.shape[0] == penalty_rows.size

    # b keeps 5 then samples 1 (two tokens), c samples 7, d samples 3 where 9 was drafted.
    token_ids = torch.tensor([5, 1, 6, 7, 3, 9])
    kept = kept_rows(token_ids, rows)
    record_kept(state, slots, token_ids, kept, rows, torch.arange(6))
    assert state.last_sampled[[2, 0, 3]].tolist() == [1, 7, 3]
    assert state.output_counts[2, 5] == 2 and state.output_counts[2, 1] == 1
    assert state.output_counts[2, 6] == 0  # b's third row was not kept
    assert state.output_counts[3, 3] == 1 and state.output_counts[3, 9] == 0
