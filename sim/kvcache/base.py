"""Shared result objects of the allocators, and the arithmetic of decode stretches."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

USAGE_FIELDS = ("token_states", "reserved", "internal_frag", "external_frag", "cached_idle", "free")


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Cached full blocks at the start of a sequence, in HBM (blocks) and then in the tiers
    below it (loaded: blocks per tier, sim.kvcache.tiers); num_tokens = (len(blocks) +
    sum(loaded)) * block_size."""
    num_tokens: int
    blocks: tuple[int, ...] = ()
    loaded: tuple[int, ...] = ()


NO_HIT = PrefixHit(0)


def refuse_hybrid_layout(pool, allocator: str) -> None:
    """Only the paged allocator (sim.kvcache.hybrid) takes a model with window, chunk, compressed
    or state layers."""
    if getattr(pool, "layout", None) is not None:
        from sim.errors import ConfigError
        raise ConfigError(f"the {allocator} allocator does not take a model with window, chunk, compressed or state "
                          f"layers yet, key allocators, use allocators=[paged]")


@dataclass(frozen=True, slots=True)
class KVUsage:
    """Token slots of one KV pool by category; the six categories sum to capacity.

    token_states: computed KV referenced by a live sequence (a shared slot counts once);
    reserved: allocated to a live sequence, not yet computed, at a position < L;
    internal_frag: allocated to a live sequence at a position >= L;
    external_frag: free, but unusable by the first waiting request under the placement policy;
    cached_idle: unreferenced but holding reusable cached KV;
    free: every other unallocated slot.
    """
    capacity: int
    token_states: int
    reserved: int
    internal_frag: int
    external_frag: int
    cached_idle: int
    free: int

    def as_tuple(self) -> tuple[int, ...]:
        return (self.token_states, self.reserved, self.internal_frag, self.external_frag,
                self.cached_idle, self.free)


def slack_split(allocated: int, computed: int, final_len: int) -> tuple[int, int]:
    """Split a sequence's allocated-but-uncomputed slots [computed, allocated) at L.

    Returns (reserved, internal_frag): positions below L will still be filled, the rest never.
    """
    reserved = max(0, min(allocated, final_len) - computed)
    return reserved, allocated - computed - reserved


def decode_rounds_token_by_token(allocator, seqs, num_steps: int, first_waiting) -> np.ndarray:
    """Memory for a decode stretch, one allocate per sequence per step: the usage after each of
    num_steps steps (the first already allocated; rows of KVUsage.as_tuple()), then the
    allocation of the step after them."""
    rows = []
    allocate, usage = allocator.allocate, allocator.usage
    for _ in range(num_steps):
        rows.append(usage(first_waiting).as_tuple())
        for seq in seqs:
            if allocate(seq, 1) is None:
                raise AssertionError(f"decode stretch ran out of memory at sequence {seq.seq_id}")
    return np.array(rows, dtype=np.int64).reshape(num_steps, len(USAGE_FIELDS))


class PlannedStepByStep:
    """Decode stretches: none. For allocators whose pages change with every step (windows
    leaving, pages of several kinds), the scheduler plans each step on its own."""

    def admission_stays_blocked(self, full_sequence_reserved: bool) -> bool:
        return False  # a window's blocks leave as the batch decodes

    def decode_steps_that_fit(self, seqs, limit: int) -> int:
        return 1

    def decode_rounds(self, seqs, num_steps: int, first_waiting=None):
        return decode_rounds_token_by_token(self, seqs, num_steps, first_waiting)


def decode_units_needed(allocated: int, slots: int, unit: int, steps: int) -> int:
    """Units (blocks, pages) a sequence with `allocated` tokens in `slots` slots takes over the
    next `steps` - 1 decode steps (the first step's token is already allocated)."""
    return max(0, -(-(allocated + steps - 1 - slots) // unit))


def last_step_that_fits(seqs_state, free_units: int, unit: int, limit: int) -> int:
    """The largest k <= limit whose decode steps 2..k find units: seqs_state is a list of
    (allocated tokens, slots) per sequence."""
    return largest_fitting(lambda steps: sum(decode_units_needed(a, c, unit, steps) for a, c in seqs_state),
                           free_units, limit)


def largest_fitting(needed, free_units: int, limit: int) -> int:
    """The largest k <= limit with needed(k) <= free_units (needed grows with k, needed(1) = 0)."""
    if needed(limit) <= free_units:
        return limit
    low, high = 1, limit  # needed(low) <= free_units < needed(high)
    while high - low > 1:
        middle = (low + high) // 2
        if needed(middle) <= free_units:
            low = middle
        else:
            high = middle
    return low


def decode_slack_rows(allocated: np.ndarray, slots: np.ndarray, final_len: np.ndarray) -> tuple:
    """Reserved and internal-fragmentation slots summed over sequences, one total per step:
    allocated and slots are (sequences x steps), final_len one L per sequence (slack_split on
    arrays)."""
    reserved = np.maximum(0, np.minimum(slots, final_len[:, None]) - allocated)
    internal = slots - allocated - reserved
    return reserved.sum(axis=0), internal.sum(axis=0)
