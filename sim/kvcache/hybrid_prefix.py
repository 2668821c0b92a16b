"""Prefix caching for models with sliding-window or chunked-local layers: vLLM's hybrid KV cache
manager with caching on (REFERENCE.md section 8; vLLM docs/design/hybrid_kv_cache_manager.md).

The pages of sim.kv_layout.HybridLayout (one page size) come from one block pool (sim.kvcache.
block_pool: reference counts, one LRU free queue, cached keys). Every KV-cache group keeps its own
block table; a full block is keyed by (its token prefix, its group). A lookup takes the longest
prefix that the full-attention groups hold left to right, then shortens it until every window
group holds, right to left, the blocks its last query would read (a window's last w - 1 tokens, a
chunk's tokens from the chunk start); a hit never covers the last known token. Blocks that leave a
window are released before a step's new tokens (they stay cached until evicted), so a later
request can still hit them. Memory is counted in layer slots as sim.kvcache.hybrid does.
"""
from __future__ import annotations

from dataclasses import dataclass

from sim.errors import ConfigError
from sim.kv_layout import HybridLayout
from sim.kvcache.base import NO_HIT, KVUsage, PrefixHit, PlannedStepByStep, slack_split
from sim.kvcache.block_pool import BlockPool

GROUP_BITS = 8  # a cache key is (prefix key << GROUP_BITS) | group


def cache_groups(layout: HybridLayout) -> list:
    """The layout's KV-cache groups (HybridLayout.cache_groups), as many as a cache key can name."""
    groups = layout.cache_groups()
    if len(groups) >= 1 << GROUP_BITS:
        raise ValueError("too many KV-cache groups for the cache key")
    return groups


@dataclass(slots=True)
class HybridTables:
    tables: list[list[int]]  # per KV-cache group: block ids, -1 where a window dropped one
    num_tokens: int
    num_keyed: int            # leading blocks keyed (in every group that still holds them)
    final_len: int


