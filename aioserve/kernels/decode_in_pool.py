"""Decode attention weighed where the pool keeps the keys and values: the CPU's decode path.

A decoding row's attention is two weighted sums over its sequence's slots, and
`embedding_bag` (mode "sum", with per-sample weights, float32 accumulation) computes a
weighted sum of rows picked from a table in one pass, reading each row where it lies. Both
sums are written as bags over the pool's memory viewed as rows (`stored_rows`):

- Scores: in a dim-major key pool (kv_cache.py) the block_size slots of one head-size
  component d of a (block, kv head) are one row, so a query head's scores over a block are
  the sum over d of q[d] times that row: one bag of head_size rows, weights q · scale.
- Values: in a head-major (or slot-major) value pool a slot's head_size values are one
  row, so a query head's output is the sum over its slots of probability times that row:
  one bag of `width` rows, weights the probabilities.

Nothing is gathered and no product is set up, which on this project's 2-core CPUs took
most of a decode step's attention (bench/RESULTS.md). A group's sequences are padded to
its longest: the key bags cover the longest's whole blocks, the value bags its length
(`width`); scores past a sequence's length are set to -inf (whatever the slot holds, NaN
included), and padded value rows point at the sequence's first slot with weight zero. The
decodes of a step are sorted by length and grouped so that padding stays small and the
bags' index tensors stay bounded (`group_decodes`).

It runs where both pools are of the compute dtype, dense, each row of their bags one run
of memory (`reads_in_place`): bfloat16, and float32 on a CPU without AVX-512
(kv_cache.decodes_weigh_in_place). There a 64-row decode of SmolLM2 at 320 tokens took
1.7 ms a layer against 4.0 gathered, and 64 prompts of 256 tokens (128 out) went from
378-386 to 463-469 tokens/s offline on a Zen 3 EPYC, its prefills unchanged
(bench/RESULTS.md). On an AVX-512 EPYC (Zen 4), once any `embedding_bag` (fbgemm's) had
run, MKL's float32 batched products ran 2.6× slower for the rest of the process (an
isolated script; the float32 prefill steps of the engine lost 3-10% where its decodes
won), so float32 keeps the gather path of attention_reference.py there, as do other
caches (fp8, float16, a GPU's slot-major keys).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from aioserve.kernels.kv_cache import decodes_weigh_in_place, stored_order

# A group's bags hold at most this many rows (as index entries, one for each of the keys'
# bags' rows and one for each of the values'), ~16 MiB of int32 indices a group.
MAX_BAG_ROWS = 1 << 22
# Padding a group may add, in slots of whole blocks over its sequences, before a longer
# sequence starts a new group: ~the bag rows a group's fixed cost (four ops a layer) is
# worth on a 2-core CPU.
MAX_PADDING_SLOTS = 2048


def reads_in_place(key_cache: Tensor, value_cache: Tensor, dtype: torch.dtype) -> bool:
    """Whether decodes computing in `dtype` can weigh this pool in place: caches of that
    dtype where it is weighed in place (kv_cache.decodes_weigh_in_place), dense, a key
    block's slots and a value's head_size components each one run of memory."""
    return (
        decodes_weigh_in_place(dtype)
        and key_cache.dtype == value_cache.dtype == dtype
        and key_cache.stride(1) == 1
        and value_cache.stride(3) == 1
        and _is_dense(key_cache)
        and _is_dense(value_cache)
    )


def group_decodes(
    lengths: np.ndarray, block_size: int, num_q_heads: int, head_size: int
) -> list[np.ndarray]:
    """The decoding sequences (indices into `lengths`) in groups: sorted by length, a group
    closed when the next sequence would pad it by more than MAX_PADDING_SLOTS slots or
    take its bags past MAX_BAG_ROWS rows. Where one group holds them all, it keeps the
    step's order: its query rows are then one slice, read and written in place."""
    blocks = -(-lengths // block_size)
    order = np.argsort(blocks, kind="stable")
    groups, current, widest = [], [], 0
    for seq in order.tolist():
        width = int(blocks[seq])
        count = len(current) + 1
        rows = count * num_q_heads * width * (head_size + block_size)
        added_padding = len(current) * (width - widest) * block_size
        if current and (rows > MAX_BAG_ROWS or added_padding > MAX_PADDING_SLOTS):
            groups.append(np.array(current))
            current = []
        current.append(seq)
        widest = width
    if current:
        groups.append(np.array(current))
    if len(groups) == 1:
        return [np.arange(len(lengths))]
    return groups


def key_rows(blocks: np.ndarray, cache: Tensor, num_q_heads: int) -> np.ndarray:
    """[n * Hq * blocks, D]: for each sequence, query head and block of `blocks` [n, b], the
    rows of the dim-major key pool viewed as [rows, block_size] (stored_rows) holding that
    block's slots of each head-size component, for the query head's kv head."""
    _, block_size, num_kv_heads, head_size = cache.shape
    block_stride, _, head_stride, dim_stride = cache.stride()
    kv_heads = _kv_head_of(num_q_heads, num_kv_heads)
    dims = np.arange(head_size)
    first = (
        blocks[:, None, :, None] * block_stride
        + kv_heads[None, :, None, None] * head_stride
        + dims * dim_stride
    )  # [n, Hq, b, D]: where each row starts
    return (first // block_size).reshape(-1, head_size).astype(_index_dtype(cache, block_size))


def value_rows(
    blocks: np.ndarray, lengths: np.ndarray, width: int, cache: Tensor, num_q_heads: int
) -> np.ndarray:
    """[n * Hq, width]: for each sequence, query head and slot 0..width-1 of its `blocks`
    [n, b], the row of the value pool viewed as [rows, D] (stored_rows) holding that slot's
    value. A slot past the sequence's length points at its first slot: its weight is zero,
    and a free slot might hold a NaN (0 * NaN)."""
    _, block_size, num_kv_heads, head_size = cache.shape
    block_stride, slot_stride, head_stride, _ = cache.stride()
    slots = np.arange(width)
    valid = slots < lengths[:, None]  # [n, width]
    slot_blocks = np.where(valid, blocks[:, slots // block_size], blocks[:, :1])
    offsets = np.where(valid, slots % block_size, 0)
    kv_heads = _kv_head_of(num_q_heads, num_kv_heads)
    first = (slot_blocks * block_stride + offsets * slot_stride)[:, None, :] + (
        kv_heads * head_stride
    )[None, :, None]  # [n, Hq, width]: where each value starts
    return (first // head_size).reshape(-1, width).astype(_index_dtype(cache, head_size))


@dataclass
class PoolBags:
    """A decode group's bags, flattened as `torch.embedding_bag` takes them, worked out in
    a step's first layer and read by every layer: the pool rows (key_rows, value_rows
    flattened), where each bag starts in them, and the scores its padding masks."""

    key_rows: Tensor  # [n * Hq * blocks * D]: bags of D rows, one per (sequence, head, block)
    key_offsets: Tensor  # [n * Hq * blocks]
    value_rows: Tensor  # [n * Hq * width]: bags of `width` rows, one per (sequence, head)
    value_offsets: Tensor  # [n * Hq]
    blocks: int  # blocks each sequence's scores cover
    width: int  # slots each sequence's values cover
    # Positions, in the scores flattened from [n, Hq, blocks * block_size], of slots past
    # each sequence's length (None: no slot is).
    masked: Tensor | None


def pool_bags(
    blocks: np.ndarray,
    lengths: np.ndarray,
    width: int,
    key_cache: Tensor,
    value_cache: Tensor,
    num_q_heads: int,
    masked: np.ndarray | None,
) -> PoolBags:
    """The bags of the sequences reading `blocks` [n, b], the longest `width` slots long.

    Worked out on host arrays: numpy's calls on a few hundred indices cost a fraction of
    torch's, and in a one-stream step the first layer's ~20 of them ran cold (~220 us on
    a Zen 5 EPYC against ~70 us now)."""
    keys = key_rows(blocks, key_cache, num_q_heads)
    values = value_rows(blocks, lengths, width, value_cache, num_q_heads)
    device = key_cache.device
    return PoolBags(
        key_rows=on_device(keys.reshape(-1), device),
        key_offsets=on_device(_bag_offsets(keys), device),
        value_rows=on_device(values.reshape(-1), device),
        value_offsets=on_device(_bag_offsets(values), device),
        blocks=blocks.shape[1],
        width=width,
        masked=None if masked is None else on_device(masked, device),
    )


def _bag_offsets(rows: np.ndarray) -> np.ndarray:
    """Where each row of `rows` [bags, length] starts once flattened, in its dtype."""
    bags, length = rows.shape
    return np.arange(0, bags * length, length, dtype=rows.dtype)


def on_device(array: np.ndarray, device: torch.device) -> Tensor:
    """A host array as a tensor on `device`."""
    return torch.from_numpy(np.ascontiguousarray(array)).to(device)


def attend_in_pool(
    rows: Tensor, key_cache: Tensor, value_cache: Tensor, bags: PoolBags, scale: float
) -> Tensor:
    """Attention of one query row per sequence, rows [n, Hq, D] in the pool's dtype, over
    the sequences' slots as the group's `bags` say: [n, Hq, D]."""
    n, num_q_heads, head_size = rows.shape
    block_size = key_cache.shape[1]
    # Each query head's q · scale, once for every block its scores cover (one op: the
    # product of an expanded view comes out contiguous).
    weights = torch.mul(rows.unsqueeze(2).expand(n, num_q_heads, bags.blocks, head_size), scale)
    scores = _weighted_sums(
        stored_rows(key_cache, block_size), bags.key_rows, bags.key_offsets, weights
    )
    if bags.masked is not None:
        # A few positions, where masked_fill_ would pass over every score.
        scores.view(-1).index_fill_(0, bags.masked, float("-inf"))
    scores = scores.view(n, num_q_heads, bags.blocks * block_size)
    # Over whole blocks, not cut to the longest length, as the one-row graph's softmax
    # runs (decode_in_pool_traced.py): torch's CPU softmax takes another way through a row
    # shorter than one vector (8 or 16 float32 lanes) and gets other float32 bits, so a
    # sequence of a few slots came out otherwise alone and beside a longer one.
    probs = torch.softmax(scores, dim=-1)  # float32 inside, rounded to the pool's dtype
    if bags.width < probs.shape[-1]:
        # The value bags' weights: contiguous, past the longest length all zero.
        probs = probs.narrow(-1, 0, bags.width).contiguous()
    out = _weighted_sums(
        stored_rows(value_cache, head_size), bags.value_rows, bags.value_offsets, probs
    )
    return out.view(n, num_q_heads, head_size)


def _weighted_sums(table: Tensor, rows: Tensor, offsets: Tensor, weights: Tensor) -> Tensor:
    """For each bag (rows offsets[i]:offsets[i + 1] of `rows`), the sum of its table rows
    times their weights: [bags, table row length].

    `torch.embedding_bag` itself: F.embedding_bag's argument checks and reshapes took as
    long as the sum at one row (~16 us a call on an AVX-512 EPYC), twice a layer.
    """
    return torch.embedding_bag(table, rows, offsets, False, 0, False, weights.view(-1))[0]


def stored_rows(cache: Tensor, row_length: int) -> Tensor:
    """The pool's memory as [rows, row_length], in storage order, whatever its layout."""
    return cache.as_strided(
        (cache.numel() // row_length, row_length), (row_length, 1), cache.storage_offset()
    )


def _kv_head_of(num_q_heads: int, num_kv_heads: int) -> np.ndarray:
    """[Hq]: the kv head each query head reads (a kv head's query heads are consecutive)."""
    return np.arange(num_q_heads) // (num_q_heads // num_kv_heads)


def _index_dtype(cache: Tensor, row_length: int) -> type:
    """int32 where it can number the pool's rows: half the index bytes the bags read."""
    return np.int32 if cache.numel() // row_length < 2**31 else np.int64


def _is_dense(cache: Tensor) -> bool:
    """Whether the tensor is a permuted view of a contiguous one."""
    return cache.permute(stored_order(cache)).is_contiguous()
