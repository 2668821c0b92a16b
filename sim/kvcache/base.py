"""Shared result objects of the allocators."""
from __future__ import annotations

from dataclasses import dataclass

USAGE_FIELDS = ("token_states", "reserved", "internal_frag", "external_frag", "cached_idle", "free")


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Cached full blocks at the start of a sequence; num_tokens = len(blocks) * block_size."""
    num_tokens: int
    blocks: tuple[int, ...] = ()


NO_HIT = PrefixHit(0)


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
