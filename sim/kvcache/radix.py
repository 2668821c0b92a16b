"""SGLang-style radix cache: a radix tree over token identities with lock references.

Each edge holds a run of pages (page_size tokens each, 1 by default: token-granular sharing) of
one owner request's token sequence; an edge's child is found by the identity of its first page
(the exact prefix key of sim.workload.request, so no two different prefixes collide). Because a
key at position e identifies all tokens before e, how far a sequence follows an edge is found by
binary search over pages.

    root ── [system prompt A] ──┬── [doc 7 ... task 3]   (lock_ref 1: a live request)
                                └── [doc 2 ... task 9]   (lock_ref 0: evictable leaf)

A live sequence locks the path from its deepest cached node to the root; only unlocked leaves are
evicted, smallest eviction sort key first (lru default, lfu, fifo), and a parent whose last child
goes becomes a leaf itself. As in SGLang (REFERENCE.md section 2), prefill chunks are inserted as
they are scheduled, decode tokens when the sequence ends; a sequence's tokens already in the tree
are freed as duplicates on insertion; the last known token is never matched. Unlike SGLang's
match_prefix, a lookup is a pure query: the edge is split and every node of the path counts a hit
and a last access when allocate takes the hit, so a request blocked at the head of the queue for
many steps counts once (as the block allocator does).
"""
from __future__ import annotations

import numpy as np

import heapq

from sim.errors import ConfigError
from sim.kvcache.base import (NO_HIT, KVUsage, PrefixHit, decode_rounds_token_by_token,
                              last_step_that_fits, refuse_hybrid_layout, slack_split)
from sim.kvcache.eviction import EVICTION_POLICIES


class RadixNode:
    __slots__ = ("parent", "children", "owner", "start", "end", "lock_ref", "last_access", "hits",
                 "created", "serial")

    def __init__(self, parent, owner, start: int, end: int, clock: int, serial: int):
        self.parent, self.owner, self.start, self.end = parent, owner, start, end
        self.serial = serial  # creation order: a deterministic tie-break
        self.children: dict[tuple, RadixNode] = {}
        self.lock_ref = 0
        self.last_access = self.created = clock
        self.hits = 0

    @property
    def length(self) -> int:
        return self.end - self.start


