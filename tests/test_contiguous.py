"""Contiguous reservation on a linear address space: first fit, coalescing, measured holes."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.errors import ConfigError
from sim.kvcache.contiguous import ContiguousAllocator, reservation
from tests.helpers import seq
from tests.invariants import check_contiguous_allocator


def test_first_fit_places_in_the_lowest_hole_and_coalesces_on_free():
    alloc = ContiguousAllocator(num_slots=100, max_model_len=30)
    a, b, c, d = (seq(i, [(i, 5)]) for i in range(1, 5))
    assert alloc.allocate(a, 5) == ((0, 30),)
    assert alloc.allocate(b, 5) == ((30, 30),)
    assert alloc.allocate(c, 5) == ((60, 30),)
    assert alloc.allocate(d, 5) is None                     # only a 10-slot hole is left
    alloc.free(b)
    assert alloc.holes() == [(30, 30), (90, 10)]
    assert alloc.allocate(d, 5) == ((30, 30),)
    alloc.free(c)
    assert alloc.holes() == [(60, 40)]                      # merged with the tail hole
    alloc.free(a)
    alloc.free(d)
    assert alloc.holes() == [(0, 100)]


def test_breakdown_of_a_max_reservation():
    alloc = ContiguousAllocator(num_slots=100, max_model_len=30)
    a = seq(1, [(1, 5)], output_len=5)                      # L = 10
    alloc.allocate(a, 5)
    usage = alloc.usage()
    assert (usage.token_states, usage.reserved, usage.internal_frag, usage.free) == (5, 5, 20, 70)


def test_external_fragmentation_counts_holes_too_small_for_the_first_waiting_request():
    alloc = ContiguousAllocator(num_slots=110, max_model_len=40, reserve="oracle")
    running = [seq(i, [(i, 20)], output_len=5) for i in range(1, 5)]   # L = 25 each
    for s in running:
        alloc.allocate(s, s.num_tokens)
    alloc.free(running[1])
    assert alloc.holes() == [(25, 25), (100, 10)]
    waiting = seq(9, [(9, 30)], output_len=5)                # oracle: needs 35 contiguous slots
    usage = alloc.usage(first_waiting=waiting)
    assert (usage.external_frag, usage.free) == (35, 0)
    fits = seq(10, [(10, 5)], output_len=5)                  # needs 10: both holes usable
    assert alloc.usage(first_waiting=fits).external_frag == 0
    assert alloc.usage(first_waiting=None).free == 35


@pytest.mark.parametrize("policy, final_len, expected", [
    ("max", 100, 2048), ("pow2", 100, 128), ("pow2", 128, 128), ("pow2", 3000, 2048),
    ("oracle", 100, 100)])
def test_reservation_policies(policy, final_len, expected):
    assert reservation(policy, final_len, 2048) == expected


def test_unknown_reserve_policy_is_a_config_error():
    with pytest.raises(ConfigError, match="reserve"):
        ContiguousAllocator(100, 10, reserve="half")


class Live:
    def __init__(self, s):
        self.seq, self.num_allocated = s, 0


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["new", "grow", "free"]), st.integers(0, 50),
                              st.integers(1, 12)), min_size=1, max_size=40),
       policy=st.sampled_from(["max", "pow2", "oracle"]), placement=st.sampled_from(["first_fit", "buddy"]),
       num_slots=st.integers(32, 130))
def test_contiguous_invariants_hold_after_every_operation(ops, policy, placement, num_slots):
    alloc = ContiguousAllocator(num_slots=num_slots, max_model_len=32, reserve=policy, placement=placement)
    live, next_id = {}, 1
    for kind, pick, amount in ops:
        if kind == "new":
            s = seq(next_id, [(next_id, amount)], output_len=pick % 20 + 1)
            s.final_len = min(s.final_len, 32)
            next_id += 1
            if alloc.allocate(s, amount) is not None:
                live[s.seq_id] = Live(s)
                live[s.seq_id].num_allocated = amount
        elif kind == "grow" and live:
            entry = live[sorted(live)[pick % len(live)]]
            room = alloc.reservation[entry.seq.seq_id] - entry.num_allocated
            step = min(amount, room, entry.seq.final_len - entry.num_allocated)
            if step > 0:
                alloc.allocate(entry.seq, step)
                entry.num_allocated += step
        elif kind == "free" and live:
            entry = live.pop(sorted(live)[pick % len(live)])
            alloc.free(entry.seq)
        check_contiguous_allocator(alloc, live)


def test_buddy_splits_to_the_smallest_order_and_merges_buddies_back():
    alloc = ContiguousAllocator(num_slots=48, max_model_len=32, reserve="oracle", placement="buddy")
    a = seq(1, [(1, 5)], output_len=1)                       # L = 6 -> an 8-slot block
    b = seq(2, [(2, 9)], output_len=1)                       # L = 10 -> a 16-slot block
    # The space is two chunks, [0, 32) and [32, 48); the smallest order that fits splits first.
    assert alloc.allocate(a, 5) == ((32, 8),)                # [32, 48) split into 8 + 8
    assert alloc.allocate(b, 9) == ((0, 16),)                # [0, 32) split into 16 + 16
    assert alloc.holes() == [(16, 16), (40, 8)]
    usage = alloc.usage()
    # Oracle reserves exactly L: no internal fragmentation; the power-of-two round-up (2 + 6
    # slots) is external fragmentation, as the PagedAttention paper's Figure 2 counts it.
    assert (usage.reserved, usage.internal_frag, usage.external_frag) == (2, 0, 8)
    alloc.free(a)
    assert alloc.holes() == [(16, 16), (32, 16)]             # [32, 40) and [40, 48) merged
    alloc.free(b)
    assert alloc.holes() == [(0, 32), (32, 16)]              # back to the two chunks


def test_buddy_external_fragmentation_counts_free_blocks_of_too_low_an_order():
    alloc = ContiguousAllocator(num_slots=32, max_model_len=16, reserve="max", placement="buddy")
    first, second = seq(1, [(1, 4)]), seq(2, [(2, 4)])
    alloc.allocate(first, 4)
    alloc.allocate(second, 4)
    alloc.free(first)                                         # free: [0, 16); used: [16, 32)
    small = ContiguousAllocator(num_slots=24, max_model_len=16, reserve="max", placement="buddy")
    small.allocate(seq(3, [(3, 4)]), 4)                       # takes the 16-chunk; 8 left
    waiting = seq(4, [(4, 4)])
    assert small.usage(first_waiting=waiting).external_frag == 8
    assert alloc.usage(first_waiting=waiting).external_frag == 0
