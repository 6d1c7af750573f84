"""The paged KV cache's bookkeeping: which physical blocks each sequence holds.

The device memory itself lives in the model runner; this module only hands out block ids.

- Blocks are reference counted. A block is owned by every running sequence whose block
  table lists it; more than one owner is possible only for a full block shared through the
  prefix cache.
- Prefix caching: a full block is named by a hash chained over the token ids of that block
  and of every block before it (and the request's cache salt and LoRA adapter, if any;
  block_hashing.py), so equal hashes mean equal prefixes. When a sequence is admitted, its
  leading full blocks are looked up by hash and shared instead of recomputed.
- A block whose last owner finishes goes to the free queue but keeps its hash, so a later
  request can still hit it; when blocks are needed, the least recently freed one is taken
  and its hash forgotten (LRU eviction).
- With --kv-cache-metrics, `residency` samples blocks as they are taken, shared and
  evicted (kv_residency.py); None otherwise, and then nothing is tracked.
- With --kv-events-config, `events` records the blocks that enter the cache, those evicted
  and the cache's resets, for KV-aware routers (kv_events.py); None otherwise.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from aioserve.engine.block_hashing import (
    DEFAULT_HASH_ALGORITHM,
    BlockHash,
    BlockHasher,
    block_extra_keys,
)
from aioserve.engine.kv_events import KVEventRecorder, untagged
from aioserve.engine.kv_residency import BlockResidencyTracker
from aioserve.engine.request import Request


@dataclass
class PrefixCacheStats:
    """Counted in tokens, like vLLM's prefix_cache_queries / prefix_cache_hits."""

    queries: int = 0
    hits: int = 0


@dataclass(eq=False)
class _Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