class RadixAllocator:
    def __init__(self, num_pages: int, page_size: int = 1, eviction: str = "lru"):
        if eviction not in EVICTION_POLICIES:
            raise ConfigError(f"unknown eviction policy '{eviction}', allocator config key "
                              f"eviction, use one of: {', '.join(EVICTION_POLICIES)}")
        self.num_pages, self.page_size = num_pages, page_size
        self._sort_key = EVICTION_POLICIES[eviction]
        self.clock = 0
        self._serials = iter(range(1 << 62)).__next__
        self.root = RadixNode(None, None, 0, 0, 0, self._serials())
        self.root.lock_ref = 1  # never evicted
        self.leaves: set[RadixNode] = set()
        self.tree_slots = 0
        self.locked_slots = 0
        self.private_slots = 0
        self.node_of: dict[int, RadixNode] = {}
        self.num_cached_tokens: dict[int, int] = {}
        self.num_allocated_tokens: dict[int, int] = {}
        self.final_len: dict[int, int] = {}

    @classmethod
    def from_pool(cls, pool, max_model_len: int, page_size: int = 1,
                  eviction: str = "lru") -> "RadixAllocator":
        refuse_hybrid_layout(pool, "radix")
        return cls(int(pool.pool_bytes // (pool.bytes_per_token * page_size)), page_size, eviction)

    @property
    def capacity(self) -> int:
        return self.num_pages * self.page_size

    def state_bytes(self) -> int:
        """Tree nodes (about 300 B each): a node per 16 pages at most in practice."""
        return 4096 + self.num_pages // 16 * 300

    @property
    def free_slots(self) -> int:
        return self.capacity - self.tree_slots - self.private_slots

    # -- ask -----------------------------------------------------------------------------------
    def lookup_prefix(self, seq) -> PrefixHit:
        """How many leading tokens the tree holds: a pure query (allocate takes them)."""
        limit = (seq.num_tokens - 1) // self.page_size * self.page_size
        _, position, _, partial = self._walk(seq.request, limit)
        matched = position + partial
        return PrefixHit(matched) if matched else NO_HIT

    def cached_prefix_tokens(self, request) -> int:
        """Tokens of a new request's prompt that lookup_prefix would find (for routers)."""
        limit = (request.prompt_len - 1) // self.page_size * self.page_size
        _, position, _, partial = self._walk(request, limit)
        return position + partial

    # -- act -----------------------------------------------------------------------------------
    def allocate(self, seq, num_new_tokens: int, hit: PrefixHit = NO_HIT, full_tokens: int = 0,
                 watermark: float = 0.0):
        """Slots for num_new_tokens more tokens, or None; full_tokens and watermark gate an
        admission as in the block allocator."""
        seq_id, page = seq.seq_id, self.page_size
        first = seq_id not in self.node_of
        node = None if first else self.node_of[seq_id]
        cached = hit.num_tokens if first else self.num_cached_tokens[seq_id]
        start = cached if first else self.num_allocated_tokens[seq_id]
        end = start + num_new_tokens
        need = (-(-end // page) - (-(-start // page))) * page
        required = need
        if first and (full_tokens or watermark):
            required = ((-(-max(end, full_tokens) // page) - (-(-start // page))) * page
                        + int(watermark * self.capacity))
        if required > self.free_slots:
            evictable = self.tree_slots - self.locked_slots
            if first:
                evictable -= self._unlocked_hit_slots(seq, hit.num_tokens)
            if required > self.free_slots + evictable:
                return None
        if first:
            node = self._take_prefix(seq, hit.num_tokens)
            self.node_of[seq_id], self.num_cached_tokens[seq_id] = node, cached
            self.final_len[seq_id] = seq.final_len
            self._lock(node, +1)
        if need > self.free_slots:
            self._evict(need - self.free_slots)
        self.private_slots += need
        self.num_allocated_tokens[seq_id] = end
        if num_new_tokens > 1:  # a prefill chunk: cache its full pages now
            self._insert(seq, end)
        return (need,) if need else ()

    def admission_stays_blocked(self, full_sequence_reserved: bool) -> bool:
        return False  # decode pages may evict the blocked head's cached path: not shown to hold

    def decode_steps_that_fit(self, seqs, limit: int) -> int:
        """Decode tokens take private pages, evicting unlocked cached ones when none are free."""
        page = self.page_size
        state = [(self.num_allocated_tokens[s.seq_id],
                  -(-self.num_allocated_tokens[s.seq_id] // page) * page) for s in seqs]
        available = (self.free_slots + self.tree_slots - self.locked_slots) // page
        return last_step_that_fits(state, available, page, limit)

    def decode_rounds(self, seqs, num_steps: int, first_waiting=None) -> np.ndarray:
        return decode_rounds_token_by_token(self, seqs, num_steps, first_waiting)

    def fork(self, parent, child) -> bool:
        """A new sequence sharing parent's cached path; its private pages are copied."""
        private = self._private_pages(parent.seq_id) * self.page_size
        if private > self.free_slots:
            if private > self.free_slots + self.tree_slots - self.locked_slots:
                return False
            self._evict(private - self.free_slots)
        node = self.node_of[parent.seq_id]
        self._lock(node, +1)
        self.node_of[child.seq_id] = node
        self.num_cached_tokens[child.seq_id] = self.num_cached_tokens[parent.seq_id]
        self.num_allocated_tokens[child.seq_id] = self.num_allocated_tokens[parent.seq_id]
        self.final_len[child.seq_id] = child.final_len
        self.private_slots += private
        return True

    def free(self, seq) -> None:
        seq_id = seq.seq_id
        self._insert(seq, self.num_allocated_tokens[seq_id])
        self.private_slots -= self._private_pages(seq_id) * self.page_size
        self._lock(self.node_of.pop(seq_id), -1)
        del self.num_cached_tokens[seq_id], self.num_allocated_tokens[seq_id], self.final_len[seq_id]

    def usage(self, first_waiting=None) -> KVUsage:
        reserved = internal = 0
        for seq_id, tokens in self.num_allocated_tokens.items():
            cached = self.num_cached_tokens[seq_id]
            slots = cached + self._private_pages(seq_id) * self.page_size
            r, i = slack_split(slots, tokens, self.final_len[seq_id])
            reserved += r
            internal += i
        used = self.locked_slots + self.private_slots
        cached_idle = self.tree_slots - self.locked_slots
        return KVUsage(capacity=self.capacity, token_states=used - reserved - internal,
                       reserved=reserved, internal_frag=internal, external_frag=0,
                       cached_idle=cached_idle, free=self.free_slots)

    # -- mechanics -----------------------------------------------------------------------------
    def _unlocked_hit_slots(self, seq, num_tokens: int) -> int:
        """Slots of the hit's first num_tokens tokens held by unlocked nodes (they stop being
        evictable once the hit is taken), counted without changing the tree."""
        if not num_tokens:
            return 0
        node, position, child, partial = self._walk(seq.request, num_tokens)
        if partial and child.lock_ref:
            return 0
        return partial + self._unlocked_path_slots(node)

    def _take_prefix(self, seq, num_tokens: int) -> RadixNode:
        """Split the hit's last edge at num_tokens and count a hit on every node of its path."""
        if not num_tokens:
            return self.root
        node, position = self._match(seq.request, 0, self.root, num_tokens)
        assert position == num_tokens, "a hit is taken in the step it was looked up"
        self.clock += 1
        walk = node
        while walk is not self.root:
            walk.last_access = self.clock
            walk.hits += 1
            walk = walk.parent
        return node

    def _private_pages(self, seq_id: int) -> int:
        page = self.page_size
        return -(-self.num_allocated_tokens[seq_id] // page) - self.num_cached_tokens[seq_id] // page

    def _walk(self, request, limit: int, node: RadixNode | None = None, position: int = 0):
        """Follow `request` from `node` (the root) at `position` up to `limit` tokens without
        changing the tree: (deepest node matched whole, its end, the child matched partway or
        None, tokens of it)."""
        page, node = self.page_size, node or self.root
        while position + page <= limit:
            child = node.children.get(request.prefix_key(position + page))
            if child is None:
                break
            matched = self._agreeing_pages(request, child, position, limit) * page
            if matched < child.length:
                return node, position, child, matched
            node, position = child, position + matched
        return node, position, None, 0

    def _agreeing_pages(self, request, child: RadixNode, position: int, limit: int) -> int:
        """Pages of child's edge (from position, at most up to limit) that request shares."""
        page, owner = self.page_size, child.owner
        low, high = 1, min(child.length, limit - position) // page
        while low < high:  # largest page count whose key still agrees
            mid = (low + high + 1) // 2
            end = position + mid * page
            if request.prefix_key(end) == owner.prefix_key(end):
                low = mid
            else:
                high = mid - 1
        return low

    def _match(self, request, position: int, node: RadixNode, limit: int):
        """Follow `request` from `node` at `position` up to `limit` tokens; split a partly
        matched edge so that the returned node ends exactly at the returned position."""
        node, position, child, partial = self._walk(request, limit, node, position)
        if partial:
            node, position = self._split(child, position + partial), position + partial
        return node, position

    def _split(self, child: RadixNode, at: int) -> RadixNode:
        """Cut child's edge at token `at`; the new upper node keeps child's lock state."""
        parent = child.parent
        upper = RadixNode(parent, child.owner, child.start, at, child.created, self._serials())
        upper.lock_ref, upper.last_access, upper.hits = child.lock_ref, child.last_access, child.hits
        key = child.owner.prefix_key(child.start + self.page_size)
        parent.children[key] = upper
        child.start, child.parent = at, upper
        upper.children[child.owner.prefix_key(at + self.page_size)] = child
        return upper

    def _insert(self, seq, upto: int) -> None:
        """Put the sequence's full pages below `upto` into the tree; move its lock down."""
        seq_id, page = seq.seq_id, self.page_size
        upto = upto // page * page
        cached = self.num_cached_tokens[seq_id]
        if upto <= cached:
            return
        old = self.node_of[seq_id]
        node, position = self._match(seq.request, cached, old, upto)
        self.private_slots -= position - cached  # tokens someone else cached: duplicates
        if position < upto:
            self.clock += 1
            leaf = RadixNode(node, seq.request, position, upto, self.clock, self._serials())
            node.children[seq.request.prefix_key(position + page)] = leaf
            self.leaves.discard(node)
            self.leaves.add(leaf)
            self.tree_slots += leaf.length
            self.private_slots -= leaf.length
            node = leaf
        self._lock(old, -1)
        self._lock(node, +1)
        self.node_of[seq_id], self.num_cached_tokens[seq_id] = node, upto

    def _lock(self, node: RadixNode, delta: int) -> None:
        while node is not self.root:
            if node.lock_ref == 0 and delta > 0:
                self.locked_slots += node.length
            node.lock_ref += delta
            if node.lock_ref == 0:
                self.locked_slots -= node.length
            node = node.parent

    def _unlocked_path_slots(self, node: RadixNode) -> int:
        total = 0
        while node is not self.root and node.lock_ref == 0:
            total += node.length
            node = node.parent
        return total

    def _evict(self, num_slots: int) -> None:
        heap = [(self._sort_key(leaf), leaf.serial, leaf)
                for leaf in self.leaves if leaf.lock_ref == 0]
        heapq.heapify(heap)
        evicted = 0
        while evicted < num_slots and heap:
            *_, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.owner.prefix_key(leaf.start + self.page_size)]
            self.leaves.discard(leaf)
            self.tree_slots -= leaf.length
            evicted += leaf.length
            if parent is not self.root and not parent.children:
                self.leaves.add(parent)
                if parent.lock_ref == 0:
                    heapq.heappush(heap, (self._sort_key(parent), parent.serial, parent))
