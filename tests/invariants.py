"""Invariant checks run after every allocator operation in the tests."""
from __future__ import annotations

from collections import Counter

from sim.kvcache.block import BlockAllocator
from sim.kvcache.contiguous import ContiguousAllocator


def check_block_allocator(alloc: BlockAllocator, live: dict) -> None:
    size = alloc.block_size
    owners = Counter(b for table in alloc.tables.values() for b in table)
    in_queue = set(alloc.pool.free_blocks())
    assert len(in_queue) == len(alloc.pool.free_blocks()) == alloc.num_free_blocks
    for block in range(alloc.num_blocks):
        assert alloc.pool.ref_count[block] == owners[block], f"block {block}: ref count != owners"
        assert (block in in_queue) == (owners[block] == 0), f"block {block}: leaked or double-owned"
    for seq_id, table in alloc.tables.items():
        assert len(set(table)) == len(table)
        tokens = alloc.seqs[seq_id].num_tokens
        assert len(table) == -(-tokens // size), "a table holds a block it does not need"
    assert set(alloc.tables) == set(live)
    # Cached content always matches what a lookup returns.
    for key, block in alloc.pool.cached.items():
        assert alloc.pool.block_key[block] == key
    for seq_id, table in alloc.tables.items():
        request = live[seq_id].request
        for i in range(alloc.seqs[seq_id].num_keyed):
            assert alloc.pool.block_key[table[i]] == request.prefix_key((i + 1) * size)
    assert alloc.pool.num_cached_free == sum(1 for b in in_queue if alloc.pool.block_key[b] is not None)
    _check_usage(alloc, expected_token_states=_block_token_states(alloc))


def _block_token_states(alloc: BlockAllocator) -> int:
    """Slots holding KV, block by block: a shared block counts once, filled as far as any owner."""
    size, filled = alloc.block_size, {}
    for seq_id, table in alloc.tables.items():
        tokens = alloc.seqs[seq_id].num_tokens
        for i, block in enumerate(table):
            filled[block] = max(filled.get(block, 0), min(size, tokens - i * size))
    return sum(filled.values())


def check_contiguous_allocator(alloc: ContiguousAllocator, live: dict) -> None:
    spans = sorted([*alloc.holes(), *alloc.extents.values()])
    assert all(alloc.reservation[i] <= n for i, (_, n) in alloc.extents.items())
    position = 0
    for start, length in spans:  # holes and extents tile the address space exactly
        assert start == position and length > 0
        position += length
    assert position == alloc.num_slots
    holes = alloc.holes()
    if type(alloc.space).__name__ == "FirstFit":
        for (s1, n1), (s2, _) in zip(holes, holes[1:]):
            assert s1 + n1 < s2, "adjacent holes were not coalesced"
    else:  # buddy: blocks are aligned powers of two, and no two free buddies stay apart
        starts = {(start, n) for start, n in holes}
        for start, n in holes:
            assert n & (n - 1) == 0 and start % n == 0
            buddy = (start ^ n, n)
            assert buddy not in starts or start ^ n >= alloc.num_slots
    assert set(alloc.extents) == set(live)
    for seq_id, seq in live.items():
        assert alloc.num_allocated_tokens[seq_id] == seq.num_allocated
    _check_usage(alloc, expected_token_states=sum(alloc.num_allocated_tokens.values()))


def _check_usage(alloc, expected_token_states: int) -> None:
    usage = alloc.usage(None)
    parts = usage.as_tuple()
    assert all(p >= 0 for p in parts), usage
    assert sum(parts) == usage.capacity
    assert usage.token_states == expected_token_states
