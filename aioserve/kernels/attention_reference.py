"""The torch path of paged attention: the CPU production path and the Triton kernels' oracle.

What a step's attention reads does not change from layer to layer, so it is planned once
per step (`plan_reference_attention`: which rows decode, which KV blocks each sequence
reads) and every layer reuses the plan, working out what depends on the pool in its
first layer. Per layer, `paged_attention_reference` attends, in bfloat16 for a bfloat16
model and in float32 otherwise, the softmax always in float32 inside:

- Decode rows (q_len == 1) of a bfloat16 pool in the CPU's layout, and of a float32 one on
  a CPU without AVX-512 (kv_cache.decodes_weigh_in_place), are weighed where the pool
  keeps them (decode_in_pool.py): per group of sequences one `embedding_bag` for the
  scores and one for the values, nothing gathered. Where the step's rows are all decodes
  of one such group (a decode at one stream), its result is returned as it is
  (`ReferencePlan.bags_of_every_row`): a layer then runs seven torch ops and little else.
  Otherwise (fp8 and float16 caches, float32 on AVX-512, other layouts) they are gathered
  in groups of DECODE_GROUP sequences (decode_groups.py), kv head by kv head ([Hkv, slots,
  D], `_gather_heads`: a group's gathered keys stay in the CPU's cache between the gather
  and the product). A group's scores are then one batched matrix product, one product per (sequence, kv head) with
  the GQA group of query heads as its rows (at these shapes torch's CPU SDPA spends most
  of its time setting up each (sequence, head) pair), its probabilities a second product
  with the gathered values.
  Table entries past a sequence's blocks re-read its own first block, and gathered slots
  past its length are zeroed: the length mask hides them, but a NaN left in a free slot
  would survive the mask (0 * NaN). A gathered group of one sequence (a decode at
  concurrency 1) is cut to its length and goes through SDPA.
- Prefill rows go sequence by sequence: in bfloat16 from 128 rows on as batched products
  (prefill_products.py, faster there than SDPA), otherwise through SDPA, causal, the mask
  offset by the cached prefix. For SDPA, query rows and keys are padded to a multiple of
  PREFILL_ALIGN (padded keys zeroed and masked, padded rows dropped). In bfloat16, SDPA
  runs oneDNN kernels built for the exact tails of its query and key blocks and cached for
  good: on a Xeon with AMX every new prompt length kept ~0.6 MiB (302 MiB over lengths 1
  to 512, 861 MiB more for chunks over cached prefixes), against 78 MiB for every length
  up to 4,096 once padded to 16. A run of fresh prompts of one length that needs no
  padding goes through SDPA as one batch (prefill_sequences.py).

A layer with a sliding window reads its own plan of the step (`ReferencePlan.for_window`,
made once a step for each window): each sequence's blocks wholly before its window are
left out, decodes mask the slots of their first kept block before the window as padding,
and prefills mask the keys before each row's window (SDPA's mask, the products' bias).

A head-major pool (kv_cache.py) holds a kv head's slots of one block as one run of memory,
so the gathered [Hkv, slots, D] keys come out of one index_select of such runs; any other
layout (a GPU's slot-major pool, the CPU's dim-major keys) is gathered block by block and
then reordered. An fp8 cache is converted to the compute dtype as it is gathered and
multiplied by its layer's k_scale / v_scale there.

Unlike the Triton path it is not bitwise batch invariant: the padded width of a decode
group can change the last bits of a row's result. In batch-invariant mode
(dispatch.batch_invariant) every decode is a group of one, and a gathered one is cut to
its own length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from aioserve.kernels import decode_in_pool
from aioserve.kernels.decode_groups import DecodeGroup, DecodeSequences, pool_head_rows
from aioserve.kernels.decode_in_pool import on_device
from aioserve.kernels.kv_cache import is_fp8, slot_blocks_and_offsets, stored_order
from aioserve.kernels.prefill_products import (
    attend_by_products,
    padded_key_count,
    round_up,
    uses_products,
)
from aioserve.kernels.prefill_sequences import (
    PREFILL_ALIGN,
    PrefillSequence,
    PromptBatch,
    attend_prompt_batch,
    batch_prompts,
)


@dataclass
class ReferencePlan:
    decodes: DecodeSequences | None
    prefills: list[PrefillSequence]
    # Each new token's (block, offset) in the caches (kv_cache.slot_blocks_and_offsets),
    # which every layer's write reads; None when the plan was made without slot_mapping.
    write_index: tuple[Tensor, Tensor] | None = None
    # Where every layer's decode gathers land: allocated once per step, because a fresh
    # multi-megabyte tensor per group and layer costs page faults on each allocation.
    gather_buffers: tuple[Tensor, Tensor] | None = None
    # Whether every row of the step decodes, weighed in the pool as one group in the
    # step's order (`bags_of_every_row`): asked in the first layer, kept for the others.
    _every_row_asked: bool = False
    _every_row_bags: decode_in_pool.PoolBags | None = None
    # The same step through each sliding window its layers have (`for_window`).
    _windowed: dict[int, ReferencePlan] = field(default_factory=dict)
    # The step's fresh prompts attended together, and the prefills attended one by one
    # (`prompt_batches`): worked out in its first layer.
    _prompt_batches: list[PromptBatch] | None = None
    _prefills_alone: list[PrefillSequence] = field(default_factory=list)

    def prompt_batches(
        self, dtype: torch.dtype, cache_dtype: torch.dtype, new_kv: tuple[Tensor, Tensor] | None
    ) -> list[PromptBatch]:
        """The step's fresh prompts attended together (prefill_sequences.py): where the
        step's new keys and values are what the pool stores and are attended as they are
        (`dtype` is the compute dtype). The other prefills are then `prefills_alone`."""
        if self._prompt_batches is None:
            as_stored = new_kv is not None and new_kv[0].dtype == cache_dtype == dtype
            self._prompt_batches = (
                batch_prompts(self.prefills, dtype)
                if as_stored and _compute_dtype(dtype) == dtype
                else []
            )
            batched = {index for batch in self._prompt_batches for index in batch.members}
            self._prefills_alone = [
                seq for index, seq in enumerate(self.prefills) if index not in batched
            ]
        return self._prompt_batches

    def prefills_alone(self) -> list[PrefillSequence]:
        """The prefills no batch of `prompt_batches` (asked first) attends."""
        return self._prefills_alone

    def for_window(self, window: int, block_size: int) -> ReferencePlan:
        """The plan of the layers whose rows see only the last `window` positions through
        their own: each sequence's blocks wholly before its window left out, the slots of
        its first kept block before the window masked. Made in the first such layer of the
        step and kept for the others; the plan itself where no sequence is longer than the
        window, which then hides nothing (and the full layers' groups and bags serve)."""
        if window not in self._windowed and self._longest_sequence() <= window:
            self._windowed[window] = self
        if window not in self._windowed:
            self._windowed[window] = ReferencePlan(
                None if self.decodes is None else self.decodes.windowed(window),
                [seq.windowed(window, block_size) for seq in self.prefills],
                write_index=self.write_index,
            )
        return self._windowed[window]

    def _longest_sequence(self) -> int:
        lengths = [seq.seq_len for seq in self.prefills]
        if self.decodes is not None:
            lengths.append(int(self.decodes.lengths.max()))
        return max(lengths, default=0)

    def decode_gather_buffers(
        self, cache: Tensor, groups: list[DecodeGroup]
    ) -> tuple[Tensor, Tensor]:
        """Two flat buffers of the cache's dtype (bytes for fp8, gathered as bytes), each as
        large as the largest group's gathered keys."""
        if self.gather_buffers is None:
            block_elements = cache[0].numel()
            size = max(g.blocks.numel() for g in groups) * block_elements
            dtype = torch.uint8 if is_fp8(cache.dtype) else cache.dtype
            self.gather_buffers = tuple(
                torch.empty(size, dtype=dtype, device=cache.device) for _ in range(2)
            )
        return self.gather_buffers

    def bags_of_every_row(
        self, query: Tensor, key_cache: Tensor, value_cache: Tensor
    ) -> decode_in_pool.PoolBags | None:
        """The bags of the step's one decode group when its rows are the step's rows in
        order, weighed in the pool (a decode at one stream, or any all-decode step that
        group_decodes keeps whole); None otherwise. Such a step's attention is the group's
        result as it is, with nothing to place into an output tensor."""
        if not self._every_row_asked:
            self._every_row_asked = True
            self._every_row_bags = self._one_group_in_step_order(query, key_cache, value_cache)
        return self._every_row_bags

    def _one_group_in_step_order(
        self, query: Tensor, key_cache: Tensor, value_cache: Tensor
    ) -> decode_in_pool.PoolBags | None:
        decodes = self.decodes
        if self.prefills or decodes is None:
            return None
        if not decodes.read_in_place(key_cache, value_cache, query.dtype):
            return None
        num_q_heads, head_size = query.shape[1:]
        groups = decodes.groups(True, num_q_heads, head_size)
        if len(groups) != 1 or groups[0].first_row != 0 or len(decodes.rows) != len(query):
            return None
        return groups[0].bags(key_cache, value_cache, num_q_heads)


def check_shapes(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: Tensor,
    max_seq_len: int,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> None:
    """Raise ValueError when the cache, query, block tables and scales do not fit together."""
    if is_fp8(key_cache.dtype) and (k_scale is None or v_scale is None):
        raise ValueError(f"a {key_cache.dtype} KV cache needs its k_scale and v_scale")
    num_q_heads, head_size = query.shape[1:]
    _, block_size, num_kv_heads, cache_head_size = key_cache.shape
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache {value_cache.shape} != key_cache {key_cache.shape}")
    if cache_head_size != head_size:
        raise ValueError(f"cache head size {cache_head_size} != query head size {head_size}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not divide into {num_kv_heads} kv heads")
    if block_tables.shape[1] * block_size < max_seq_len:
        raise ValueError(
            f"block_tables holds {block_tables.shape[1]} blocks of {block_size} slots, "
            f"fewer than max_seq_len={max_seq_len}"
        )


def plan_reference_attention(
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: np.ndarray,
    block_size: int,
    device: torch.device,
    slot_mapping: np.ndarray | None = None,
) -> ReferencePlan:
    """Everything about a step's attention that is the same in every layer (host arrays in)."""
    starts = np.asarray(query_start_loc, dtype=np.int64)
    lens = np.asarray(seq_lens, dtype=np.int64)
    tables = block_tables.astype(np.int64)
    query_lens = np.diff(starts)
    if len(lens) and (query_lens == 1).all():  # decodes only, at one stream most steps
        decodes = DecodeSequences(starts[:-1], lens, tables, block_size, device)
        return ReferencePlan(
            decodes, [], write_index=_write_index(slot_mapping, block_size, device)
        )
    decoding = np.flatnonzero(query_lens == 1)
    decodes = None
    if len(decoding):
        decodes = DecodeSequences(
            starts[decoding], lens[decoding], tables[decoding], block_size, device
        )
    prefills = []
    for b in np.flatnonzero(query_lens > 1).tolist():
        start, query_len, seq_len = int(starts[b]), int(query_lens[b]), int(lens[b])
        prefills.append(
            PrefillSequence(
                start=start,
                end=start + query_len,
                blocks=on_device(tables[b, : -(-seq_len // block_size)], device),
                seq_len=seq_len,
                padded_query_len=round_up(query_len, PREFILL_ALIGN),
                padded_seq_len=round_up(seq_len, PREFILL_ALIGN),
            )
        )
    return ReferencePlan(
        decodes, prefills, write_index=_write_index(slot_mapping, block_size, device)
    )


def _write_index(
    slot_mapping: np.ndarray | None, block_size: int, device: torch.device
) -> tuple[Tensor, Tensor] | None:
    """Each new token's (block, offset) for every layer's KV write; None without slots.
    Divided on the host: torch's operators on a tensor of a few slots cost more."""
    if slot_mapping is None:
        return None
    slots = np.asarray(slot_mapping, dtype=np.int64)
    blocks, offsets = slot_blocks_and_offsets(slots, block_size)
    return on_device(blocks, device), on_device(offsets, device)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the products run in: bfloat16 inputs stay bfloat16 (the products accumulate in
    float32, and converting every gathered key and value cost a fifth of a 64-row decode
    step on a Xeon with AMX); other dtypes in float32."""
    return dtype if dtype == torch.bfloat16 else torch.float32


def _is_head_major(cache: Tensor) -> bool:
    """Whether the pool is stored [num_blocks, Hkv, block_size, D] (kv_cache.empty_kv_cache)."""
    return cache.permute(0, 2, 1, 3).is_contiguous()


def _gather_heads(
    cache: Tensor,
    blocks: Tensor,
    dtype: torch.dtype,
    scale: Tensor | None,
    head_rows: Tensor | None = None,
    buffer: Tensor | None = None,
    padding: Tensor | None = None,
) -> Tensor:
    """cache [num_blocks, block_size, Hkv, D] at `blocks` [..., b], as `dtype`
    [..., Hkv, b * block_size, D]; an fp8 cache's values times `scale`.

    From a head-major pool one index_select of `head_rows` (DecodeGroup.head_rows; given
    only for a head-major pool) copies runs of block_size * D elements, into `buffer` when
    given; from any other layout (a GPU's slot-major pool, the CPU's dim-major keys) the
    blocks are gathered whole and reordered. Gathered rows at `padding` (of the flattened
    [..., D] result) are zeroed.
    """
    num_blocks, block_size, num_kv_heads, head_size = cache.shape
    lead = blocks.shape[:-1]
    width = blocks.shape[-1] * block_size
    stored = cache.view(torch.uint8) if is_fp8(cache.dtype) else cache  # fp8: copied as bytes
    if head_rows is not None or _is_head_major(cache):
        if head_rows is None:
            head_rows = pool_head_rows(blocks, num_kv_heads)
        runs = stored.permute(0, 2, 1, 3).view(num_blocks * num_kv_heads, -1)
        if buffer is None:
            gathered = runs.index_select(0, head_rows)
        else:
            out = buffer[: head_rows.numel() * runs.shape[1]].view(-1, runs.shape[1])
            gathered = torch.index_select(runs, 0, head_rows, out=out)
    else:
        # Whole blocks, copied as stored (blocks are the outermost dimension of every
        # layout), then reordered to [..., Hkv, slots, D] in one copy.
        order = stored_order(stored)
        whole = stored.permute(order).index_select(0, blocks.reshape(-1))
        whole = whole.permute([order.index(dim) for dim in range(4)])  # [k, bs, Hkv, D]
        whole = whole.reshape(*lead, blocks.shape[-1], block_size, num_kv_heads, head_size)
        gathered = whole.movedim(-2, len(lead)).contiguous()
    slots = gathered.view(-1, head_size)
    if padding is not None and padding.numel():
        slots.index_fill_(0, padding, 0)  # zero bytes are 0.0 in every float format
    slots = slots.view(*lead, num_kv_heads, width, head_size)
    if is_fp8(cache.dtype):
        return slots.view(cache.dtype).to(dtype).mul_(scale.to(dtype))
    return slots if slots.dtype == dtype else slots.to(dtype)


def _attend_decode_group(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    group: DecodeGroup,
    scale: float,
    buffers: tuple[Tensor, Tensor],
    kv_scales: tuple[Tensor | None, Tensor | None],
    head_major: tuple[bool, bool],
) -> Tensor:
    """Attention of the group's query rows over their contexts, gathered: [n, Hq, D] in the
    compute dtype (_compute_dtype). head_major: whether the key and the value pool are."""
    num_q_heads, head_size = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    group_size = num_q_heads // num_kv_heads
    n = group.rows.numel()
    dtype = _compute_dtype(query.dtype)
    padding = group.head_padding(num_kv_heads)
    keys, values = (
        _gather_heads(
            cache,
            group.blocks,
            dtype,
            cache_scale,
            group.head_rows(num_kv_heads) if is_head_major else None,
            buffer,
            padding,
        )
        for cache, cache_scale, is_head_major, buffer in zip(
            (key_cache, value_cache), kv_scales, head_major, buffers, strict=True
        )
    )
    # [n, Hkv, group, D]: a kv head's query heads are consecutive, as in the model.
    rows = _query_rows(query, group).to(dtype).view(n, num_kv_heads, group_size, head_size)
    if n == 1:
        # Cut to its length (and a sliding window's start), through SDPA: the products'
        # shapes would change every token, and torch builds oneDNN's bfloat16 products anew
        # for each shape.
        first, length = group.first_slot, group.width
        out = F.scaled_dot_product_attention(
            rows, keys[..., first:length, :], values[..., first:length, :], scale=scale
        )
        return out.reshape(1, num_q_heads, head_size)
    scores = torch.baddbmm(
        group.bias(dtype, num_kv_heads),
        rows.view(n * num_kv_heads, group_size, head_size),
        keys.view(n * num_kv_heads, group.width, head_size).transpose(1, 2),
        alpha=scale,
    )
    probs = torch.softmax(scores, dim=-1)  # float32 inside, rounded to the compute dtype
    values = values.view(n * num_kv_heads, group.width, head_size)
    out = torch.bmm(probs.view(n * num_kv_heads, group_size, -1), values)
    return out.view(n, num_q_heads, head_size)


def _query_rows(query: Tensor, group: DecodeGroup) -> Tensor:
    """The group's query rows [n, Hq, D]."""
    if group.first_row is None:
        return query.index_select(0, group.rows)
    return query[group.first_row : group.first_row + group.rows.numel()]


def _attend_decodes(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    decodes: DecodeSequences,
    plan: ReferencePlan,
    scale: float,
    kv_scales: tuple[Tensor | None, Tensor | None],
    out: Tensor,
) -> None:
    """Every decoding row's attention, written into `out`: weighed in the pool where it
    can be (decode_in_pool.py), else gathered group by group."""
    num_q_heads, head_size = query.shape[1:]
    # Read in place: bfloat16 computing in bfloat16 (_compute_dtype), float32 in float32.
    in_pool = decodes.read_in_place(key_cache, value_cache, query.dtype)
    groups = decodes.groups(in_pool, num_q_heads, head_size)
    if not in_pool:
        buffers = plan.decode_gather_buffers(key_cache, groups)
        head_major = (_is_head_major(key_cache), _is_head_major(value_cache))
    for group in groups:
        if in_pool:
            attended = decode_in_pool.attend_in_pool(
                _query_rows(query, group),
                key_cache,
                value_cache,
                group.bags(key_cache, value_cache, num_q_heads),
                scale,
            )
        else:
            attended = _attend_decode_group(
                query, key_cache, value_cache, group, scale, buffers, kv_scales, head_major
            )
        if group.first_row is None:
            out.index_copy_(0, group.rows, attended.to(out.dtype))
        else:
            out[group.first_row : group.first_row + attended.shape[0]] = attended


def _attend_prefill(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    seq: PrefillSequence,
    scale: float,
    kv_scales: tuple[Tensor | None, Tensor | None],
    out: Tensor,
    new_kv: tuple[Tensor, Tensor] | None,
) -> None:
    """Causal attention of one sequence's query rows, written into out[start:end], through
    SDPA or, for long enough bfloat16 prefills, as products (prefill_products.py). A
    prompt with nothing cached before it reads its keys and values from `new_kv`, as the
    pool holds them, rather than gathering them back."""
    num_q_heads, head_size = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    dtype = _compute_dtype(query.dtype)
    query_len = seq.end - seq.start
    target = out[seq.start : seq.end]
    if new_kv is not None and (seq.seq_len != query_len or new_kv[0].dtype != key_cache.dtype):
        new_kv = None  # a cached prefix to read, or a pool that rounds what it stores
    products = uses_products(dtype, query_len, seq.seq_len)
    length = padded_key_count(seq.seq_len) if products else seq.padded_seq_len
    keys, values = (
        _padded_keys(cache, seq, dtype, cache_scale, length)
        if new_kv is None
        else _padded_new_keys(new[seq.start : seq.end], dtype, length)
        for cache, cache_scale, new in zip(
            (key_cache, value_cache), kv_scales, new_kv or (None, None), strict=True
        )
    )
    if products:
        attended = target if target.dtype == dtype else torch.empty_like(target, dtype=dtype)
        attend_by_products(
            query[seq.start : seq.end].to(dtype),
            keys,
            values,
            seq.product_chunks(num_q_heads // num_kv_heads, query.device),
            scale,
            attended,
        )
        if attended is not target:
            target.copy_(attended)
        return
    rows = query.new_zeros((seq.padded_query_len, num_q_heads, head_size), dtype=dtype)
    rows[:query_len] = query[seq.start : seq.end]
    mask = seq.sdpa_mask(query.device)
    attended = F.scaled_dot_product_attention(
        rows.transpose(0, 1).unsqueeze(0),
        keys.unsqueeze(0),
        values.unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=num_q_heads != num_kv_heads,
    )
    target.copy_(attended.squeeze(0).transpose(0, 1)[:query_len])


def _padded_keys(
    cache: Tensor, seq: PrefillSequence, dtype: torch.dtype, scale: Tensor | None, length: int
) -> Tensor:
    """The sequence's keys (or values) as `dtype` [Hkv, length, D], zero past seq_len: a
    real row never attends them, but a NaN left in a free slot would survive the mask."""
    slots = _gather_heads(cache, seq.blocks, dtype, scale)  # a fresh tensor, written below
    missing = length - slots.shape[1]
    if missing > 0:  # blocks smaller than the padding
        slots = torch.cat([slots, slots.new_zeros((slots.shape[0], missing, slots.shape[2]))], 1)
    slots = slots[:, :length]
    slots[:, seq.seq_len :] = 0
    return slots


def _padded_new_keys(new: Tensor, dtype: torch.dtype, length: int) -> Tensor:
    """A prompt's own keys (or values) new [seq_len, Hkv, D] as `dtype` [Hkv, length, D],
    zero past seq_len: a copy of 1/8 of the time the pool's blocks took to gather (8
    prompts of 256 tokens, 30 layers, an AVX-512 EPYC)."""
    seq_len, num_kv_heads, head_size = new.shape
    keys = new.new_empty((num_kv_heads, length, head_size), dtype=dtype)
    keys[:, :seq_len] = new.transpose(0, 1)
    keys[:, seq_len:] = 0
    return keys


def paged_attention_reference(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_tables: Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    out: Tensor | None = None,
    plan: ReferencePlan | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    new_kv: tuple[Tensor, Tensor] | None = None,
    sliding_window: int = 0,
) -> Tensor:
    """The torch path of `paged_attention`, with its arguments; `plan` is built when not given.

    max_query_len is not needed here (the plan sorts the rows), only taken so that both
    paths have one signature.
    """
    check_shapes(query, key_cache, value_cache, block_tables, max_seq_len, k_scale, v_scale)
    kv_scales = (k_scale, v_scale)
    if plan is None:
        plan = plan_reference_attention(
            query_start_loc.cpu().numpy(),
            seq_lens.cpu().numpy(),
            block_tables.cpu().numpy(),
            key_cache.shape[1],
            query.device,
        )
    if sliding_window:
        plan = plan.for_window(sliding_window, key_cache.shape[1])
    if out is None:
        # The cheap way through for most decode steps: a layer of a one-stream decode
        # spent more time finding its way here than weighing its slots.
        bags = plan.bags_of_every_row(query, key_cache, value_cache)
        if bags is not None:
            return decode_in_pool.attend_in_pool(query, key_cache, value_cache, bags, scale)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if plan.decodes is not None:
        _attend_decodes(query, key_cache, value_cache, plan.decodes, plan, scale, kv_scales, out)
    for batch in plan.prompt_batches(query.dtype, key_cache.dtype, new_kv):
        attend_prompt_batch(query, new_kv, batch, scale, out)
    for seq in plan.prefills_alone():
        _attend_prefill(query, key_cache, value_cache, seq, scale, kv_scales, out, new_kv)
    return out
