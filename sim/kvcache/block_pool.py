"""The block pool of paged KV allocation (vLLM v1's BlockPool): reference counts, the free queue,
and the cached blocks' keys.

    free queue: (eviction sort key, push order) smallest first    cached: key -> block id
    [b7 b3 b9 | b2 b5]                                             a keyed block may sit in the
                                                                   queue with ref 0 until popped

A block is free exactly when its reference count is 0. Taking a block pops the first entry
(entries of blocks revived or pushed again since are skipped) and drops its key, if any: lazy
eviction. The sort key comes from sim.kvcache.eviction (BLOCK_EVICTION_ORDERS); ties go to the
block pushed first. LRU's key is the push order itself (vLLM's free queue), so its queue is a
plain FIFO of block ids, where a block revived by a hit leaves one stale entry behind, counted and
skipped when it comes up; other keys use a heap of (key, push number, block) entries, an entry
being live while it is its block's latest push.
"""
from __future__ import annotations

import heapq
from collections import deque
from typing import NamedTuple

from sim.errors import ConfigError
from sim.kvcache.eviction import BLOCK_EVICTION_ORDERS


class BlockStats(NamedTuple):
    """What an eviction order may read about a free block."""
    keyed: bool
    last_access: int
    hits: int
    created: int


class BlockPool:
    def __init__(self, num_blocks: int, eviction: str = "lru"):
        if eviction not in BLOCK_EVICTION_ORDERS:
            raise ConfigError(f"unknown eviction policy '{eviction}', allocator config key "
                              f"eviction, use one of: {', '.join(BLOCK_EVICTION_ORDERS)}")
        self.num_blocks, self.eviction = num_blocks, eviction
        self._order = BLOCK_EVICTION_ORDERS[eviction]
        self.ref_count = [0] * num_blocks
        self.block_key: list[tuple | None] = [None] * num_blocks
        self.cached: dict[tuple, int] = {}
        self.clock = 0  # logical time: ticks at each free and each keying or hit
        self.hits = [0] * num_blocks
        self.last_access = [0] * num_blocks
        self.created = [0] * num_blocks
        self.num_free = num_blocks
        self.num_cached_free = 0
        self.keyed = False  # whether any block was ever keyed (without keys, nothing to evict)
        # KV tiers below HBM (sim.kvcache.tiers): told of each key HBM drops and each new key.
        self.on_evict = self.on_keyed = None
        if self._order is None:  # the free order: block ids in a FIFO
            self._queue = deque(range(num_blocks))
            self._stale: dict[int, int] = {}  # block -> entries left behind by revivals
        else:
            self._pushes = num_blocks
            self._entry = list(range(num_blocks))  # each block's live entry (its push number)
            start = self._order(BlockStats(False, 0, 0, 0))
            self._queue = [(*start, block, block) for block in range(num_blocks)]  # a heap already

    def observe(self, evicted=None, keyed=None) -> None:
        """Also call evicted(key) for each key the pool drops and keyed(keys) for each batch of
        new keys (KV tiers, a router's delayed view), after any observers already set."""
        self.on_evict = _chained(self.on_evict, evicted)
        self.on_keyed = _chained(self.on_keyed, keyed)

    def free_blocks(self) -> list[int]:
        """The free blocks in the order they would be taken."""
        if self._order is None:
            stale, live = dict(self._stale), []
            for block in self._queue:
                if stale.get(block):
                    stale[block] -= 1
                else:
                    live.append(block)
            return live
        live = [e for e in self._queue if self.ref_count[e[-1]] == 0 and e[-2] == self._entry[e[-1]]]
        return [e[-1] for e in sorted(live)]

    def take(self, count: int) -> tuple[int, ...]:
        """count free blocks, each with one reference, evicting their cached keys."""
        if self._order is None:
            taken = self._take_in_free_order(count)
        else:
            taken = self._take_by_key(count)
        block_key, cached, hits, ref_count = self.block_key, self.cached, self.hits, self.ref_count
        self.num_free -= count
        if not self.keyed:  # no key to drop, no hit counted
            for block in taken:
                ref_count[block] = 1
            return taken
        evicted, on_evict = 0, self.on_evict
        for block in taken:
            key = block_key[block]
            if key is not None:
                evicted += 1
                if cached.get(key) == block:
                    del cached[key]
                    if on_evict is not None:
                        on_evict(key)
                block_key[block] = None
            ref_count[block] = 1
            hits[block] = 0
        self.num_cached_free -= evicted
        return taken

    def _take_in_free_order(self, count: int) -> tuple[int, ...]:
        popleft, stale = self._queue.popleft, self._stale
        if not stale:
            return (popleft(),) if count == 1 else tuple([popleft() for _ in range(count)])
        taken = []
        while len(taken) < count:
            block = popleft()
            left = stale.get(block)
            if left:  # an entry a revival left behind
                if left == 1:
                    del stale[block]
                else:
                    stale[block] = left - 1
                continue
            taken.append(block)
        return tuple(taken)

    def _take_by_key(self, count: int) -> tuple[int, ...]:
        queue, ref_count, entry, pop, taken = self._queue, self.ref_count, self._entry, heapq.heappop, []
        while len(taken) < count:
            item = pop(queue)
            block = item[-1]
            if not ref_count[block] and item[-2] == entry[block]:  # not revived or pushed again since
                taken.append(block)
        return tuple(taken)

    def touch(self, blocks) -> None:
        """One more reference to each block a prefix hit takes (out of the queue if it was
        free), each counting a hit and a clock tick, in order."""
        ref_count, block_key, hits, last_access = self.ref_count, self.block_key, self.hits, self.last_access
        clock = self.clock
        for block in blocks:
            if not ref_count[block]:
                self.num_free -= 1
                if block_key[block] is not None:
                    self.num_cached_free -= 1
                if self._order is None:
                    self._stale[block] = self._stale.get(block, 0) + 1
            ref_count[block] += 1
            hits[block] += 1
            clock += 1
            last_access[block] = clock
        self.clock = clock

    def share(self, blocks) -> None:
        """One more reference to each of blocks already in use (a forked sequence)."""
        for block in blocks:
            self.ref_count[block] += 1

    def release(self, blocks) -> None:
        """One reference less to each block, in this order; a block reaching 0 joins the queue."""
        self.clock = clock = self.clock + 1
        ref_count, block_key = self.ref_count, self.block_key
        freed = []
        for block in blocks:
            left = ref_count[block] - 1
            ref_count[block] = left
            if not left:
                freed.append(block)
        if self._order is None:
            self._queue.extend(freed)
            last_access = self.last_access
            for block in freed:
                last_access[block] = clock
        else:
            self._push_by_key(freed, clock)
        self.num_free += len(freed)
        if self.keyed:
            self.num_cached_free += sum(1 for block in freed if block_key[block] is not None)
        if len(self._queue) > 2 * self.num_blocks + 1024:  # entries of revived blocks pile up
            self._compact()

    def _push_by_key(self, freed: list[int], clock: int) -> None:
        order, queue, entry, last_access = self._order, self._queue, self._entry, self.last_access
        pushes = self._pushes
        for block in freed:
            pushes += 1
            entry[block] = pushes
            last_access[block] = clock
            stats = BlockStats(self.block_key[block] is not None, clock, self.hits[block],
                               self.created[block])
            heapq.heappush(queue, (*order(stats), pushes, block))
        self._pushes = pushes

    def _compact(self) -> None:
        if self._order is None:
            self._queue, self._stale = deque(self.free_blocks()), {}
            return
        live = [e for e in self._queue if self.ref_count[e[-1]] == 0 and e[-2] == self._entry[e[-1]]]
        heapq.heapify(live)
        self._queue = live

    def drop_reference(self, block: int) -> None:
        """One reference less to a block that stays in use by others (copy-on-write)."""
        self.ref_count[block] -= 1

    def set_keys(self, blocks, keys) -> None:
        """Key full blocks by the prefixes they end (a block keyed already keeps its key); the
        first block with a key is the one a lookup finds."""
        block_key, created, cached, clock = self.block_key, self.created, self.cached, self.clock
        self.keyed = True
        new_keys = [] if self.on_keyed is not None else None
        for block, key in zip(blocks, keys):
            if block_key[block] is None:  # a shared (forked) block is keyed once
                block_key[block] = key
                created[block] = clock
                if new_keys is not None and key not in cached:
                    new_keys.append(key)
                cached.setdefault(key, block)
        if new_keys:
            self.on_keyed(new_keys)


def _chained(first, second):
    if first is None or second is None:
        return first or second

    def both(value):
        first(value)
        second(value)
    return both