class HybridPrefixAllocator(PlannedStepByStep):
    def __init__(self, num_blocks: int, block_size: int, layout: HybridLayout, eviction: str = "lru"):
        self.pool = BlockPool(num_blocks, eviction)
        self.num_blocks, self.block_size, self.layout = num_blocks, block_size, layout
        self.groups = cache_groups(layout)
        self.block_group = [0] * num_blocks
        self.used_per_group = [0] * len(self.groups)
        self.seqs: dict[int, HybridTables] = {}
        self._keys: dict[int, list[int]] = {}
        self.num_window_released_pages = 0  # released (still cached) because their tokens left a window

    @classmethod
    def from_pool(cls, pool, max_model_len: int, eviction: str = "lru", pools: str = "shared"):
        layout = pool.layout
        if pools != "shared":
            raise ConfigError(f"pools={pools} with prefix caching is not built, allocator key pools, "
                              f"use pools=shared or the paged allocator")
        if any(kind.per_sequence for kind in layout.page_kinds):
            raise ConfigError("prefix caching over state (Mamba) layers is not modelled (vLLM 0.10 turns it off for "
                              "these models; later releases keep a state per cached block, experimentally), "
                              "key allocators, use paged")
        if any(kind.pooled for kind in layout.page_kinds) or not layout.equal_pages:
            from sim.kvcache.sized_pages import SizedPrefixAllocator
            return SizedPrefixAllocator.from_pool(pool, eviction, pools)
        return cls(pool.num_blocks, pool.block_size, layout, eviction)

    @property
    def capacity(self) -> int:
        return self.num_blocks * self.block_size * self.layout.group_size

    def state_bytes(self) -> int:
        return self.num_blocks * 600

    # -- prefix caching ------------------------------------------------------------------------
    def _prefix_keys(self, seq, count: int) -> list[int]:
        keys = self._keys.setdefault(seq.seq_id, [])
        if len(keys) < count:
            keys.extend(seq.request.prefix_keys(self.block_size, len(keys), count))
        return keys

    def _cached(self, group: int, key: int) -> int | None:
        return self.pool.cached.get((key << GROUP_BITS) | group)

    def _first_needed(self, kind, end_block: int) -> int:
        """The first block a group needs for a hit of end_block blocks."""
        return kind.first_live(end_block * self.block_size) // self.block_size

    def lookup_prefix(self, seq) -> PrefixHit:
        """Cached blocks for the longest hit every group can serve; a pure query."""
        count = (seq.num_tokens - 1) // self.block_size
        if count <= 0:
            return NO_HIT
        keys = self._prefix_keys(seq, count)
        end = self._hit_blocks(keys, count)
        if end <= 0:
            return NO_HIT
        blocks = tuple(tuple(self._cached(group, keys[i]) if i >= self._first_needed(kind, end) else -1
                             for i in range(end)) for group, (kind, _) in enumerate(self.groups))
        return PrefixHit(end * self.block_size, blocks)

    def cached_prefix_tokens(self, request) -> int:
        """Tokens of a new request's prompt that lookup_prefix would find (for routers)."""
        count = (request.prompt_len - 1) // self.block_size
        if count <= 0:
            return 0
        return self._hit_blocks(request.prefix_keys(self.block_size, 0, count), count) * self.block_size

    def _hit_blocks(self, keys: list[int], count: int) -> int:
        """Leading blocks of keys[:count] that every group can serve."""
        end = count
        for group, (kind, _) in enumerate(self.groups):  # full attention: left to right
            if not kind.window:
                end = next((i for i in range(end) if self._cached(group, keys[i]) is None), end)
        while end > 0:  # windows: right to left, shortening the hit until every group holds it
            short = None
            for group, (kind, _) in enumerate(self.groups):
                if kind.window:
                    missing = [i for i in range(self._first_needed(kind, end), end)
                               if self._cached(group, keys[i]) is None]
                    if missing:
                        short = missing[-1] if short is None else min(short, missing[-1])
            if short is None:
                break
            end = short
        return max(end, 0)

    # -- allocation ----------------------------------------------------------------------------
    def allocate(self, seq, num_new_tokens: int, hit: PrefixHit = NO_HIT, full_tokens: int = 0,
                 watermark: float = 0.0):
        record = self.seqs.get(seq.seq_id)
        if record is None:
            return self._admit(seq, num_new_tokens, hit, full_tokens, watermark)
        computed, end = record.num_tokens, record.num_tokens + num_new_tokens
        self._drop_outside_windows(record, computed)  # vLLM frees these first, whatever follows
        wanted = [(end - 1) // self.block_size + 1 - len(table) for table in record.tables]
        if sum(wanted) > self.pool.num_free:
            return None
        self._extend(record.tables, wanted)
        record.num_tokens = end
        if any(wanted) or end // self.block_size > record.num_keyed:  # (a clock tick, as the paged allocator)
            self._key_full_blocks(seq, record)
        return ()

    def _admit(self, seq, num_new_tokens: int, hit: PrefixHit, full_tokens: int, watermark: float):
        size, pool = self.block_size, self.pool
        hit_blocks = hit.blocks or tuple(() for _ in self.groups)
        end = hit.num_tokens + num_new_tokens
        last = (end - 1) // size + 1
        wanted = [last - len(blocks) for blocks in hit_blocks]
        used = [b for blocks in hit_blocks for b in blocks if b >= 0]
        revived = sum(1 for b in used if pool.ref_count[b] == 0)
        required = sum(wanted)
        if full_tokens or watermark:
            whole = -(-full_tokens // size)
            required = (max(required, sum(whole - len(blocks) for blocks in hit_blocks))
                        + int(watermark * self.num_blocks))
        if required > pool.num_free - revived:
            return None
        for block in used:
            if pool.ref_count[block] == 0:
                self.used_per_group[self.block_group[block]] += 1
        pool.touch(used)
        tables = [list(blocks) for blocks in hit_blocks]
        self._extend(tables, wanted)
        record = self.seqs[seq.seq_id] = HybridTables(tables, end, hit.num_tokens // size, seq.final_len)
        self._drop_outside_windows(record, hit.num_tokens)
        self._key_full_blocks(seq, record)
        return ()

    def _extend(self, tables: list[list[int]], wanted: list[int]) -> None:
        taken = iter(self.pool.take(sum(wanted)))
        for group, (table, count) in enumerate(zip(tables, wanted)):
            for _ in range(count):
                block = next(taken)
                self.block_group[block] = group
                table.append(block)
            self.used_per_group[group] += count

    def _drop_outside_windows(self, record: HybridTables, computed: int) -> None:
        for group, (kind, _) in enumerate(self.groups):
            if not kind.window:
                continue
            table = record.tables[group]
            first = min(kind.first_live(computed) // self.block_size, len(table))
            dropped = [b for b in table[:first] if b >= 0]
            if dropped:
                table[:first] = [-1] * first
                self._release(dropped)
                self.num_window_released_pages += len(dropped)

    def _release(self, blocks: list[int]) -> None:
        self.pool.release(blocks)
        for block in blocks:
            if self.pool.ref_count[block] == 0:
                self.used_per_group[self.block_group[block]] -= 1

    def _key_full_blocks(self, seq, record: HybridTables) -> None:
        self.pool.clock += 1
        full = record.num_tokens // self.block_size
        if full <= record.num_keyed:
            return
        keys = self._prefix_keys(seq, full)
        for group, table in enumerate(record.tables):
            span = [(b, (keys[i] << GROUP_BITS) | group) for i, b in enumerate(table[record.num_keyed:full],
                                                                               record.num_keyed) if b >= 0]
            if span:
                self.pool.set_keys([b for b, _ in span], [k for _, k in span])
        record.num_keyed = full

    def free(self, seq) -> None:
        self._keys.pop(seq.seq_id, None)
        record = self.seqs.pop(seq.seq_id)
        for table in record.tables:  # deepest first, so shared shallow blocks are evicted last
            self._release([b for b in reversed(table) if b >= 0])

    def fork(self, parent, child) -> bool:
        return False  # no block sharing between samples here: a fork recomputes its prompt

    def usage(self, first_waiting=None) -> KVUsage:
        """Layer slots; a block's padding layers are internal fragmentation, its tail slack
        reserved or internal as in the paged allocator, tokens ahead of a window counted as held."""
        size, width = self.block_size, self.layout.group_size
        reserved = internal = 0
        for record in self.seqs.values():
            for table, (_, real) in zip(record.tables, self.groups):
                ahead, beyond = slack_split(len(table) * size, record.num_tokens, record.final_len)
                reserved += real * ahead
                internal += real * beyond
        internal += sum(used * (width - real) * size for used, (_, real) in zip(self.used_per_group, self.groups))
        free = self.pool.num_free * size * width
        cached_idle = self.pool.num_cached_free * size * width
        used = self.capacity - free
        return KVUsage(self.capacity, used - reserved - internal, reserved, internal, 0, cached_idle,
                       free - cached_idle)