@dataclass
class KVCacheManager:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool
    hash_algorithm: str = DEFAULT_HASH_ALGORITHM  # --prefix-caching-hash-algo
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    residency: BlockResidencyTracker | None = None  # --kv-cache-metrics
    events: KVEventRecorder | None = None  # --kv-events-config

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {self.num_blocks}")
        self.hash_block = BlockHasher(self.hash_algorithm)
        self._blocks = [_Block(i) for i in range(self.num_blocks)]
        # Free blocks in eviction order: the front is taken first.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(self.num_blocks))
        self._cached: dict[BlockHash, _Block] = {}
        self._block_tables: dict[str, list[int]] = {}

    # -- queries ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by sequences (cached-but-free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self._block_tables.get(request_id, [])

    def owners(self) -> dict[int, int]:
        """Block id -> reference count, for every block in use (tests and invariants)."""
        return {b.block_id: b.ref_count for b in self._blocks if b.ref_count > 0}

    # -- admission --------------------------------------------------------------------------

    def update_block_hashes(self, request: Request) -> None:
        """Extend the request's chained hashes over every full block of its known tokens."""
        if not self.enable_prefix_caching:
            return
        hashes = request.block_hashes
        n_full = request.num_tokens // self.block_size
        while len(hashes) < n_full:
            i = len(hashes)
            tokens = request.token_ids_range(i * self.block_size, (i + 1) * self.block_size)
            parent = hashes[-1] if hashes else None
            extra_keys = block_extra_keys(request, i * self.block_size, (i + 1) * self.block_size)
            hashes.append(self.hash_block(parent, tokens, extra_keys))

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids of the longest cached prefix of the request's tokens.

        At least one token is always left to compute, because the last prompt token must
        run through the model to give the logits of the first output token. A request that
        wants prompt logprobs computes its whole prompt, as in vLLM: a cached block has no
        logits to score its tokens with.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self._cached.get(block_hash)
            if block is None:
                break
            hit.append(block.block_id)
        return hit

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix-cache lookup in the hit-rate statistics."""
        if self.enable_prefix_caching:
            self.stats.queries += num_query_tokens
            self.stats.hits += num_hit_tokens

    def fits(self, num_tokens: int, cached_prefix: Sequence[int] = (), keep_free: int = 0) -> bool:
        """Whether a request holding no blocks could take blocks for its first `num_tokens`
        tokens, sharing `cached_prefix`, and leave `keep_free` blocks free (vLLM's
        whole-prompt admission check). Cached blocks that sit in the free queue count as
        taken: sharing them takes them out of it."""
        needed_blocks = -(-num_tokens // self.block_size) - len(cached_prefix)
        needed_blocks += sum(1 for b in cached_prefix if self._blocks[b].ref_count == 0)
        return needed_blocks + keep_free <= len(self._free)

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        cached_prefix: Sequence[int] = (),
        keep_free: int = 0,
    ) -> bool:
        """Give the request room for `num_new_tokens` more tokens; False if blocks run out,
        or if fewer than `keep_free` would be left free (the watermark of an admission).

        `cached_prefix` (from `find_cached_prefix`, only when the request holds no blocks
        yet) is shared rather than allocated. On False nothing has changed.
        """
        table = self._block_tables.get(request.request_id, [])
        if not cached_prefix and table:
            needed = request.num_computed_tokens + num_new_tokens
            if needed <= len(table) * self.block_size:
                return True  # the common decode step: room left in the last block
        if cached_prefix and table:
            raise ValueError("a cached prefix can only be taken by a request holding no blocks")
        num_computed = (
            len(cached_prefix) * self.block_size if cached_prefix else request.num_computed_tokens
        )
        needed_blocks = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = needed_blocks - len(table) - len(cached_prefix)
        # Cached prefix blocks that sit in the free queue stop being free once taken.
        num_prefix_from_free = sum(1 for b in cached_prefix if self._blocks[b].ref_count == 0)
        if max(num_new_blocks, 0) + num_prefix_from_free + keep_free > len(self._free):
            return False
        residency = self.residency
        for block_id in cached_prefix:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            if residency is not None:
                residency.accessed(block_id)
        table = table + list(cached_prefix)
        for _ in range(max(num_new_blocks, 0)):
            table.append(self._take_free_block())
        self._block_tables[request.request_id] = table
        return True

    def cache_full_blocks(self, request: Request, num_written: int) -> None:
        """Register in the prefix cache the request's full blocks among its first
        `num_written` tokens, those whose keys and values a finished step has written.

        Not `num_computed_tokens`: with asynchronous scheduling that already counts the
        step in flight, which may still fail and leave its blocks unwritten. And known to
        the host: a block's hash needs its last token."""
        if not self.enable_prefix_caching:
            return
        num_known = min(num_written, request.num_tokens)
        if num_known // self.block_size <= request.num_registered_blocks:
            return  # no block filled up since the last call (most decode steps)
        self.update_block_hashes(request)
        table = self._block_tables.get(request.request_id, [])
        n_computed_full = min(num_known // self.block_size, len(table))
        newly_cached: list[int] = []
        for i in range(request.num_registered_blocks, n_computed_full):
            block = self._blocks[table[i]]
            if block.block_hash is not None:
                continue
            block_hash = request.block_hashes[i]
            if block_hash in self._cached:
                continue  # an equal block is cached already; this copy stays private
            block.block_hash = block_hash
            self._cached[block_hash] = block
            newly_cached.append(i)
        request.num_registered_blocks = max(request.num_registered_blocks, n_computed_full)
        if self.events is not None and newly_cached:
            self._record_stored(request, newly_cached)

    def _record_stored(self, request: Request, indices: list[int]) -> None:
        """One BlockStored event for each run of consecutive newly cached blocks, so that
        every event's hashes chain on its parent."""
        assert self.events is not None
        size = self.block_size
        lora = None if request.lora is None else (request.lora.lora_int_id, request.lora.lora_name)
        runs: list[list[int]] = []
        for i in indices:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, end = run[0], run[-1] + 1
            self.events.stored(
                [request.block_hashes[i] for i in run],
                parent=request.block_hashes[first - 1] if first > 0 else None,
                token_ids=list(request.token_ids_range(first * size, end * size)),
                block_size=size,
                lora=lora,
                extra_keys=[
                    untagged(block_extra_keys(request, i * size, (i + 1) * size)) for i in run
                ],
            )

    # -- release ----------------------------------------------------------------------------

    def free(self, request: Request) -> None:
        """Return every block the request holds. Idempotent."""
        table = self._block_tables.pop(request.request_id, None)
        request.num_registered_blocks = 0
        if not table:
            return
        # Tail blocks first: they are the least likely to be shared, so they are evicted first.
        for block_id in reversed(table):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise AssertionError(f"block {block_id} freed more often than taken")
            if block.ref_count == 0:
                self._free[block_id] = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible while no block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        if self.events is not None:
            self.events.cleared()
        if self.residency is not None:
            self.residency.reset()
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        residency = self.residency
        if residency is not None and self.enable_prefix_caching:
            # vLLM's eviction hook: every block the caching pool takes, hashed or not.
            residency.evicted(block_id)
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            if self.events is not None:
                self.events.removed(block.block_hash)
            block.block_hash = None
        block.ref_count = 1
        if residency is not None:
            residency.allocated(block_id)
        return block_id
