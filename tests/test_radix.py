"""Radix cache: exact splits, locks and evictions, then random operation sequences."""
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.kvcache.radix import RadixAllocator
from tests.helpers import Seq, seq


def edges(alloc):
    """(start, end, lock_ref) of every node below the root, depth first, children by start."""
    out = []

    def walk(node, depth):
        for child in sorted(node.children.values(), key=lambda c: (c.start, c.owner.request_id)):
            out.append((depth, child.start, child.end, child.lock_ref))
            walk(child, depth + 1)
    walk(alloc.root, 0)
    return out


def run_prefill(alloc, s):
    hit = alloc.lookup_prefix(s)
    assert alloc.allocate(s, s.num_tokens - hit.num_tokens, hit) is not None
    return hit.num_tokens


def test_shared_system_prompt_splits_the_first_edge():
    alloc = RadixAllocator(num_pages=100)
    a = seq(1, [(1, 10), (2, 5)])
    assert run_prefill(alloc, a) == 0
    assert edges(alloc) == [(0, 0, 15, 1)]
    b = seq(2, [(1, 10), (3, 4)])
    assert run_prefill(alloc, b) == 10                     # token-granular hit: no block rounding
    assert edges(alloc) == [(0, 0, 10, 2), (1, 10, 15, 1), (1, 10, 14, 1)]
    assert alloc.usage().token_states == 19                # 10 shared + 5 + 4


def test_last_known_token_is_never_matched():
    alloc = RadixAllocator(num_pages=100)
    run_prefill(alloc, seq(1, [(1, 10)]))
    assert alloc.lookup_prefix(seq(2, [(1, 10)])).num_tokens == 9


def test_only_unlocked_leaves_are_evicted_and_parents_follow():
    alloc = RadixAllocator(num_pages=40)
    a, b = seq(1, [(1, 10), (2, 5)]), seq(2, [(1, 10), (3, 4)])
    run_prefill(alloc, a)
    run_prefill(alloc, b)
    alloc.free(a)
    alloc.free(b)
    assert alloc.usage().cached_idle == 19 and alloc.locked_slots == 0
    c = seq(3, [(1, 10), (2, 5), (4, 3)])                  # hits a's 15 tokens and locks them
    assert run_prefill(alloc, c) == 15
    assert alloc.free_slots == 18
    d = seq(4, [(9, 20)])                                  # 18 free + b's unlocked 4-token leaf
    assert run_prefill(alloc, d) == 0
    assert edges(alloc) == [(0, 0, 10, 1), (1, 10, 15, 1), (2, 15, 18, 1), (0, 0, 20, 1)]
    e = seq(5, [(8, 25)])
    assert alloc.allocate(e, 25) is None                   # everything else is locked
    alloc.free(c)
    alloc.free(d)
    # Least recently used first: c's leaf, then its parents as they become leaves, then d.
    assert run_prefill(alloc, e) == 0
    assert edges(alloc) == [(0, 0, 25, 1)]
    assert alloc.usage().free == 15


def take_hit(alloc, s):
    """A request that takes its cached prefix and leaves: hits count where blocks are taken."""
    hit = alloc.lookup_prefix(s)
    assert alloc.allocate(s, 0, hit) is not None
    alloc.free(s)


def test_lookups_are_pure_queries_and_a_hit_counts_once_when_taken():
    alloc = RadixAllocator(num_pages=32)
    run_prefill(alloc, seq(1, [(1, 6), (2, 6)]))
    alloc.free(seq(1, [(1, 6), (2, 6)]))
    before = edges(alloc), alloc.clock
    blocked = seq(2, [(1, 6), (3, 30)])                  # shares 6 of the 12-token edge
    for _ in range(3):
        assert alloc.lookup_prefix(blocked).num_tokens == 6
    assert (edges(alloc), alloc.clock) == before         # no split, no hit, no clock tick
    # 30 new slots: 20 free and 6 evictable (the edge's other half) are not enough, and a
    # refused admission leaves the tree as it was, as the scheduler retries it every step.
    assert alloc.allocate(blocked, 30, alloc.lookup_prefix(blocked)) is None
    assert (edges(alloc), alloc.clock) == before
    take_hit(alloc, seq(3, [(1, 6), (4, 1)]))
    nodes = [alloc.root]
    while nodes[-1].children:
        nodes.append(next(iter(nodes[-1].children.values())))
    assert [(n.end - n.start, n.hits) for n in nodes[1:]] == [(6, 1), (6, 0)]  # split when taken


