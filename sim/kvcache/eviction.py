"""Eviction orders for cached KV (prefix blocks, radix nodes): one sort key each, smallest first.

Each key reads an entry's `last_access` and `hits` (logical clock ticks and lookup hits) and
`created` (when its content was first cached). SGLang's radix cache ships the same three
(REFERENCE.md section 2); LRU is the default everywhere.

Free blocks of the paged pool (sim.kvcache.block_pool) also carry `keyed`: LRU is vLLM's free
queue, which takes blocks in the order they were freed whatever they hold; LFU and FIFO take the
blocks holding no cached KV first, since their counts say nothing about reuse.
"""
from __future__ import annotations


def lru(entry) -> tuple:
    return (entry.last_access,)


def lfu(entry) -> tuple:
    return (entry.hits, entry.last_access)


def fifo(entry) -> tuple:
    return (entry.created, entry.last_access)


EVICTION_POLICIES = {"lru": lru, "lfu": lfu, "fifo": fifo}


def _cached_last(policy):
    return lambda entry: (entry.keyed, *policy(entry)) if entry.keyed else (False,)


# None: the order blocks were freed in (for LRU the same as sorting on last_access, kept as a FIFO).
BLOCK_EVICTION_ORDERS = {"lru": None, "lfu": _cached_last(lfu), "fifo": _cached_last(fifo)}
