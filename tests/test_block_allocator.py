"""Paged and prefix allocators: exact block ids in tiny pools, then random operation sequences."""
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.kvcache.block import BlockAllocator
from tests.helpers import Seq, seq
from tests.invariants import check_block_allocator


def test_paged_allocates_on_demand_and_frees_deepest_first():
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    a, b = seq(1, [(1, 6)]), seq(2, [(2, 5)])
    assert alloc.allocate(a, 6) == (0, 1)
    assert alloc.allocate(b, 5) == (2, 3)
    assert alloc.allocate(a, 2) == ()          # tokens 6, 7 fill block 1
    assert alloc.allocate(a, 1) == (4,)        # token 8 opens block 4
    alloc.free(a)
    # Remaining free blocks first, then a's blocks appended in reverse order.
    assert alloc.pool.free_blocks() == [5, 6, 7, 4, 1, 0]
    assert alloc.lookup_prefix(b).num_tokens == 0   # no caching in `paged`


def test_paged_returns_none_without_side_effects_when_full():
    alloc = BlockAllocator(num_blocks=3, block_size=4)
    a, b = seq(1, [(1, 8)]), seq(2, [(2, 8)])
    assert alloc.allocate(a, 8) == (0, 1)
    assert alloc.allocate(b, 8) is None
    assert alloc.num_free_blocks == 1 and 2 not in alloc.tables


def test_last_block_slack_is_reserved_then_internal_beyond_final_length():
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    a = seq(1, [(1, 5)], output_len=1)        # L = 6: positions 5 will be filled, 6..7 never
    alloc.allocate(a, 5)
    usage = alloc.usage()
    assert (usage.token_states, usage.reserved, usage.internal_frag) == (5, 1, 2)


def test_prefix_hit_shares_blocks_and_never_covers_the_last_token():
    alloc = BlockAllocator(num_blocks=8, block_size=4, enable_caching=True)
    a, b = seq(1, [(1, 10)]), seq(2, [(1, 10)])
    assert alloc.allocate(a, 10) == (0, 1, 2)
    hit = alloc.lookup_prefix(b)
    assert (hit.num_tokens, hit.blocks) == (8, (0, 1))   # floor((10 - 1) / 4) = 2 full blocks
    assert alloc.allocate(b, 2, hit) == (3,)
    assert alloc.pool.ref_count[:4] == [2, 2, 1, 1]
    assert alloc.usage().token_states == 12             # 8 shared slots counted once + 2 + 2
    exact = seq(3, [(1, 8)])
    assert alloc.lookup_prefix(exact).num_tokens == 4     # 8 tokens: only (8 - 1) // 4 = 1 block
    alloc.free(a)
    alloc.free(b)
    assert alloc.pool.free_blocks() == [4, 5, 6, 7, 2, 3, 1, 0]
    assert alloc.usage().cached_idle == 8                # blocks 0 and 1 keep their keys


def test_different_prefix_before_equal_content_does_not_hit():
    alloc = BlockAllocator(num_blocks=8, block_size=4, enable_caching=True)
    alloc.allocate(seq(1, [(1, 4), (2, 8)]), 12)
    assert alloc.lookup_prefix(seq(2, [(9, 4), (2, 8)])).num_tokens == 0
    assert alloc.lookup_prefix(seq(3, [(1, 4), (2, 8), (5, 3)])).num_tokens == 12


def test_cached_block_is_evicted_lazily_when_popped_for_reuse():
    alloc = BlockAllocator(num_blocks=4, block_size=4, enable_caching=True)
    a = seq(1, [(1, 9)])
    alloc.allocate(a, 9)              # blocks 0, 1 keyed; block 2 partial
    alloc.free(a)                     # queue: [3, 2, 1, 0]
    again = seq(2, [(1, 9)])
    assert alloc.lookup_prefix(again).num_tokens == 8
    alloc.allocate(seq(3, [(7, 12)]), 12)   # pops 3, 2, 1: block 1's key is dropped
    assert alloc.lookup_prefix(again).num_tokens == 4
    assert alloc.pool.free_blocks() == [0]


