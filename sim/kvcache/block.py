"""Paged KV allocation (PagedAttention) with optional vLLM-style prefix caching.

`paged`: blocks of `block_size` slots handed out on demand from a free queue.
`prefix` (enable_caching): every full block gets the key of the token prefix it ends (parent
chain included, see sim.workload.request), so a later sequence with the same prefix reuses it.

    free queue (LRU head ... tail)      cached: key -> block id     ref_count[block]
    [b7 b3 b9 | b2 b5]                  keyed blocks may sit in the free queue with ref 0:
     ^ allocation pops the head         they are evicted lazily when popped for reuse

As in vLLM v1 (REFERENCE.md section 2): lookup walks full-block keys from the left and stops at
the first miss, never covering the last known token; a finished sequence's blocks are appended
to the queue deepest first, so shared shallow blocks are evicted last; blocks with ref > 0 are
never in the queue; identical blocks computed concurrently are both kept. With eviction `lfu` or
`fifo`, unkeyed free blocks go first, then keyed ones by the policy's sort key.

Forked sequences (parallel samples, beams) share every block by reference count; a write into a
shared partial last block first copies it (copy-on-write).
"""
from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from typing import NamedTuple

from sim.errors import ConfigError
import numpy as np

from sim.kvcache.base import (NO_HIT, KVUsage, PrefixHit, advance_decode_token_by_token,
                              decode_slack_rows, last_step_that_fits, slack_split)
from sim.kvcache.eviction import EVICTION_POLICIES


