"""The paged allocator's side of a decode cohort (sim.scheduler.cohort): the memory of the leading
running sequences that only decode, one token each per step, kept in arrays.

While a sequence is a member, its SeqBlocks record keeps its table (blocks are appended to it as
they are taken) but not its token count: `alloc` here holds it, and leave() or flush() writes it
back. Each step allocates every member's token with numpy over the cohort plus Python work only
for the members whose token takes a block or fills one (about 1 in block_size). Blocks are taken
and full blocks keyed in allocate's order (member by member), so the pool ends in the state the
same allocate calls one by one would leave; the slack totals move by the same integers. Only
without forked sequences: a shared partial last block would need copy-on-write.
"""
from __future__ import annotations

import numpy as np

from sim.kvcache.base import decode_slack_rows, largest_fitting


class PagedCohort:
    def __init__(self, allocator):
        self.allocator, self.size = allocator, allocator.block_size
        self.seqs: list = []
        self.records: list = []
        self.alloc = np.empty(0, dtype=np.int64)      # token slots allocated (the record's num_tokens)
        self.slots = np.empty(0, dtype=np.int64)      # len(table) * block_size
        self.final_len = np.empty(0, dtype=np.int64)  # L

    def usable(self) -> bool:
        """No forked sequence alive (a shared partial last block would need copy-on-write)."""
        return not self.allocator.num_forked

    def can_join(self, seq) -> bool:
        """Whether seq's memory is a decoder's: allocated up to its computed tokens, every full
        block keyed when caching, no block shared with a fork."""
        record = self.allocator.seqs.get(seq.seq_id)
        return (record is not None and not record.forked and record.num_tokens == seq.num_computed
                and (not self.allocator.enable_caching or record.num_keyed == record.num_tokens // self.size))

    def join(self, seqs: list) -> None:
        records = [self.allocator.seqs[seq.seq_id] for seq in seqs]
        self.seqs.extend(seqs)
        self.records.extend(records)
        self.alloc = np.concatenate((self.alloc, [r.num_tokens for r in records]))
        self.slots = np.concatenate((self.slots, [len(r.table) * self.size for r in records]))
        self.final_len = np.concatenate((self.final_len, [r.final_len for r in records]))

    def leave(self, indices: np.ndarray) -> None:
        """Members at these positions leave (their records brought up to date)."""
        records = self.records
        for index, alloc in zip(indices.tolist(), self.alloc[indices].tolist()):
            records[index].num_tokens = alloc
        keep = np.ones(len(records), dtype=bool)
        keep[indices] = False
        self.seqs = [s for s, k in zip(self.seqs, keep.tolist()) if k]
        self.records = [r for r, k in zip(records, keep.tolist()) if k]
        self.alloc, self.slots, self.final_len = self.alloc[keep], self.slots[keep], self.final_len[keep]

    def flush(self) -> None:
        """Every member leaves."""
        for record, alloc in zip(self.records, self.alloc.tolist()):
            record.num_tokens = alloc
        self.__init__(self.allocator)

    def _slack(self) -> tuple[int, int]:
        reserved, internal = decode_slack_rows(self.alloc[:, None], self.slots[:, None], self.final_len)
        return int(reserved[0]), int(internal[0])

    def allocate(self) -> bool:
        """One token for every member (allocate(seq, 1) for each, in order), or False and nothing
        changed when the free blocks do not suffice."""
        allocator, pool, size = self.allocator, self.allocator.pool, self.size
        takes = self.alloc == self.slots
        num_taken = int(np.count_nonzero(takes))
        if num_taken > pool.num_free:
            return False
        reserved, internal = self._slack()
        if allocator.enable_caching:
            fills = (self.alloc + 1) % size == 0
            for index in np.flatnonzero(takes | fills).tolist():
                record, end = self.records[index], int(self.alloc[index]) + 1
                if takes[index]:  # allocate's slow path: a block, then keying (a clock tick)
                    record.table.extend(pool.take(1))
                allocator.key_full_blocks(self.seqs[index], record, end)
        elif num_taken:
            records = self.records
            for index, block in zip(np.flatnonzero(takes).tolist(), pool.take(num_taken)):
                records[index].table.append(block)
        self.slots[takes] += size
        self.alloc += 1
        new_reserved, new_internal = self._slack()
        allocator.total_reserved += new_reserved - reserved
        allocator.total_internal += new_internal - internal
        return True

    def steps_that_fit(self, limit: int) -> int:
        """The largest k <= limit whose decode steps 2..k find blocks (step 1 allocated)."""
        size, alloc, slots = self.size, self.alloc, self.slots
        return largest_fitting(lambda steps: int(np.maximum(0, -(-(alloc + steps - 1 - slots) // size)).sum()),
                               self.allocator.pool.num_free, limit)

    def rounds(self, num_steps: int) -> np.ndarray:
        """As num_steps rounds of usage() then allocate() for every member (the usages as rows
        of KVUsage.as_tuple()), with the same state after: blocks are taken and full blocks keyed
        in the same order (round by round, member by member), and the slack totals recomputed
        from the members' ends."""
        allocator, size = self.allocator, self.size
        allocated, slots = self.alloc, self.slots
        ends = allocated[:, None] + np.arange(num_steps + 1)  # after each round's allocation
        slots_at = np.maximum(slots[:, None], -(-ends // size) * size)
        reserved, internal = decode_slack_rows(ends, slots_at, self.final_len)
        reserved += allocator.total_reserved - reserved[0]  # sequences outside the cohort
        internal += allocator.total_internal - internal[0]
        num_free = allocator.pool.num_free - ((slots_at - slots[:, None]) // size).sum(axis=0)
        cached_free = self._take_blocks(num_steps)
        self.alloc = ends[:, -1].copy()
        self.slots = slots_at[:, -1].copy()
        allocator.total_reserved, allocator.total_internal = int(reserved[-1]), int(internal[-1])
        free = num_free[:num_steps] * size
        idle = np.asarray(cached_free, dtype=np.int64) * size
        reserved, internal = reserved[:num_steps], internal[:num_steps]
        zero = np.zeros(num_steps, dtype=np.int64)
        return np.column_stack((allocator.num_blocks * size - free - reserved - internal, reserved,
                                internal, zero, idle, free - idle))

    def _take_blocks(self, num_steps: int) -> list[int]:
        """The block and keying events of rounds 1..num_steps in allocate's order (round, then
        member); returns the cached free blocks left after each round 0..num_steps - 1."""
        allocator, pool, size = self.allocator, self.allocator.pool, self.size
        start, have = self.alloc, self.slots
        # A member takes a block when its token passes its slots: at ends have + 1, + size, ...
        take_steps, take_members = _every(have + 1 - start, num_steps, size)
        if not allocator.enable_caching:
            order = np.lexsort((take_members, take_steps))
            records = self.records
            for index, block in zip(take_members[order].tolist(), pool.take(len(order))):
                records[index].table.append(block)
            return [pool.num_cached_free] * num_steps
        # keying where a token fills a block (block size 1: at the take itself)
        key_steps, key_members = (_every((start // size + 1) * size - start, num_steps, size)
                                  if size > 1 else (take_steps[:0], take_members[:0]))
        steps = np.concatenate((take_steps, key_steps))
        members = np.concatenate((take_members, key_members))
        takes = np.concatenate((np.ones(len(take_steps), bool), np.zeros(len(key_steps), bool)))
        order = np.lexsort((members, steps))
        cached_free, done = [pool.num_cached_free], 1
        for step, index, takes_block in zip(steps[order].tolist(), members[order].tolist(),
                                            takes[order].tolist()):
            while done < step:
                cached_free.append(pool.num_cached_free)
                done += 1
            record = self.records[index]
            if takes_block:
                record.table.extend(pool.take(1))
            allocator.key_full_blocks(self.seqs[index], record, int(start[index]) + step)
        while done < num_steps:
            cached_free.append(pool.num_cached_free)
            done += 1
        return cached_free[:num_steps]


def _every(first: np.ndarray, num_steps: int, period: int) -> tuple[np.ndarray, np.ndarray]:
    """(step, member) pairs for steps first[i], first[i] + period, ... up to num_steps, per member
    (first >= 1)."""
    counts = np.maximum(0, (num_steps - first) // period + 1)
    members = np.repeat(np.arange(len(first)), counts)
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return first[members] + offsets * period, members
