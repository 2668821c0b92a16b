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

`pools=per_kind` is TensorRT-LLM's alternative: one pool per layer kind (its layers in one page,
no padding), the memory split statically in proportion to window x layers (a full layer's window
being max_model_len; BlockManager::calculateWindowSizeToShare, NVIDIA/TensorRT-LLM
kvCacheManager.cpp, whose test splits {1024: 1 layer, 4096: 3, 8192: 2} into 3.45%, 41.38%,
55.17%); a request needs room in every pool.

Memory is reported in layer slots (one token of one layer of a page): capacity = blocks x
block_size x layers per page, summed over pools. token_states: live tokens of real layers;
reserved: allocated slots of real layers for tokens still to come below L; internal_frag: padding
layers, slots beyond L and the dead tokens ahead of a window in its first block.
"""
from __future__ import annotations

from dataclasses import dataclass

from sim.errors import ConfigError
from sim.kv_layout import HybridLayout, blocks_over
from sim.kvcache.base import NO_HIT, KVUsage, decode_rounds_token_by_token, slack_split

POOLS = ("shared", "per_kind")


def per_kind_shares(layout: HybridLayout, max_model_len: int) -> list[float]:
    """TensorRT-LLM's static split: each kind's share of the memory is proportional to its
    window (max_model_len for full layers) times its layers."""
    weights = [min(group.window, max_model_len) * group.count if group.window else max_model_len * group.count
               for group, _ in layout.kinds]
    return [w / sum(weights) for w in weights]


@dataclass(slots=True)
class HybridSeq:
    num_tokens: int        # token slots allocated (computed or about to be)
    final_len: int
    first_live: list[int]  # per kind: the first token its blocks still hold
    blocks: list[int]      # per kind: blocks held in each of its KV-cache groups


class HybridBlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, layout: HybridLayout,
                 per_kind_blocks: list[int] | None = None):
        """One shared pool of num_blocks pages, or (per_kind_blocks) one pool per kind."""
        self.block_size, self.layout = block_size, layout
        if per_kind_blocks is None:  # pool index, pages a block takes, layers per page, per kind
            self.kinds = [(group, 0, groups, groups * layout.group_size) for group, groups in layout.kinds]
            self.pool_blocks, self.pool_width = [num_blocks], [layout.group_size]
        else:
            self.kinds = [(group, i, 1, group.count) for i, (group, _) in enumerate(layout.kinds)]
            self.pool_blocks, self.pool_width = list(per_kind_blocks), [g.count for g, _ in layout.kinds]
        self.num_blocks = sum(self.pool_blocks)
        self.pool_free = list(self.pool_blocks)
        self.seqs: dict[int, HybridSeq] = {}

    @classmethod
    def from_pool(cls, pool, max_model_len: int, enable_caching: bool = False, eviction: str = "lru",
                  pools: str = "shared"):
        if enable_caching:
            raise ConfigError("prefix caching for a model with sliding or chunked layers is not built yet, "
                              "key allocators, use allocators=[paged]")
        if pools not in POOLS:
            raise ConfigError(f"unknown pools '{pools}', allocator key pools, use shared (vLLM) or per_kind (TensorRT-LLM)")
        if pools == "shared":
            return cls(pool.num_blocks, pool.block_size, pool.layout)
        layer_bytes = pool.bytes_per_token / pool.layout.group_size  # a token of one layer
        blocks = [int(share * pool.pool_bytes // (pool.block_size * group.count * layer_bytes))
                  for share, (group, _) in zip(per_kind_shares(pool.layout, max_model_len), pool.layout.kinds)]
        whole = -(-max_model_len // pool.block_size)  # a max_model_len prompt is admitted whole
        short = [f"{g.kind} {b}" for b, (g, _) in zip(blocks, pool.layout.kinds) if b < whole]
        if short:
            raise ConfigError(f"pools=per_kind leaves pools of fewer than the {whole} blocks one max_model_len "
                              f"sequence needs ({', '.join(short)}), allocator key pools, use pools=shared or "
                              f"lower max_model_len")
        return cls(0, pool.block_size, pool.layout, blocks)

    @property
    def num_free(self) -> int:
        return sum(self.pool_free)

    @property
    def capacity(self) -> int:
        return sum(b * self.block_size * w for b, w in zip(self.pool_blocks, self.pool_width))

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
        return [blocks_over(first, end, self.block_size) for first in first_live]

    def _pages(self, blocks: list[int]) -> list[int]:
        """Pages taken from each pool by these blocks per kind."""
        pages = [0] * len(self.pool_blocks)
        for count, (_, pool, groups, _) in zip(blocks, self.kinds):
            pages[pool] += count * groups
        return pages

    def allocate(self, seq, num_new_tokens: int, hit=NO_HIT, full_tokens: int = 0, watermark: float = 0.0):
        """Pages for num_new_tokens more tokens (freeing those that left a window first), or None."""
        record = self.seqs.get(seq.seq_id)
        computed = record.num_tokens if record else 0
        end = computed + num_new_tokens
        first_live = self._first_live(computed)
        blocks = self._blocks(first_live, end)
        held = self._pages(record.blocks) if record else [0] * len(self.pool_blocks)
        needed = [new - old for new, old in zip(self._pages(blocks), held)]
        required = needed
        if record is None and (full_tokens or watermark):
            whole = self._pages(self._blocks([0] * len(blocks), full_tokens))
            required = [max(n, w) + int(watermark * total) for n, w, total in zip(needed, whole, self.pool_blocks)]
        if any(r > free for r, free in zip(required, self.pool_free)):
            return None
        self.pool_free = [free - n for free, n in zip(self.pool_free, needed)]
        if record is None:
            self.seqs[seq.seq_id] = HybridSeq(end, seq.final_len, first_live, blocks)
        else:
            record.num_tokens, record.first_live, record.blocks = end, first_live, blocks
        return ()

    def free(self, seq) -> None:
        record = self.seqs.pop(seq.seq_id)
        self.pool_free = [free + n for free, n in zip(self.pool_free, self._pages(record.blocks))]

    def fork(self, parent, child) -> bool:
        """No block sharing here: a forked sample recomputes its prompt (the scheduler's path for a
        fork without memory)."""
        return False

    def usage(self, first_waiting=None) -> KVUsage:
        size = self.block_size
        token_states = reserved = internal = 0
        for record in self.seqs.values():
            for (group, _, _, layers), first, blocks in zip(self.kinds, record.first_live, record.blocks):
                if not blocks:
                    continue
                start = first // size * size
                span = blocks * size
                ahead, beyond = slack_split(start + span, record.num_tokens, record.final_len)
                token_states += group.count * (record.num_tokens - first)
                reserved += group.count * ahead
                internal += group.count * (beyond + first - start) + (layers - group.count) * span
        free = sum(f * size * w for f, w in zip(self.pool_free, self.pool_width))
        return KVUsage(self.capacity, token_states, reserved, internal, 0, 0, free)

    # -- decode stretches: none (the scheduler plans such a model step by step) -----------------
    def admission_stays_blocked(self, full_sequence_reserved: bool) -> bool:
        return False  # a window's blocks leave as the batch decodes

    def decode_steps_that_fit(self, seqs, limit: int) -> int:
        return 1

    def decode_rounds(self, seqs, num_steps: int, first_waiting=None):
        return decode_rounds_token_by_token(self, seqs, num_steps, first_waiting)
