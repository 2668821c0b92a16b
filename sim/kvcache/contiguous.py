"""Contiguous per-request reservation (Orca / FasterTransformer style) on a linear address space.

Each sequence reserves one extent of token slots when first admitted and keeps it until it
finishes or is preempted. Placement (sim/kvcache/placement.py) is first-fit over coalescing holes
or a buddy system, so external fragmentation is measured from the actual holes, not assumed.

    reserve = max     -> max_model_len slots (the core's `contiguous`)
    reserve = pow2    -> next power of two of the sequence's final length L, at most max_model_len
    reserve = oracle  -> exactly L (no internal fragmentation by definition, under first fit)

    address space:  [ seq 3 ######.... ][ hole ][ seq 8 ####...... ][ hole ............ ]
                      computed ^ reserved         buddy also rounds each extent up to 2^k

Breakdown of an extent: [computed, L) reserved, [L, reservation) internal fragmentation,
[reservation, extent) external fragmentation (buddy's round-up, as the paper's Figure 2 counts
it), plus, while a request waits, every hole too small for it.
"""
from __future__ import annotations

import numpy as np

from sim.errors import ConfigError
from sim.kvcache.base import (NO_HIT, KVUsage, PrefixHit, decode_rounds_token_by_token, refuse_hybrid_layout,
                              slack_split)
from sim.kvcache.placement import PLACEMENTS

RESERVE_POLICIES = ("max", "pow2", "oracle")


def reservation(policy: str, final_len: int, max_model_len: int) -> int:
    if policy == "max":
        return max_model_len
    if policy == "pow2":
        return min(max_model_len, 1 << max(0, final_len - 1).bit_length())
    return final_len


class ContiguousAllocator:
    def __init__(self, num_slots: int, max_model_len: int, reserve: str = "max",
                 placement: str = "first_fit"):
        if reserve not in RESERVE_POLICIES:
            raise ConfigError(f"unknown reserve policy '{reserve}', allocator config key reserve, "
                              f"use one of: {', '.join(RESERVE_POLICIES)}")
        if placement not in PLACEMENTS:
            raise ConfigError(f"unknown placement '{placement}', allocator config key placement, "
                              f"use one of: {', '.join(PLACEMENTS)}")
        self.num_slots, self.max_model_len, self.reserve = num_slots, max_model_len, reserve
        self.space = PLACEMENTS[placement](num_slots)
        self.extents: dict[int, tuple[int, int]] = {}  # seq_id -> (start, length)
        self.reservation: dict[int, int] = {}  # seq_id -> slots reserved (<= extent length)
        self.total_rounding = 0  # extent slots beyond reservations (buddy's power-of-two round-up)
        self.total_extent_slots = 0
        self.num_allocated_tokens: dict[int, int] = {}
        self.final_len: dict[int, int] = {}
        self.total_tokens = 0
        self.num_copied_tokens = 0
        self.total_reserved = 0
        self.total_internal = 0

    @classmethod
    def from_pool(cls, pool, max_model_len: int, reserve: str = "max",
                  placement: str = "first_fit") -> "ContiguousAllocator":
        refuse_hybrid_layout(pool, "contiguous")
        return cls(pool.num_token_slots, max_model_len, reserve, placement)

    @property
    def capacity(self) -> int:
        return self.num_slots

    def state_bytes(self) -> int:
        """A few dict entries per live extent and per hole; live extents are bounded by the
        scheduler's max_num_seqs (a few hundred), counted here as 1,024 at most."""
        return 4096 + min(self.num_slots // 16, 1024) * 200

    def lookup_prefix(self, seq) -> PrefixHit:
        return NO_HIT

    def cached_prefix_tokens(self, request) -> int:
        return 0

    def reservation_of(self, seq) -> int:
        return reservation(self.reserve, seq.final_len, self.max_model_len)

    def allocate(self, seq, num_new_tokens: int, hit: PrefixHit = NO_HIT, full_tokens: int = 0,
                 watermark: float = 0.0):
        """The reservation already covers the final length, so full_tokens always fits; the
        watermark keeps that share of the slots free after placing it."""
        seq_id = seq.seq_id
        extent = self.extents.get(seq_id)
        if extent is None:
            wanted = self.reservation_of(seq)
            free_slots = self.num_slots - self.total_extent_slots
            if watermark and wanted + int(watermark * self.num_slots) > free_slots:
                return None
            extent = self.space.place(wanted)
            if extent is None:
                return None
            self.extents[seq_id] = extent
            self.total_extent_slots += extent[1]
            self.reservation[seq_id] = wanted
            self.total_rounding += extent[1] - wanted
            self.num_allocated_tokens[seq_id] = 0
            self.final_len[seq_id] = seq.final_len
            new, before = (extent,), 0
        else:
            new, before = (), self.num_allocated_tokens[seq_id]
            self._drop_slack(seq_id, before)
        after = before + num_new_tokens
        if after > self.reservation[seq_id]:
            raise AssertionError(f"sequence {seq_id} outgrew its reservation of "
                                 f"{self.reservation[seq_id]} slots")
        self.num_allocated_tokens[seq_id] = after
        self.total_tokens += num_new_tokens
        self._add_slack(seq_id, after)
        return new

    def admission_stays_blocked(self, full_sequence_reserved: bool) -> bool:
        return True  # nothing is placed or released while sequences only decode

    def decode_steps_that_fit(self, seqs, limit: int) -> int:
        return limit  # a reservation covers every token up to the final length

    def decode_rounds(self, seqs, num_steps: int, first_waiting=None) -> np.ndarray:
        return decode_rounds_token_by_token(self, seqs, num_steps, first_waiting)

    def fork(self, parent, child) -> bool:
        """A contiguous cache cannot share: the child gets its own extent and a copy."""
        tokens = self.num_allocated_tokens[parent.seq_id]
        if self.allocate(child, tokens) is None:
            return False
        self.num_copied_tokens += tokens
        return True

    def free(self, seq) -> None:
        seq_id = seq.seq_id
        start, length = self.extents.pop(seq_id)
        self.total_extent_slots -= length
        tokens = self.num_allocated_tokens[seq_id]
        self._drop_slack(seq_id, tokens)
        self.total_tokens -= tokens
        self.total_rounding -= length - self.reservation.pop(seq_id)
        del self.num_allocated_tokens[seq_id], self.final_len[seq_id]
        self.space.release(start, length)

    def usage(self, first_waiting=None) -> KVUsage:
        num_free = self.num_slots - self.total_extent_slots
        unusable = 0
        if first_waiting is not None:
            unusable = self.space.unusable_slots(self.reservation_of(first_waiting))
        return KVUsage(capacity=self.num_slots, token_states=self.total_tokens,
                       reserved=self.total_reserved, internal_frag=self.total_internal,
                       external_frag=unusable + self.total_rounding, cached_idle=0,
                       free=num_free - unusable)

    def holes(self) -> list[tuple[int, int]]:
        return self.space.holes()

    # -- mechanics ---------------------------------------------------------------------------
    def _slack(self, seq_id: int, tokens: int) -> tuple[int, int]:
        return slack_split(self.reservation[seq_id], tokens, self.final_len[seq_id])

    def _add_slack(self, seq_id, tokens) -> None:
        reserved, internal = self._slack(seq_id, tokens)
        self.total_reserved += reserved
        self.total_internal += internal

    def _drop_slack(self, seq_id, tokens) -> None:
        reserved, internal = self._slack(seq_id, tokens)
        self.total_reserved -= reserved
        self.total_internal -= internal
