"""Paged KV allocation for models with sliding-window or chunked-local layers: vLLM's hybrid KV
cache manager (REFERENCE.md section 8; docs/design/hybrid_kv_cache_manager.md), without prefix
caching.

One pool of pages; a page holds block_size tokens of one KV-cache group of `group_size` layers.
Each layer kind fills its KV-cache groups (sim.kv_layout.HybridLayout; the last group of a kind
padded with empty layers, which take their page share all the same). A sequence holds, per group,
the blocks of its live tokens: all of them for full layers; for a sliding window w the blocks from
token c - w + 1 on, and for chunked-local attention (chunk C) from the current chunk's start, c the
tokens computed before the step, as vLLM frees the blocks its next queries no longer read before
allocating a step's new tokens.

Memory is reported in layer slots (one token of one layer of a page): capacity = blocks x
block_size x group_size. token_states: live tokens of real layers; reserved: allocated slots of
real layers for tokens still to come below L; internal_frag: padding layers, slots beyond L and
the dead tokens ahead of a window in its first block.
"""
from __future__ import annotations

from dataclasses import dataclass

from sim.errors import ConfigError
from sim.kv_layout import HybridLayout
from sim.kvcache.base import NO_HIT, KVUsage, decode_rounds_token_by_token, slack_split


@dataclass(slots=True)
class HybridSeq:
    num_tokens: int        # token slots allocated (computed or about to be)
    final_len: int
    first_live: list[int]  # per kind: the first token its blocks still hold
    blocks: list[int]      # per kind: blocks held in each of its KV-cache groups


class HybridBlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, layout: HybridLayout):
        self.num_blocks, self.block_size, self.layout = num_blocks, block_size, layout
        self.num_free = num_blocks
        self.seqs: dict[int, HybridSeq] = {}

    @classmethod
    def from_pool(cls, pool, max_model_len: int, enable_caching: bool = False, eviction: str = "lru"):
        if enable_caching:
            raise ConfigError("prefix caching for a model with sliding or chunked layers is not built yet, "
                              "key allocators, use allocators=[paged]")
        return cls(pool.num_blocks, pool.block_size, pool.layout)

    @property
    def capacity(self) -> int:
        return self.num_blocks * self.block_size * self.layout.group_size

    def state_bytes(self) -> int:
        return 1024 + self.num_blocks  # counts, not block tables

    def lookup_prefix(self, seq):
        return NO_HIT

    def _first_live(self, computed: int) -> list[int]:
        """Per kind, the first token a query after `computed` tokens still reads."""
        out = []
        for group, _ in self.layout.kinds:
            if group.kind == "sliding":
                out.append(max(0, computed - group.window + 1))
            elif group.kind == "chunked":
                out.append(computed // group.window * group.window)
            else:
                out.append(0)
        return out

    def _blocks(self, first_live: list[int], end: int) -> list[int]:
        size = self.block_size
        return [(end - 1) // size - first // size + 1 if end > first else 0 for first in first_live]

    def _pages(self, blocks: list[int]) -> int:
        return sum(count * groups for count, (_, groups) in zip(blocks, self.layout.kinds))

    def allocate(self, seq, num_new_tokens: int, hit=NO_HIT, full_tokens: int = 0, watermark: float = 0.0):
        """Pages for num_new_tokens more tokens (freeing those that left a window first), or None."""
        record = self.seqs.get(seq.seq_id)
        computed = record.num_tokens if record else 0
        end = computed + num_new_tokens
        first_live = self._first_live(computed)
        blocks = self._blocks(first_live, end)
        held = self._pages(record.blocks) if record else 0
        needed = self._pages(blocks) - held
        required = needed
        if record is None and (full_tokens or watermark):
            required = (max(needed, self._pages(self._blocks([0] * len(blocks), full_tokens)))
                        + int(watermark * self.num_blocks))
        if required > self.num_free:
            return None
        self.num_free -= needed
        if record is None:
            self.seqs[seq.seq_id] = HybridSeq(end, seq.final_len, first_live, blocks)
        else:
            record.num_tokens, record.first_live, record.blocks = end, first_live, blocks
        return ()

    def free(self, seq) -> None:
        record = self.seqs.pop(seq.seq_id)
        self.num_free += self._pages(record.blocks)

    def fork(self, parent, child) -> bool:
        """No block sharing here: a forked sample recomputes its prompt (the scheduler's path for a
        fork without memory)."""
        return False

    def usage(self, first_waiting=None) -> KVUsage:
        size, group_size = self.block_size, self.layout.group_size
        token_states = reserved = internal = 0
        for record in self.seqs.values():
            for (group, groups), first, blocks in zip(self.layout.kinds, record.first_live, record.blocks):
                if not blocks:
                    continue
                start = first // size * size
                span = blocks * size
                ahead, beyond = slack_split(start + span, record.num_tokens, record.final_len)
                token_states += group.count * (record.num_tokens - first)
                reserved += group.count * ahead
                internal += group.count * (beyond + first - start) + (groups * group_size - group.count) * span
        free = self.num_free * size * group_size
        return KVUsage(self.capacity, token_states, reserved, internal, 0, 0, free)

    # -- decode stretches: none (the scheduler plans such a model step by step) -----------------
    def admission_stays_blocked(self, full_sequence_reserved: bool) -> bool:
        return False  # a window's blocks leave as the batch decodes

    def decode_steps_that_fit(self, seqs, limit: int) -> int:
        return 1

    def decode_rounds(self, seqs, num_steps: int, first_waiting=None):
        return decode_rounds_token_by_token(self, seqs, num_steps, first_waiting)