class BlockStats(NamedTuple):
    last_access: int
    hits: int
    created: int


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 eviction: str = "lru"):
        if eviction not in EVICTION_POLICIES:
            raise ConfigError(f"unknown eviction policy '{eviction}', allocator config key "
                              f"eviction, use one of: {', '.join(EVICTION_POLICIES)}")
        self.num_blocks, self.block_size, self.enable_caching = num_blocks, block_size, enable_caching
        self.eviction = eviction
        self._sort_key = EVICTION_POLICIES[eviction]
        # Without caching no block is ever taken out of the middle of the queue: a deque will do.
        self._plain = not enable_caching and eviction == "lru"
        self.free_queue = (deque(range(num_blocks)) if self._plain
                           else OrderedDict((b, None) for b in range(num_blocks)))
        self.ref_count = [0] * num_blocks
        self.block_key: list[tuple | None] = [None] * num_blocks
        self.cached: dict[tuple, int] = {}
        self.tables: dict[int, list[int]] = {}
        self.num_allocated_tokens: dict[int, int] = {}
        self.num_keyed_blocks: dict[int, int] = {}
        self.final_len: dict[int, int] = {}
        self.num_cached_free = 0
        self.num_cow_copies = 0
        # Slack of each sequence's partial last block, summed (exact while nothing is forked).
        self.total_reserved = 0
        self.total_internal = 0
        self.forked: set[int] = set()
        # Statistics for the eviction order (logical clock, not simulated time).
        self.clock = 0
        self.hits = [0] * num_blocks
        self.last_access = [0] * num_blocks
        self.created = [0] * num_blocks
        # Non-LRU policies: unkeyed free blocks in queue order, keyed ones in a lazy heap.
        self._uncached_free: OrderedDict[int, None] = (
            OrderedDict() if eviction == "lru" else OrderedDict(self.free_queue))
        self._heap: list[tuple] = []
        self._free_stamp = [0] * num_blocks

    @classmethod
    def from_pool(cls, pool, max_model_len: int, enable_caching: bool = False,
                  eviction: str = "lru") -> "BlockAllocator":
        return cls(pool.num_blocks, pool.block_size, enable_caching, eviction)

    @property
    def capacity(self) -> int:
        return self.num_blocks * self.block_size

    def state_bytes(self) -> int:
        """Per-block lists and queue entries (about 90 B measured with tracemalloc); caching adds
        statistics, keys and the key map (up to about 300 B at start, 500 B once keyed)."""
        return self.num_blocks * (500 if self.enable_caching or not self._plain else 100)

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

    def allocate(self, seq, num_new_tokens: int, hit: PrefixHit = NO_HIT, full_tokens: int = 0,
                 watermark: float = 0.0):
        """Blocks for num_new_tokens more tokens, or None. On admission (a sequence without
        blocks), full_tokens > 0 requires room for that many tokens in all, and watermark keeps
        that share of all blocks free (vLLM v1's allocate_slots admission gate)."""
        seq_id, size = seq.seq_id, self.block_size
        table = self.tables.get(seq_id)
        start = self.num_allocated_tokens[seq_id] if table is not None else hit.num_tokens
        end = start + num_new_tokens
        copy_on_write = table is not None and start % size != 0 and self.ref_count[table[-1]] > 1
        if table is not None and end <= len(table) * size and not copy_on_write:
            # Fast path (most decode steps): the tokens land in the last block's slack.
            consumed_reserved = max(0, min(end, self.final_len[seq_id]) - start)
            self.total_reserved -= consumed_reserved
            self.total_internal -= num_new_tokens - consumed_reserved
            self.num_allocated_tokens[seq_id] = end
            if self.enable_caching and end // size > self.num_keyed_blocks[seq_id]:
                self._key_full_blocks(seq, table, end)
            return ()
        num_have = len(table) if table is not None else len(hit.blocks)
        num_needed = -(-end // size) - num_have + copy_on_write
        revived = 0 if table is not None else sum(1 for b in hit.blocks if self.ref_count[b] == 0)
        required = num_needed
        if table is None and (full_tokens or watermark):
            required = (max(num_needed, -(-full_tokens // size) - num_have)
                        + int(watermark * self.num_blocks))
        if required > len(self.free_queue) - revived:
            return None
        if table is None:
            table = self.tables[seq_id] = []
            self.final_len[seq_id] = seq.final_len
            self.num_keyed_blocks[seq_id] = len(hit.blocks)
            for block in hit.blocks:
                self._touch(block)
                table.append(block)
        else:
            self._count_slack(seq_id, table, -1)
        new_blocks = self._take_blocks(num_needed)
        if copy_on_write:
            self.ref_count[table[-1]] -= 1
            table[-1] = new_blocks[0]
            self.num_cow_copies += 1
            table.extend(new_blocks[1:])
        else:
            table.extend(new_blocks)
        self.num_allocated_tokens[seq_id] = end
        self._count_slack(seq_id, table, +1)
        if self.enable_caching:
            self._key_full_blocks(seq, table, end)
        return new_blocks

    # A blocked admission stays blocked while running sequences only grow: free blocks only
    # shrink, and a prefix hit only shrinks as its blocks are evicted (each lost block adds one
    # to the need and at most one to what is free).
    admission_stays_blocked = True

    def decode_steps_that_fit(self, seqs, limit: int) -> int:
        """The largest k <= limit such that decode steps 2..k of seqs (one token each, step 1
        already allocated) all find blocks; 1 when a pending copy-on-write would need more."""
        size, ref_count, state = self.block_size, self.ref_count, []
        for seq in seqs:
            table, allocated = self.tables[seq.seq_id], self.num_allocated_tokens[seq.seq_id]
            if allocated % size and ref_count[table[-1]] > 1:
                return 1
            state.append((allocated, len(table) * size))
        return last_step_that_fits(state, len(self.free_queue), size, limit)

    def advance_decode(self, seqs, num_steps: int, first_waiting=None) -> list[tuple]:
        """As num_steps rounds of usage() then allocate(seq, 1) for each seq, with the same
        state after: blocks are taken and full blocks keyed in the same order (step by step,
        sequence by sequence), and the slack totals are recomputed from the sequences' ends."""
        if self.forked:  # tails shared between samples: count them one token at a time
            return advance_decode_token_by_token(self, seqs, num_steps, first_waiting)
        size, tables, allocated_of = self.block_size, self.tables, self.num_allocated_tokens
        ids = [seq.seq_id for seq in seqs]
        allocated = np.array([allocated_of[i] for i in ids], dtype=np.int64)
        slots = np.array([len(tables[i]) for i in ids], dtype=np.int64) * size
        final_len = np.array([self.final_len[i] for i in ids], dtype=np.int64)
        ends = allocated[:, None] + np.arange(num_steps + 1)  # after each round's allocation
        slots_at = np.maximum(slots[:, None], -(-ends // size) * size)
        reserved_before, internal_before = decode_slack_rows(ends[:, :1], slots_at[:, :1], final_len)
        reserved, internal = decode_slack_rows(ends, slots_at, final_len)
        reserved += self.total_reserved - reserved_before[0]  # sequences outside the batch
        internal += self.total_internal - internal_before[0]
        new_blocks = (slots_at - slots[:, None]) // size
        num_free = len(self.free_queue) - new_blocks.sum(axis=0)
        cached_free = self._take_decode_blocks(seqs, allocated, slots, num_steps)
        for i, seq_id in enumerate(ids):
            allocated_of[seq_id] = int(ends[i, -1])
        self.total_reserved, self.total_internal = int(reserved[-1]), int(internal[-1])
        rows = []
        for step in range(num_steps):
            free, idle = int(num_free[step]) * size, cached_free[step] * size
            rows.append(((self.num_blocks * size - free) - int(reserved[step]) - int(internal[step]),
                         int(reserved[step]), int(internal[step]), 0, idle, free - idle))
        return rows

    def _take_decode_blocks(self, seqs, allocated: np.ndarray, slots: np.ndarray,
                            num_steps: int) -> list[int]:
        """The block and keying events of rounds 1..num_steps in allocate's order; returns the
        cached free blocks left after each round 0..num_steps - 1."""
        size, caching = self.block_size, self.enable_caching
        # (round, sequence index, end, takes a block): allocate's slow path at the first token
        # past the last block, its fast path keying a block the token fills (size 1: both at once)
        events = []
        for index, (start, have) in enumerate(zip(allocated.tolist(), slots.tolist())):
            last = start + num_steps
            events.extend((end - start, index, end, True) for end in range(have + 1, last + 1, size))
            if caching and size > 1:
                first_key = (start // size + 1) * size
                events.extend((end - start, index, end, False) for end in range(first_key, last + 1, size))
        events.sort()
        cached_free, done = [self.num_cached_free], 1
        for step, index, end, takes_block in events:
            while done < step:
                cached_free.append(self.num_cached_free)
                done += 1
            seq = seqs[index]
            table = self.tables[seq.seq_id]
            if takes_block:
                table.extend(self._take_blocks(1))
            if caching:
                self._key_full_blocks(seq, table, end)
        while done < num_steps:
            cached_free.append(self.num_cached_free)
            done += 1
        return cached_free[:num_steps]

    def fork(self, parent, child) -> bool:
        """Share all of parent's blocks with a new sequence `child` (always fits)."""
        table = self.tables[parent.seq_id]
        for block in table:
            self.ref_count[block] += 1
        self.tables[child.seq_id] = list(table)
        self.num_allocated_tokens[child.seq_id] = self.num_allocated_tokens[parent.seq_id]
        self.num_keyed_blocks[child.seq_id] = self.num_keyed_blocks[parent.seq_id]
        self.final_len[child.seq_id] = child.final_len
        self._count_slack(child.seq_id, table, +1)
        self.forked.add(child.seq_id)
        return True

    def free(self, seq) -> None:
        seq_id = seq.seq_id
        table = self.tables.pop(seq_id)
        self._count_slack(seq_id, table, -1)
        self.forked.discard(seq_id)
        del self.num_allocated_tokens[seq_id], self.final_len[seq_id], self.num_keyed_blocks[seq_id]
        if self._plain:
            ref_count, queue = self.ref_count, self.free_queue
            for block in reversed(table):
                ref_count[block] -= 1
                if ref_count[block] == 0:
                    queue.append(block)
            return
        self.clock += 1
        for block in reversed(table):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.last_access[block] = self.clock
                self._push_free(block)

    def usage(self, first_waiting=None) -> KVUsage:
        size = self.block_size
        if self.forked:
            reserved, internal = self._shared_tail_slack()
        else:  # no forked sequence alive: every partial last block has one owner
            reserved, internal = self.total_reserved, self.total_internal
        num_free = len(self.free_queue)
        cached_idle = self.num_cached_free * size
        return KVUsage(
            capacity=self.capacity,
            token_states=(self.num_blocks - num_free) * size - reserved - internal,
            reserved=reserved, internal_frag=internal, external_frag=0,
            cached_idle=cached_idle, free=num_free * size - cached_idle)

    def _count_slack(self, seq_id: int, table: list[int], sign: int) -> None:
        """Add (+1) or remove (-1) a sequence's last-block slack from the running totals."""
        reserved, internal = slack_split(len(table) * self.block_size, self.num_allocated_tokens[seq_id],
                                         self.final_len[seq_id])
        self.total_reserved += sign * reserved
        self.total_internal += sign * internal

    def _shared_tail_slack(self) -> tuple[int, int]:
        """Slack of the distinct partial last blocks: forked sequences may share one."""
        size = self.block_size
        tail: dict[int, tuple[int, int, int]] = {}  # last block -> (slots, computed, L)
        for seq_id, table in self.tables.items():
            tokens, slots = self.num_allocated_tokens[seq_id], len(table) * size
            if slots > tokens:
                final_len, known = self.final_len[seq_id], tail.get(table[-1])
                if known is None or final_len > known[2]:  # a shared tail counts once
                    tail[table[-1]] = (slots, tokens, final_len)
        reserved = internal = 0
        for slots, tokens, final_len in tail.values():
            r, i = slack_split(slots, tokens, final_len)
            reserved += r
            internal += i
        return reserved, internal

    # -- mechanics ---------------------------------------------------------------------------
    def _touch(self, block: int) -> None:
        if self.ref_count[block] == 0:
            del self.free_queue[block]
            if self.eviction != "lru":
                self._uncached_free.pop(block, None)
                self._free_stamp[block] += 1  # invalidates its heap entry
            if self.block_key[block] is not None:
                self.num_cached_free -= 1
        self.ref_count[block] += 1
        self.hits[block] += 1
        self.clock += 1
        self.last_access[block] = self.clock

    def _push_free(self, block: int) -> None:
        self.free_queue[block] = None
        keyed = self.block_key[block] is not None
        if keyed:
            self.num_cached_free += 1
        if self.eviction != "lru":  # LRU is the queue order itself
            self._free_stamp[block] += 1
            if keyed:
                stats = BlockStats(self.last_access[block], self.hits[block], self.created[block])
                heapq.heappush(self._heap, (self._sort_key(stats), self._free_stamp[block], block))
            else:
                self._uncached_free[block] = None

    def _victim_by_policy(self) -> int:
        """lfu / fifo: an unkeyed free block if any, else the keyed one with the smallest key."""
        if self._uncached_free:
            block = self._uncached_free.popitem(last=False)[0]
        else:
            while True:
                _, stamp, block = heapq.heappop(self._heap)
                if stamp == self._free_stamp[block] and block in self.free_queue:
                    break
        del self.free_queue[block]
        return block

    def _take_blocks(self, count: int) -> tuple[int, ...]:
        if self._plain:
            popleft, ref_count = self.free_queue.popleft, self.ref_count
            blocks = tuple(popleft() for _ in range(count))
            for block in blocks:
                ref_count[block] = 1
            return blocks
        return tuple(self._pop_free() for _ in range(count))

    def _pop_free(self) -> int:
        if self.eviction == "lru":
            block = self.free_queue.popitem(last=False)[0]
        else:
            block = self._victim_by_policy()
        key = self.block_key[block]
        if key is not None:  # lazy eviction of a cached block
            self.num_cached_free -= 1
            if self.cached.get(key) == block:
                del self.cached[key]
            self.block_key[block] = None
        self.ref_count[block] = 1
        self.hits[block] = 0
        return block

    def _key_full_blocks(self, seq, table: list[int], end: int) -> None:
        seq_id, size = seq.seq_id, self.block_size
        first, last = self.num_keyed_blocks[seq_id], end // size
        block_key, cached, created = self.block_key, self.cached, self.created
        self.clock += 1
        for i, key in enumerate(seq.request.prefix_keys(size, first, last), first):
            block = table[i]
            if block_key[block] is None:  # a shared (forked) block is keyed once
                block_key[block] = key
                created[block] = self.clock
                cached.setdefault(key, block)
        if last > first:
            self.num_keyed_blocks[seq_id] = last
