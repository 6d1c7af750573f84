"""A step's prefill sequences, as the torch path of paged attention attends them.

A prefill sequence (a prompt, or a chunk of one over its cached prefix) is attended on its
own (attention_reference.py `_attend_prefill`): through SDPA, its rows and keys padded to a
multiple of PREFILL_ALIGN, or through the products of prefill_products.py. A prompt with
nothing cached before it reads its own keys and values, the step's `new_kv`, not the pool.

Fresh prompts of one length that needs no padding, each starting where the last ended (a
benchmark's prompts of one length, or a client's batch of them), go through SDPA together
instead (`batch_prompts`, `attend_prompt_batch`): one causal call over [P, Hq, L, D], every
operand a view of the step's rows, nothing copied in. torch's CPU flash kernel works out
each (prompt, head) pair apart, in blocks that depend on L only, so a prompt gets the bits
its own call gives. On a Xeon with AMX (2 cores, bfloat16, SmolLM2's 9 query and 3 kv
heads; `python bench/prompt_batches.py --prompts P --length L`), one layer of 16 prompts
of 256 tokens took 4.4 ms against 5.4 one by one, 32 of 128 3.1 against 5.0, 64 of 64 2.4
against 5.8 (bench/RESULTS.md). Prompts that would need padding are left alone: copied
into a padded batch, 16 of 250 took 7.4 ms against 5.8.

Not batched either: prompts with a cached prefix or through a sliding window (each has a
mask of its own), the products' prompts, and any in batch-invariant mode, where each
prompt's attention stays a call of its own whatever else the step holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from aioserve.kernels import dispatch
from aioserve.kernels.prefill_products import ProductChunk, plan_chunks, round_up, uses_products

PREFILL_ALIGN = 16


@dataclass
class PrefillSequence:
    """One sequence with several query rows: a prompt or a chunk of one."""

    start: int  # its query rows are start:end
    end: int
    blocks: Tensor  # [ceil(seq_len / block_size)] int64
    seq_len: int
    # Padded to PREFILL_ALIGN: query rows (rows past end are dropped) and keys (keys past
    # seq_len are zeroed, never attended by a real row).
    padded_query_len: int
    padded_seq_len: int
    # A sliding window W > 0: each row sees only the last W positions through its own.
    window: int = 0
    # Worked out in the step's first layer that needs them: SDPA's mask, or the chunks of
    # the products (prefill_products.py).
    _mask: Tensor | None = None
    _chunks: list[ProductChunk] | None = None

    def sdpa_mask(self, device: torch.device) -> Tensor | None:
        """[padded_query_len, padded_seq_len] bool over a cached prefix or through a
        sliding window (a padding row attends key 0, so that no row is empty); None: plain
        causal."""
        query_len = self.end - self.start
        context_len = self.seq_len - query_len
        if (context_len == 0 and not self.window) or self._mask is not None:
            return self._mask
        # Query row i sits at position context_len + i.
        positions = context_len + torch.arange(query_len, device=device)
        mask = torch.zeros(
            (self.padded_query_len, self.padded_seq_len), dtype=torch.bool, device=device
        )
        keys = torch.arange(self.seq_len, device=device)
        attended = keys[None, :] <= positions[:, None]
        if self.window:
            attended &= keys[None, :] > positions[:, None] - self.window
        mask[:query_len, : self.seq_len] = attended
        mask[query_len:, 0] = True
        self._mask = mask
        return mask

    def product_chunks(self, group_size: int, device: torch.device) -> list[ProductChunk]:
        if self._chunks is None:
            self._chunks = plan_chunks(
                self.end - self.start, self.seq_len, group_size, device, self.window
            )
        return self._chunks

    def windowed(self, window: int, block_size: int) -> PrefillSequence:
        """The same rows through a sliding window: the blocks wholly before the first
        row's window left out (positions then count from the first block kept, which moves
        every row and key alike)."""
        context_len = self.seq_len - (self.end - self.start)
        skipped = max(0, context_len + 1 - window) // block_size
        seq_len = self.seq_len - skipped * block_size
        return PrefillSequence(
            start=self.start,
            end=self.end,
            blocks=self.blocks[skipped:],
            seq_len=seq_len,
            padded_query_len=self.padded_query_len,
            padded_seq_len=round_up(seq_len, PREFILL_ALIGN),
            window=window,
        )


@dataclass
class PromptBatch:
    """Fresh prompts of `length` rows each, attended together: rows first_row onwards of
    the step, prompt after prompt."""

    members: list[int]  # the prompts' indices among the step's prefills
    first_row: int
    length: int  # a multiple of PREFILL_ALIGN: no prompt is padded


def batch_prompts(prefills: list[PrefillSequence], dtype: torch.dtype) -> list[PromptBatch]:
    """The runs of two or more of `prefills` (a step's, in its order) that are fresh prompts
    attended through SDPA in `dtype`, as long as each other with no padding, each starting
    where the last ended; none in batch-invariant mode."""
    if dispatch.batch_invariant():
        return []
    batches: list[PromptBatch] = []
    run: list[tuple[int, PrefillSequence]] = []
    for index, seq in enumerate(prefills):
        if not _fresh_and_unpadded(seq, dtype):
            continue  # the next prompt does not start where the run ended
        if run and not _follows(run[-1][1], seq):
            _close(run, batches)
            run = []
        run.append((index, seq))
    _close(run, batches)
    return batches


def _fresh_and_unpadded(seq: PrefillSequence, dtype: torch.dtype) -> bool:
    """Whether `seq` is a prompt with nothing cached before it, attended through SDPA, whose
    rows need no padding."""
    rows = seq.end - seq.start
    return (
        seq.seq_len == rows == seq.padded_query_len
        and not seq.window
        and not uses_products(dtype, rows, rows)
    )


def _follows(last: PrefillSequence, seq: PrefillSequence) -> bool:
    return seq.start == last.end and seq.end - seq.start == last.end - last.start


def _close(run: list[tuple[int, PrefillSequence]], batches: list[PromptBatch]) -> None:
    if len(run) > 1:
        first = run[0][1]
        batches.append(
            PromptBatch([index for index, _ in run], first.start, first.end - first.start)
        )


def attend_prompt_batch(
    query: Tensor, new_kv: tuple[Tensor, Tensor], batch: PromptBatch, scale: float, out: Tensor
) -> None:
    """Causal attention of the batch's prompts, each over its own new keys and values
    (new_kv [T, Hkv, D], of query's dtype), written into their rows of `out`: all of them
    views of the step's rows, [P, L, heads, D]."""
    num_q_heads, head_size = query.shape[1:]
    count, length = len(batch.members), batch.length
    taken = slice(batch.first_row, batch.first_row + count * length)
    rows, keys, values = (
        t[taken].view(count, length, t.shape[1], head_size).transpose(1, 2)
        for t in (query, *new_kv)
    )
    attended = F.scaled_dot_product_attention(
        rows,
        keys,
        values,
        is_causal=True,
        scale=scale,
        enable_gqa=num_q_heads != keys.shape[1],
    )
    out[taken].view(count, length, num_q_heads, head_size).copy_(attended.transpose(1, 2))