def test_revived_hit_blocks_count_against_free_space():
    alloc = BlockAllocator(num_blocks=3, block_size=4, enable_caching=True)
    alloc.allocate(seq(1, [(1, 9)]), 9)
    alloc.free(seq(1, [(1, 9)]))
    b = seq(2, [(1, 16)])
    hit = alloc.lookup_prefix(b)
    assert hit.num_tokens == 8
    # Needs blocks for tokens 8..15 (2 more) but only 1 block is free besides the hit blocks.
    assert alloc.allocate(b, 8, hit) is None
    assert alloc.allocate(b, 4, hit) == (2,)


# -- random operation sequences against a reference model -------------------------------------
PROMPTS = [[(1, 7)], [(1, 7), (2, 5)], [(1, 7), (3, 9)], [(4, 13)], [(1, 3)]]


@st.composite
def operations(draw):
    return draw(st.lists(st.tuples(st.sampled_from(["new", "grow", "free", "fork"]),
                                   st.integers(0, len(PROMPTS) - 1), st.integers(1, 6)),
                         min_size=1, max_size=40))


@settings(max_examples=150, deadline=None)
@given(ops=operations(), block_size=st.sampled_from([1, 2, 4, 8]), caching=st.booleans(),
       num_blocks=st.integers(4, 24), eviction=st.sampled_from(["lru", "lfu", "fifo"]))
def test_block_allocator_invariants_hold_after_every_operation(ops, block_size, caching, num_blocks,
                                                               eviction):
    alloc = BlockAllocator(num_blocks, block_size, enable_caching=caching, eviction=eviction)
    live, tokens, next_id = {}, {}, 100
    for kind, which, amount in ops:
        if kind == "new":
            s = seq(next_id, PROMPTS[which], output_len=amount)
            next_id += 1
            hit = alloc.lookup_prefix(s)
            assert hit.num_tokens % block_size == 0 and hit.num_tokens < s.num_tokens
            if alloc.allocate(s, s.num_tokens - hit.num_tokens, hit) is not None:
                live[s.seq_id], tokens[s.seq_id] = s, s.num_tokens
        elif kind == "grow" and live:
            s = live[sorted(live)[which % len(live)]]
            s.num_tokens += amount
            if alloc.allocate(s, amount) is not None:
                tokens[s.seq_id] += amount
            else:
                s.num_tokens -= amount
        elif kind == "free" and live:
            s = live.pop(sorted(live)[which % len(live)])
            del tokens[s.seq_id]
            alloc.free(s)
        elif kind == "fork" and live:
            parent = live[sorted(live)[which % len(live)]]
            child = Seq(next_id, parent.request, parent.num_tokens, parent.final_len)
            next_id += 1
            assert alloc.fork(parent, child)
            live[child.seq_id], tokens[child.seq_id] = child, tokens[parent.seq_id]
            assert alloc.tables[child.seq_id] == alloc.tables[parent.seq_id]
        check_block_allocator(alloc, live)
        assert all(alloc.seqs[i].num_tokens == n for i, n in tokens.items())


def test_lfu_and_fifo_evict_unkeyed_blocks_first_then_by_their_key():
    def evicted(policy):
        alloc = BlockAllocator(num_blocks=4, block_size=4, enable_caching=True, eviction=policy)
        x, y = seq(1, [(1, 4)], output_len=1), seq(2, [(2, 4)], output_len=1)
        alloc.allocate(x, 4)
        alloc.free(x)                                    # block 0 keyed by x, cached first
        alloc.allocate(y, 4)
        alloc.free(y)                                    # block 1 keyed by y
        for i in range(2):                               # x's block hit twice
            probe = seq(10 + i, [(1, 4), (5, 1)])
            hit = alloc.lookup_prefix(probe)
            alloc.allocate(probe, 1, hit)
            alloc.free(probe)
        z = seq(3, [(3, 12)])
        alloc.allocate(z, 12)                            # takes the 2 unkeyed blocks, then 1 keyed
        return [name for name, s in (("x", x), ("y", y))
                if s.request.prefix_key(4) not in alloc.pool.cached]
    assert evicted("lfu") == ["y"]       # y's block had fewer hits
    assert evicted("fifo") == ["x"]      # x's block was cached first
    assert evicted("lru") == ["y"]       # vLLM's queue: x's block was freed last
