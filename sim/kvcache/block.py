"""Paged KV allocation (PagedAttention) with optional vLLM-style prefix caching, in three layers:

- the block pool (sim.kvcache.block_pool): reference counts, the free queue, cached keys;
- prefix caching: every full block gets the key of the token prefix it ends (parent chain
  included, see sim.workload.request), so a later sequence with the same prefix reuses it;
- the paged allocator here: one record per sequence (its block table, tokens allocated, blocks
  keyed, final length), copy-on-write of a shared partial last block, and the waste accounting.

As in vLLM v1 (REFERENCE.md section 2): lookup walks full-block keys from the left and stops at
the first miss, never covering the last known token, and changes nothing (hits are counted when
allocate takes the blocks); a finished sequence's blocks are freed deepest first, so shared
shallow blocks are evicted last; identical blocks computed concurrently are both kept. Forked
sequences (parallel samples, beams) share every block by reference count; a write into a shared
partial last block first copies it (copy-on-write).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from itertools import islice, takewhile
from operator import is_not

import numpy as np

from sim.errors import ConfigError
from sim.kvcache.base import (NO_HIT, KVUsage, PrefixHit, decode_rounds_token_by_token,
                              last_step_that_fits, slack_split)
from sim.kvcache.block_pool import BlockPool
from sim.kvcache.paged_cohort import PagedCohort


_is_block = partial(is_not, None)  # a cached key's block, not a miss


@dataclass(slots=True)
class SeqBlocks:
    """One sequence's blocks: table[i] holds tokens [i * size, (i + 1) * size)."""
    table: list[int]
    num_tokens: int   # token slots allocated (computed or about to be)
    num_keyed: int    # leading blocks keyed in the prefix cache
    final_len: int    # L: the sequence never grows past it
    forked: bool = False


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 eviction: str = "lru"):
        self.pool = BlockPool(num_blocks, eviction)
        self.num_blocks, self.block_size, self.enable_caching = num_blocks, block_size, enable_caching
        self.seqs: dict[int, SeqBlocks] = {}
        self._keys: dict[int, list[tuple]] = {}  # each live sequence's block keys, computed once
        self.tiers = None  # KV tiers below HBM (attach_tiers)
        self.num_forked = 0
        self.num_cow_copies = 0
        self.num_copied_tokens = 0  # KV token slots copied (copy-on-write), timed in the next step
        # Slack of each sequence's partial last block, summed (exact while nothing is forked).
        self.total_reserved = 0
        self.total_internal = 0

    def completion_need(self, seq, step_tokens: int) -> list[int]:
        """guaranteed_no_evict (sim.scheduler.reservations): the blocks of seq's whole length."""
        return [-(-seq.final_len // self.block_size)]

    def fork_need(self, seq, step_tokens: int) -> list[int]:
        """Each further sample's blocks past the prompt's full blocks it shares (fork)."""
        return [-(-seq.final_len // self.block_size) - seq.request.prompt_len // self.block_size]

    @property
    def completion_capacity(self) -> list[int]:
        return [self.num_blocks]

    @classmethod
    def from_pool(cls, pool, max_model_len: int, enable_caching: bool = False,
                  eviction: str = "lru", pools: str = "shared") -> "BlockAllocator":
        """pools: for a model with sliding or chunked layers, one shared pool (vLLM's hybrid
        manager) or one per layer kind (TensorRT-LLM's); other models have one kind of block."""
        if getattr(pool, "layout", None) is not None and enable_caching:
            from sim.kvcache.hybrid_prefix import HybridPrefixAllocator
            return HybridPrefixAllocator.from_pool(pool, max_model_len, eviction, pools)
        if getattr(pool, "layout", None) is not None:
            from sim.kvcache.hybrid import HybridBlockAllocator
            return HybridBlockAllocator.from_pool(pool, max_model_len, pools)
        if pools != "shared":
            raise ConfigError(f"pools={pools} applies to models with sliding or chunked layers only, "
                              f"allocator key pools, leave it shared (the default)")
        return cls(pool.num_blocks, pool.block_size, enable_caching, eviction)

    @property
    def capacity(self) -> int:
        return self.num_blocks * self.block_size

    def state_bytes(self) -> int:
        """Per-block lists and the free queue (about 80 B measured with tracemalloc, LRU; other
        eviction orders keep heap entries, about 250 B); caching adds keys and the key map once
        blocks are keyed (up to about 500 B)."""
        if self.enable_caching:
            return self.num_blocks * 500
        return self.num_blocks * (100 if self.pool.eviction == "lru" else 300)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def tables(self) -> dict[int, list[int]]:
        """Each live sequence's block table (a view for reports and tests)."""
        return {seq_id: record.table for seq_id, record in self.seqs.items()}

    # -- prefix caching ------------------------------------------------------------------------
    def lookup_prefix(self, seq) -> PrefixHit:
        """Cached full blocks at the start of seq; a pure query."""
        if not self.enable_caching:
            return NO_HIT
        count = (seq.num_tokens - 1) // self.block_size
        keys = self._block_keys(seq, count)
        blocks = tuple(takewhile(_is_block, map(self.pool.cached.get, islice(keys, count))))
        if self.tiers is not None and len(blocks) < count:  # the rest from the tiers below HBM
            loaded = self.tiers.extend(keys[len(blocks):count])
            if loaded:
                return PrefixHit((len(blocks) + sum(loaded)) * self.block_size, blocks, loaded)
        return PrefixHit(len(blocks) * self.block_size, blocks) if blocks else NO_HIT

    def attach_tiers(self, tiers) -> None:
        """KV tiers below HBM (sim.kvcache.tiers.TierChain): blocks HBM evicts or keys go
        there, and lookups continue there."""
        self.tiers = tiers
        self.pool.observe(evicted=tiers.evicted, keyed=tiers.computed if tiers.writes_through else None)

    def consume_load_s(self) -> float:
        """Seconds of tier loads for the admissions since the last call (one step's)."""
        return self.tiers.consume_load_s() if self.tiers is not None else 0.0

    def cached_prefix_tokens(self, request) -> int:
        """Tokens of a new request's prompt that lookup_prefix would find cached now (a pure
        query for routers: nothing is kept)."""
        if not self.enable_caching:
            return 0
        count = (request.prompt_len - 1) // self.block_size
        keys = request.prefix_keys(self.block_size, 0, count)
        found = sum(1 for _ in takewhile(_is_block, map(self.pool.cached.get, keys)))
        if self.tiers is not None and found < count:  # this replica's own CPU and disk tiers
            found += self.tiers.local_run(keys[found:count])
        return found * self.block_size

    def _block_keys(self, seq, count: int) -> list[tuple]:
        """The keys of seq's first count blocks (or more), each computed once while seq lives."""
        keys = self._keys.setdefault(seq.seq_id, [])
        if len(keys) < count:
            keys.extend(seq.request.prefix_keys(self.block_size, len(keys), count))
        return keys

    def key_full_blocks(self, seq, record: SeqBlocks, end: int) -> None:
        """Key the blocks that tokens up to `end` filled (one clock tick for the call)."""
        pool, first, last = self.pool, record.num_keyed, end // self.block_size
        pool.clock += 1
        if last <= first:
            return
        keys = self._block_keys(seq, last)
        pool.set_keys(record.table[first:last], keys[first:last])
        record.num_keyed = last

    # -- allocation ----------------------------------------------------------------------------
    def allocate(self, seq, num_new_tokens: int, hit: PrefixHit = NO_HIT, full_tokens: int = 0,
                 watermark: float = 0.0):
        """Blocks for num_new_tokens more tokens, or None. On admission (a sequence without
        blocks), full_tokens > 0 requires room for that many tokens in all, and watermark keeps
        that share of all blocks free (vLLM v1's allocate_slots admission gate)."""
        size = self.block_size
        record = self.seqs.get(seq.seq_id)
        if record is None:
            return self._admit(seq, num_new_tokens, hit, full_tokens, watermark)
        start = record.num_tokens
        end = start + num_new_tokens
        copy_on_write = start % size != 0 and self.pool.ref_count[record.table[-1]] > 1
        if end <= len(record.table) * size and not copy_on_write:
            # Fast path (most decode steps): the tokens land in the last block's slack.
            consumed_reserved = max(0, min(end, record.final_len) - start)
            self.total_reserved -= consumed_reserved
            self.total_internal -= num_new_tokens - consumed_reserved
            record.num_tokens = end
            if self.enable_caching and end // size > record.num_keyed:
                self.key_full_blocks(seq, record, end)
            return ()
        num_needed = -(-end // size) - len(record.table) + copy_on_write
        if num_needed > self.pool.num_free:
            return None
        self._count_slack(record, -1)
        new_blocks = self.pool.take(num_needed)
        record.table.extend(self._copy_last_block(record, new_blocks) if copy_on_write else new_blocks)
        record.num_tokens = end
        self._count_slack(record, +1)
        if self.enable_caching:
            self.key_full_blocks(seq, record, end)
        return new_blocks

    def _admit(self, seq, num_new_tokens: int, hit: PrefixHit, full_tokens: int, watermark: float):
        size, pool = self.block_size, self.pool
        end = hit.num_tokens + num_new_tokens
        num_needed = -(-end // size) - len(hit.blocks)
        revived = sum(1 for b in hit.blocks if pool.ref_count[b] == 0)
        required = num_needed
        if full_tokens or watermark:
            required = (max(num_needed, -(-full_tokens // size) - len(hit.blocks))
                        + int(watermark * self.num_blocks))
        if required > pool.num_free - revived:
            return None
        if hit.loaded:  # before taking blocks, whose evictions go down the tiers
            first = len(hit.blocks)
            self.tiers.load(self._keys[seq.seq_id][first:first + sum(hit.loaded)])
        pool.touch(hit.blocks)
        new_blocks = pool.take(num_needed)
        record = self.seqs[seq.seq_id] = SeqBlocks([*hit.blocks, *new_blocks], end, len(hit.blocks),
                                                   seq.final_len)
        self._count_slack(record, +1)
        if self.enable_caching:
            self.key_full_blocks(seq, record, end)
        return new_blocks

    # -- copy-on-write -------------------------------------------------------------------------
    def fork(self, parent, child) -> bool:
        """Share all of parent's blocks with a new sequence `child` (always fits)."""
        record = self.seqs[parent.seq_id]
        self.pool.share(record.table)
        twin = self.seqs[child.seq_id] = SeqBlocks(list(record.table), record.num_tokens,
                                                   record.num_keyed, child.final_len, forked=True)
        self._count_slack(twin, +1)
        self.num_forked += 1
        return True

    def _copy_last_block(self, record: SeqBlocks, new_blocks: tuple[int, ...]) -> tuple[int, ...]:
        """A write into a shared partial last block: the first new block takes its copy."""
        self.pool.drop_reference(record.table[-1])
        record.table[-1] = new_blocks[0]
        self.num_cow_copies += 1
        self.num_copied_tokens += self.block_size
        return new_blocks[1:]

    def rewind(self, seq, num_tokens: int) -> None:
        """Speculative decoding: the sequence holds KV for num_tokens tokens only, its rejected
        draft slots (already allocated) back to slack for the next step's drafts."""
        record = self.seqs[seq.seq_id]
        self._count_slack(record, -1)
        record.num_tokens = num_tokens
        self._count_slack(record, +1)

    def free(self, seq) -> None:
        self._keys.pop(seq.seq_id, None)
        record = self.seqs.pop(seq.seq_id)
        self._count_slack(record, -1)
        self.num_forked -= record.forked
        self.pool.release(reversed(record.table))

    # -- waste accounting ----------------------------------------------------------------------
    def usage(self, first_waiting=None) -> KVUsage:
        size = self.block_size
        if self.num_forked:
            reserved, internal = self._shared_tail_slack()
        else:  # no forked sequence alive: every partial last block has one owner
            reserved, internal = self.total_reserved, self.total_internal
        num_free = self.pool.num_free
        cached_idle = self.pool.num_cached_free * size
        return KVUsage(
            capacity=self.capacity,
            token_states=(self.num_blocks - num_free) * size - reserved - internal,
            reserved=reserved, internal_frag=internal, external_frag=0,
            cached_idle=cached_idle, free=num_free * size - cached_idle)

    def _count_slack(self, record: SeqBlocks, sign: int) -> None:
        """Add (+1) or remove (-1) a sequence's last-block slack from the running totals."""
        reserved, internal = slack_split(len(record.table) * self.block_size, record.num_tokens,
                                         record.final_len)
        self.total_reserved += sign * reserved
        self.total_internal += sign * internal

    def _shared_tail_slack(self) -> tuple[int, int]:
        """Slack of the distinct partial last blocks: forked sequences may share one."""
        size = self.block_size
        tail: dict[int, tuple[int, int, int]] = {}  # last block -> (slots, computed, L)
        for record in self.seqs.values():
            tokens, slots = record.num_tokens, len(record.table) * size
            if slots > tokens:
                known = tail.get(record.table[-1])
                if known is None or record.final_len > known[2]:  # a shared tail counts once
                    tail[record.table[-1]] = (slots, tokens, record.final_len)
        reserved = internal = 0
        for slots, tokens, final_len in tail.values():
            r, i = slack_split(slots, tokens, final_len)
            reserved += r
            internal += i
        return reserved, internal

    # -- decode stretches ----------------------------------------------------------------------
    def decode_cohort(self) -> PagedCohort:
        """Memory of a decode cohort (sim.scheduler.cohort), kept in arrays."""
        return PagedCohort(self)

    def admission_stays_blocked(self, full_sequence_reserved: bool) -> bool:
        """Whether an admission refused for memory stays refused while the running sequences
        only decode. Free blocks only shrink; a prefix hit only shrinks, as decode blocks evict
        its cached blocks. When the whole sequence must fit, each block lost from the hit adds
        one to the need and at most one to what is usable. Otherwise a chunk capped by the budget
        needs no more, so only LRU is safe: it evicts a hit from its deepest block up (a parent
        is freed after its children), one block lost from the hit per block taken."""
        return not self.enable_caching or full_sequence_reserved or self.pool.eviction == "lru"

    def decode_steps_that_fit(self, seqs, limit: int) -> int:
        """The largest k <= limit such that decode steps 2..k of seqs (one token each, step 1
        already allocated) all find blocks; 1 when a pending copy-on-write would need more."""
        size, ref_count, state = self.block_size, self.pool.ref_count, []
        for seq in seqs:
            record = self.seqs[seq.seq_id]
            if record.num_tokens % size and ref_count[record.table[-1]] > 1:
                return 1
            state.append((record.num_tokens, len(record.table) * size))
        return last_step_that_fits(state, self.pool.num_free, size, limit)

    def decode_rounds(self, seqs, num_steps: int, first_waiting=None) -> np.ndarray:
        """As num_steps rounds of usage() then allocate(seq, 1) for each seq (the usages as rows
        of KVUsage.as_tuple()), with the same state after: blocks are taken and full blocks
        keyed in the same order (step by step, sequence by sequence), and the slack totals are
        recomputed from the sequences' ends."""
        if self.num_forked:  # tails shared between samples: count them one token at a time
            return decode_rounds_token_by_token(self, seqs, num_steps, first_waiting)
        cohort = PagedCohort(self)  # the same rounds, over arrays
        cohort.join(list(seqs))
        rows = cohort.rounds(num_steps)
        cohort.flush()
        return rows
