"""Paged KV allocation (PagedAttention) with optional vLLM-style prefix caching.

`paged`: blocks of `block_size` slots handed out on demand from a free queue.
`prefix` (enable_caching): every full block gets the key of the token prefix it ends (parent
chain included, see sim.workload.request), so a later sequence with the same prefix reuses it.

    free queue (LRU head ... tail)      cached: key -> block id     ref_count[block]
    [b7 b3 b9 | b2 b5]                  hashed blocks may sit in the free queue with ref 0:
     ^ allocation pops the head         they are evicted lazily when popped for reuse

As in vLLM v1 (REFERENCE.md section 2): lookup walks full-block keys from the left and stops at
the first miss, never covering the last known token; a finished sequence's blocks are appended
to the queue deepest first, so shared shallow blocks are evicted last; blocks with ref > 0 are
never in the queue; identical blocks computed concurrently are both kept.
"""
from __future__ import annotations

from collections import OrderedDict

from sim.kvcache.base import NO_HIT, KVUsage, PrefixHit, slack_split


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False):
        self.num_blocks, self.block_size, self.enable_caching = num_blocks, block_size, enable_caching
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.ref_count = [0] * num_blocks
        self.block_key: list[tuple | None] = [None] * num_blocks
        self.cached: dict[tuple, int] = {}
        self.tables: dict[int, list[int]] = {}
        self.num_allocated_tokens: dict[int, int] = {}
        self.num_keyed_blocks: dict[int, int] = {}
        self.final_len: dict[int, int] = {}
        self.num_cached_free = 0
        self.total_reserved = 0
        self.total_internal = 0

    @classmethod
    def from_pool(cls, pool, max_model_len: int, enable_caching: bool = False) -> "BlockAllocator":
        return cls(pool.num_blocks, pool.block_size, enable_caching)

    @property
    def capacity(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def lookup_prefix(self, seq) -> PrefixHit:
        if not self.enable_caching:
            return NO_HIT
        cached, blocks = self.cached, []
        for key in seq.request.prefix_keys(self.block_size, 0, (seq.num_tokens - 1) // self.block_size):
            block = cached.get(key)
            if block is None:
                break
            blocks.append(block)
        return PrefixHit(len(blocks) * self.block_size, tuple(blocks)) if blocks else NO_HIT

    def allocate(self, seq, num_new_tokens: int, hit: PrefixHit = NO_HIT):
        seq_id, size = seq.seq_id, self.block_size
        table = self.tables.get(seq_id)
        start = self.num_allocated_tokens[seq_id] if table is not None else hit.num_tokens
        end = start + num_new_tokens
        if table is not None and end <= len(table) * size:
            # Fast path (most decode steps): the tokens land in the last block's slack.
            consumed_reserved = max(0, min(end, self.final_len[seq_id]) - start)
            self.total_reserved -= consumed_reserved
            self.total_internal -= num_new_tokens - consumed_reserved
            self.num_allocated_tokens[seq_id] = end
            if self.enable_caching and end // size > self.num_keyed_blocks[seq_id]:
                self._key_full_blocks(seq, table, end)
            return ()
        num_have = len(table) if table is not None else len(hit.blocks)
        num_needed = -(-end // size) - num_have
        revived = 0 if table is not None else sum(1 for b in hit.blocks if self.ref_count[b] == 0)
        if num_needed > len(self.free_queue) - revived:
            return None
        if table is None:
            table = self.tables[seq_id] = []
            self.final_len[seq_id] = seq.final_len
            self.num_keyed_blocks[seq_id] = len(hit.blocks)
            for block in hit.blocks:
                self._touch(block)
                table.append(block)
        else:
            self._drop_slack(seq_id, table)
        new_blocks = tuple(self._pop_free() for _ in range(num_needed))
        table.extend(new_blocks)
        self.num_allocated_tokens[seq_id] = end
        self._add_slack(seq_id, table)
        if self.enable_caching:
            self._key_full_blocks(seq, table, end)
        return new_blocks

    def free(self, seq) -> None:
        seq_id = seq.seq_id
        table = self.tables.pop(seq_id)
        self._drop_slack(seq_id, table)
        del self.num_allocated_tokens[seq_id], self.final_len[seq_id], self.num_keyed_blocks[seq_id]
        for block in reversed(table):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free_queue[block] = None
                if self.block_key[block] is not None:
                    self.num_cached_free += 1

    def usage(self, first_waiting=None) -> KVUsage:
        size = self.block_size
        num_free = len(self.free_queue)
        used_slots = (self.num_blocks - num_free) * size
        cached_idle = self.num_cached_free * size
        return KVUsage(
            capacity=self.capacity,
            token_states=used_slots - self.total_reserved - self.total_internal,
            reserved=self.total_reserved, internal_frag=self.total_internal, external_frag=0,
            cached_idle=cached_idle, free=num_free * size - cached_idle)

    def blocks_of(self, seq) -> list[int]:
        return list(self.tables.get(seq.seq_id, ()))

    # -- mechanics ---------------------------------------------------------------------------
    def _touch(self, block: int) -> None:
        if self.ref_count[block] == 0:
            del self.free_queue[block]
            if self.block_key[block] is not None:
                self.num_cached_free -= 1
        self.ref_count[block] += 1

    def _pop_free(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        key = self.block_key[block]
        if key is not None:  # lazy eviction of a cached block
            self.num_cached_free -= 1
            if self.cached.get(key) == block:
                del self.cached[key]
            self.block_key[block] = None
        self.ref_count[block] = 1
        return block

    def _key_full_blocks(self, seq, table: list[int], end: int) -> None:
        seq_id, size = seq.seq_id, self.block_size
        first, last = self.num_keyed_blocks[seq_id], end // size
        block_key, cached = self.block_key, self.cached
        for i, key in enumerate(seq.request.prefix_keys(size, first, last), first):
            block = table[i]
            block_key[block] = key
            cached.setdefault(key, block)
        if last > first:
            self.num_keyed_blocks[seq_id] = last

    def _slack(self, seq_id: int, table: list[int]) -> tuple[int, int]:
        return slack_split(len(table) * self.block_size, self.num_allocated_tokens[seq_id],
                           self.final_len[seq_id])

    def _add_slack(self, seq_id, table) -> None:
        reserved, internal = self._slack(seq_id, table)
        self.total_reserved += reserved
        self.total_internal += internal

    def _drop_slack(self, seq_id, table) -> None:
        reserved, internal = self._slack(seq_id, table)
        self.total_reserved -= reserved
        self.total_internal -= internal