def test_lru_lfu_and_fifo_choose_different_victims():
    def survivor(policy):
        alloc = RadixAllocator(num_pages=16, eviction=policy)
        x, y = seq(1, [(1, 6)]), seq(2, [(2, 7)])
        run_prefill(alloc, x)
        alloc.free(x)                                      # x (6 tokens) cached first
        run_prefill(alloc, y)
        alloc.free(y)                                      # then y (7 tokens); 3 slots free
        for i in range(3):                                 # x hit three times
            take_hit(alloc, seq(10 + i, [(1, 6), (5 + i, 1)]))
        take_hit(alloc, seq(20, [(2, 7), (9, 1)]))         # y hit once, most recently
        run_prefill(alloc, seq(30, [(7, 8)]))              # needs 8: one of x, y must go
        return [e[2] - e[1] for e in edges(alloc) if e[3] == 0]
    assert survivor("lru") == [7]       # x was least recently used
    assert survivor("lfu") == [6]       # y had the fewest hits
    assert survivor("fifo") == [7]      # x was cached first


@st.composite
def operations(draw):
    return draw(st.lists(st.tuples(st.sampled_from(["new", "grow", "free", "fork"]), st.integers(0, 4),
                                   st.integers(1, 6)), min_size=1, max_size=40))


PROMPTS = [[(1, 7)], [(1, 7), (2, 5)], [(1, 7), (3, 9)], [(4, 13)], [(1, 3)]]


@settings(max_examples=150, deadline=None)
@given(ops=operations(), page=st.sampled_from([1, 2, 4]), pages=st.integers(8, 40),
       policy=st.sampled_from(["lru", "lfu", "fifo"]))
def test_radix_invariants_hold_after_every_operation(ops, page, pages, policy):
    alloc = RadixAllocator(pages, page, policy)
    live, next_id = {}, 100
    for kind, which, amount in ops:
        if kind == "new":
            s = seq(next_id, PROMPTS[which], output_len=amount)
            next_id += 1
            hit = alloc.lookup_prefix(s)
            assert hit.num_tokens % page == 0 and hit.num_tokens < s.num_tokens
            if alloc.allocate(s, s.num_tokens - hit.num_tokens, hit) is not None:
                live[s.seq_id] = s
        elif kind == "grow" and live:
            s = live[sorted(live)[which % len(live)]]
            s.num_tokens += amount
            if alloc.allocate(s, amount) is None:
                s.num_tokens -= amount
        elif kind == "free" and live:
            alloc.free(live.pop(sorted(live)[which % len(live)]))
        elif kind == "fork" and live:
            parent = live[sorted(live)[which % len(live)]]
            child = Seq(next_id, parent.request, parent.num_tokens, parent.final_len)
            next_id += 1
            if alloc.fork(parent, child):
                live[child.seq_id] = child
        check_radix(alloc, live)


def check_radix(alloc, live):
    locks, tree, locked = {}, 0, 0
    for s in live.values():  # every live sequence locks its path to the root
        node = alloc.node_of[s.seq_id]
        while node is not alloc.root:
            locks[id(node)] = locks.get(id(node), 0) + 1
            node = node.parent
    stack = [alloc.root]
    while stack:
        node = stack.pop()
        for key, child in node.children.items():
            assert child.parent is node and child.start == node.end
            assert key == child.owner.prefix_key(child.start + alloc.page_size)
            assert child.length > 0 and child.length % alloc.page_size == 0
            assert child.lock_ref == locks.get(id(child), 0), "lock refs differ from live owners"
            tree += child.length
            locked += child.length if child.lock_ref else 0
            assert (not child.children) == (child in alloc.leaves)
            stack.append(child)
    assert (tree, locked) == (alloc.tree_slots, alloc.locked_slots)
    usage = alloc.usage()
    assert min(usage.as_tuple()) >= 0 and sum(usage.as_tuple()) == usage.capacity
    for s in live.values():  # cached content always matches what a lookup returns
        node, cached = alloc.node_of[s.seq_id], alloc.num_cached_tokens[s.seq_id]
        assert node.end == cached or node is alloc.root
        if cached:
            assert node.owner.prefix_key(cached) == s.request.prefix_key(cached)
