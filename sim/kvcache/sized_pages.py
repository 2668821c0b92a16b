"""Prefix caching for models whose pages differ in size: DeepSeek-V4's compressed layers (pooled
entries and indexer keys in 256-token pages, the raw window in 64-token pages; REFERENCE.md
section 8), or any hybrid whose KV-cache groups do not share one page size.

SizedPagePool pays pages of several sizes from one byte budget (as sim.kvcache.hybrid does
without caching). A freed page that holds a key stays cached, in release order, until its bytes
are needed (LRU); a freed page without a key gives its bytes back at once, as vLLM puts uncached
blocks at the free queue's front (PR 43447: window churn had flushed cached prefixes, 16K-prefix
hit rate 0% -> ~99%). Page sizes are whole bytes (rounded up).

SizedPrefixAllocator keeps one page table per KV-cache group, keyed (token prefix at the page's
end, group). A hit ends on a multiple of every group's page span (vLLM aligns a hit of groups
with different block sizes to their least common multiple): the longest prefix the full-history
groups (pooled entries among them) hold left to right, shortened until every window group holds,
right to left, the pages its last query reads; it never covers the last known token. Window
pages are released before a step's new tokens. Memory is reported in bytes.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from sim.errors import ConfigError
from sim.kv_layout import HybridLayout
from sim.kvcache.base import NO_HIT, KVUsage, PrefixHit, PlannedStepByStep, slack_split
from sim.kvcache.hybrid_prefix import GROUP_BITS, cache_groups


class SizedPagePool:
    """Pages of several sizes from one byte budget, with cached keys and LRU eviction."""

    def __init__(self, budget_bytes: int, page_bytes: list[int]):
        self.budget_bytes, self.page_bytes = budget_bytes, page_bytes
        self.untouched_bytes = budget_bytes  # held by no page, cached or not
        self.cached_free_bytes = 0           # held by free pages that keep a key
        self.group, self.ref_count, self.key = [], [], []  # per page id
        self._recycled: list[int] = []
        self.cached: dict[int, int] = {}     # key -> page
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # release order
        self.held_pages = [0] * len(page_bytes)  # per group: pages some sequence holds
        self.num_evicted = 0

    @property
    def free_bytes(self) -> int:
        return self.untouched_bytes + self.cached_free_bytes

    def take(self, group: int) -> int:
        """A new page for a group (the caller checked free_bytes), evicting the oldest cached
        free pages until its bytes are untouched."""
        need = self.page_bytes[group]
        while self.untouched_bytes < need:
            self._evict_oldest()
        self.untouched_bytes -= need
        self.held_pages[group] += 1
        if self._recycled:
            page = self._recycled.pop()
            self.group[page], self.ref_count[page], self.key[page] = group, 1, None
        else:
            page = len(self.group)
            self.group.append(group)
            self.ref_count.append(1)
            self.key.append(None)
        return page

    def _evict_oldest(self) -> None:
        page, _ = self._cached_free.popitem(last=False)
        key, nbytes = self.key[page], self.page_bytes[self.group[page]]
        del self.cached[key]
        self.cached_free_bytes -= nbytes
        self.untouched_bytes += nbytes
        self.key[page] = None
        self._recycled.append(page)
        self.num_evicted += 1

    def touch(self, pages) -> None:
        """One more reference to each page (a cached free one leaves the free order)."""
        for page in pages:
            if self.ref_count[page] == 0:
                del self._cached_free[page]
                self.cached_free_bytes -= self.page_bytes[self.group[page]]
                self.held_pages[self.group[page]] += 1
            self.ref_count[page] += 1

    def release(self, pages) -> None:
        for page in pages:
            self.ref_count[page] -= 1
            if self.ref_count[page]:
                continue
            nbytes = self.page_bytes[self.group[page]]
            self.held_pages[self.group[page]] -= 1
            if self.key[page] is None:
                self.untouched_bytes += nbytes
                self._recycled.append(page)
            else:
                self._cached_free[page] = None
                self.cached_free_bytes += nbytes

    def set_keys(self, pages, keys) -> None:
        """Each page gets its key, unless another page holds that key already."""
        for page, key in zip(pages, keys):
            if key not in self.cached and self.key[page] is None:
                self.cached[key] = page
                self.key[page] = key


@dataclass(slots=True)
class SizedTables:
    tables: list[list[int]]  # per KV-cache group: page ids, -1 where a window dropped one
    first_live: list[int]    # per group: the first token it still holds
    num_keyed: list[int]     # per group: leading pages keyed
    num_tokens: int
    final_len: int


class SizedPrefixAllocator(PlannedStepByStep):
    def __init__(self, budget_bytes: int, block_size: int, layout: HybridLayout):
        self.block_size, self.layout = block_size, layout
        self.groups = cache_groups(layout)  # (page kind, real layers) per KV-cache group
        spans = [kind.tokens_per_page for kind, _ in self.groups]
        self.unit, self.align = math.gcd(*spans), math.lcm(*spans)  # key spacing, hit alignment
        self.pool = SizedPagePool(int(budget_bytes), [math.ceil(kind.page_bytes) for kind, _ in self.groups])
        self.seqs: dict[int, SizedTables] = {}
        self._keys: dict[int, list[int]] = {}
        self.num_window_released_pages = 0

    @classmethod
    def from_pool(cls, pool, eviction: str = "lru", pools: str = "shared"):
        if eviction != "lru":
            raise ConfigError(f"eviction={eviction} for pages of several sizes is not built, allocator key "
                              f"eviction, use eviction=lru")
        if pools != "shared":
            raise ConfigError(f"pools={pools} with prefix caching is not built, allocator key pools, "
                              f"use pools=shared or the paged allocator")
        return cls(pool.num_blocks * pool.bytes_per_token * pool.block_size, pool.block_size, pool.layout)

    @property
    def capacity(self) -> int:
        return self.pool.budget_bytes

    def state_bytes(self) -> int:
        return 4096 + 200 * len(self.pool.group)

    # -- prefix caching ------------------------------------------------------------------------
    def _unit_keys(self, request, seq_id: int | None, count: int) -> list[int]:
        """Prefix keys at every `unit` tokens up to count units (kept per live sequence)."""
        keys = self._keys.setdefault(seq_id, []) if seq_id is not None else []
        if len(keys) < count:
            keys.extend(request.prefix_keys(self.unit, len(keys), count))
        return keys

    def _cached(self, group: int, keys: list[int], page: int) -> int | None:
        span = self.groups[group][0].tokens_per_page // self.unit
        return self.pool.cached.get((keys[(page + 1) * span - 1] << GROUP_BITS) | group)

    def _hit_tokens(self, keys: list[int], limit: int) -> int:
        """The longest aligned prefix below `limit` tokens every group can serve."""
        end = limit // self.align * self.align
        for group, (kind, _) in enumerate(self.groups):  # full history: left to right
            if not kind.window:
                size = kind.tokens_per_page
                pages = next((p for p in range(end // size) if self._cached(group, keys, p) is None), end // size)
                end = min(end, pages * size // self.align * self.align)
        while end > 0:  # windows: right to left
            short = None
            for group, (kind, _) in enumerate(self.groups):
                if kind.window:
                    size = kind.tokens_per_page
                    missing = [p for p in range(kind.first_live(end) // size, end // size)
                               if self._cached(group, keys, p) is None]
                    if missing:
                        start = missing[-1] * size // self.align * self.align
                        short = start if short is None else min(short, start)
            if short is None:
                break
            end = short
        return end

    def lookup_prefix(self, seq) -> PrefixHit:
        limit = seq.num_tokens - 1
        if limit < self.align:
            return NO_HIT
        keys = self._unit_keys(seq.request, seq.seq_id, limit // self.unit)
        end = self._hit_tokens(keys, limit)
        if end <= 0:
            return NO_HIT
        blocks = []
        for group, (kind, _) in enumerate(self.groups):
            first = kind.first_live(end) // kind.tokens_per_page
            blocks.append(tuple(self._cached(group, keys, p) if p >= first else -1
                                for p in range(end // kind.tokens_per_page)))
        return PrefixHit(end, tuple(blocks))

    def cached_prefix_tokens(self, request) -> int:
        limit = request.prompt_len - 1
        if limit < self.align:
            return 0
        return self._hit_tokens(self._unit_keys(request, None, limit // self.unit), limit)

    # -- allocation ----------------------------------------------------------------------------
    def _pages(self, end: int) -> list[int]:
        """Per group, the pages a table spans once `end` tokens have slots."""
        return [kind.blocks(0, end) for kind, _ in self.groups]

    def _bytes(self, counts) -> int:
        return sum(count * nbytes for count, nbytes in zip(counts, self.pool.page_bytes))

    def allocate(self, seq, num_new_tokens: int, hit: PrefixHit = NO_HIT, full_tokens: int = 0,
                 watermark: float = 0.0):
        record = self.seqs.get(seq.seq_id)
        if record is None:
            return self._admit(seq, num_new_tokens, hit, full_tokens, watermark)
        end = record.num_tokens + num_new_tokens
        self._drop_outside_windows(record, record.num_tokens)  # vLLM frees these first, whatever follows
        wanted = [pages - len(table) for pages, table in zip(self._pages(end), record.tables)]
        if self._bytes(wanted) > self.pool.free_bytes:
            return None
        self._extend(record.tables, wanted)
        record.num_tokens = end
        self._key_full_pages(seq, record)
        return ()

    def _admit(self, seq, num_new_tokens: int, hit: PrefixHit, full_tokens: int, watermark: float):
        pool = self.pool
        hit_pages = hit.blocks or tuple(() for _ in self.groups)
        end = hit.num_tokens + num_new_tokens
        wanted = [pages - len(held) for pages, held in zip(self._pages(end), hit_pages)]
        used = [p for held in hit_pages for p in held if p >= 0]
        revived = sum(pool.page_bytes[pool.group[p]] for p in used if pool.ref_count[p] == 0)
        required = self._bytes(wanted)
        if full_tokens or watermark:
            whole = [pages - len(held) for pages, held in zip(self._pages(full_tokens), hit_pages)]
            required = max(required, self._bytes(whole)) + int(watermark * pool.budget_bytes)
        if required > pool.free_bytes - revived:
            return None
        pool.touch(used)
        tables = [list(held) for held in hit_pages]
        self._extend(tables, wanted)
        record = self.seqs[seq.seq_id] = SizedTables(
            tables, [0] * len(tables), [len(held) for held in hit_pages], end, seq.final_len)
        self._drop_outside_windows(record, hit.num_tokens)
        self._key_full_pages(seq, record)
        return ()

    def _extend(self, tables: list[list[int]], wanted: list[int]) -> None:
        for group, (table, count) in enumerate(zip(tables, wanted)):
            table.extend(self.pool.take(group) for _ in range(count))

    def _drop_outside_windows(self, record: SizedTables, computed: int) -> None:
        for group, (kind, _) in enumerate(self.groups):
            if not kind.window:
                continue
            record.first_live[group] = kind.first_live(computed)
            table = record.tables[group]
            first = min(record.first_live[group] // kind.tokens_per_page, len(table))
            dropped = [p for p in table[:first] if p >= 0]
            if dropped:
                table[:first] = [-1] * first
                self.pool.release(dropped)
                self.num_window_released_pages += len(dropped)

    def _key_full_pages(self, seq, record: SizedTables) -> None:
        keys = None
        for group, (kind, _) in enumerate(self.groups):
            full = min(record.num_tokens // kind.tokens_per_page, len(record.tables[group]))
            if full <= record.num_keyed[group]:
                continue
            keys = keys or self._unit_keys(seq.request, seq.seq_id, record.num_tokens // self.unit)
            span = [(p, i) for i, p in enumerate(record.tables[group][record.num_keyed[group]:full],
                                                 record.num_keyed[group]) if p >= 0]
            self.pool.set_keys([p for p, _ in span],
                               [(keys[(i + 1) * kind.tokens_per_page // self.unit - 1] << GROUP_BITS) | group
                                for _, i in span])
            record.num_keyed[group] = full

    def free(self, seq) -> None:
        self._keys.pop(seq.seq_id, None)
        record = self.seqs.pop(seq.seq_id)
        for table in record.tables:  # deepest first, so shared shallow pages are evicted last
            self.pool.release([p for p in reversed(table) if p >= 0])

    def fork(self, parent, child) -> bool:
        return False  # no page sharing between samples here: a fork recomputes its prompt

    def usage(self, first_waiting=None) -> KVUsage:
        """Bytes: entries allocated for tokens still to come below L reserved; page padding
        (alignment), entries beyond L and dead tokens ahead of a window in its first page
        internal; the rest of the pages held token states (a shared page counts once)."""
        pool = self.pool
        internal = sum(held * (nbytes - real * kind.tokens_per_page // self._ratio(kind) * kind.entry_bytes)
                       for held, nbytes, (kind, real) in zip(pool.held_pages, pool.page_bytes, self.groups))
        reserved = 0.0
        for record in self.seqs.values():
            end, final = record.num_tokens, record.final_len
            for (kind, real), table, first in zip(self.groups, record.tables, record.first_live):
                ratio, layers = self._ratio(kind), real * kind.entry_bytes
                slots = len(table) * kind.tokens_per_page // ratio
                ahead, beyond = slack_split(slots, end // ratio, final // ratio)
                dead = first % kind.tokens_per_page if table and not kind.pooled else 0
                reserved += ahead * layers
                internal += (beyond + dead) * layers
        used = pool.budget_bytes - pool.free_bytes
        reserved, internal = round(reserved), round(internal)
        return KVUsage(pool.budget_bytes, used - reserved - internal, reserved, internal, 0,
                       pool.cached_free_bytes, pool.untouched_bytes)

    @staticmethod
    def _ratio(kind) -> int:
        """Tokens per entry of a page kind's pages."""
        return kind.group.ratio if kind.pooled else 1
