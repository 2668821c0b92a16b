"""Paged KV allocation for models with sliding-window, chunked-local, compressed or state layers:
vLLM's hybrid KV cache manager (REFERENCE.md section 8; docs/design/hybrid_kv_cache_manager.md), without
prefix caching.

A sequence holds pages of each kind of sim.kv_layout.HybridLayout: for layers of one page size,
KV-cache groups of `group_size` layers (the last group of a kind padded with empty layers, which
take their page share all the same), block_size tokens a page; a compressed layer (DeepSeek-V4)
its pooled entries, its indexer keys and its raw window in pages of their own sizes. Full-history
pages hold every token; a window's pages hold tokens from c - w + 1 on, a chunk's from the current
chunk's start, c the tokens computed before the step, as vLLM frees the pages its next queries no
longer read before allocating a step's new tokens; a state layer's group one page per sequence,
taken at admission and kept until it finishes (its padding to the attention page is internal
fragmentation). Pages are paid from one byte budget (pages of different sizes do not fragment it:
a simplification where they differ).

`pools=per_kind` is TensorRT-LLM's alternative: one pool per layer kind (its layers in one page,
no padding), the memory split statically in proportion to window x layers (a full layer's window
being max_model_len; BlockManager::calculateWindowSizeToShare, NVIDIA/TensorRT-LLM
kvCacheManager.cpp, whose test splits {1024: 1 layer, 4096: 3, 8192: 2} into 3.45%, 41.38%,
55.17%); a request needs room in every pool.

Memory is reported in bytes: token_states the live entries of real layers; reserved the entries
allocated for tokens still to come below L; internal_frag the rest of the pages held (padding
layers, page alignment, entries beyond L, dead tokens ahead of a window in its first page).
"""
from __future__ import annotations

from dataclasses import dataclass

from sim.errors import ConfigError
from sim.kv_layout import HybridLayout
from sim.kvcache.base import NO_HIT, KVUsage, PlannedStepByStep, slack_split

POOLS = ("shared", "per_kind")


def per_kind_shares(layout: HybridLayout, max_model_len: int) -> list[float]:
    """TensorRT-LLM's static split over layer groups: each group's share of the memory is
    proportional to its window (max_model_len for full layers) times its layers."""
    groups = {kind.pool: kind.group for kind in layout.page_kinds}
    weights = [min(g.window or max_model_len, max_model_len) * g.count for g in groups.values()]
    return [w / sum(weights) for w in weights]


@dataclass(slots=True)
class HybridSeq:
    num_tokens: int        # token slots allocated (computed or about to be)
    final_len: int
    first_live: list[int]  # per page kind: the first token its pages still hold
    blocks: list[int]      # per page kind: blocks held (each of `per_block` pages)


class HybridBlockAllocator(PlannedStepByStep):
    def __init__(self, budgets: list[int], block_size: int, layout: HybridLayout, per_kind: bool = False):
        """budgets: bytes of each pool (one, or one per layer group with per_kind)."""
        self.block_size, self.layout, self.per_kind = block_size, layout, per_kind
        self.pool_bytes = list(budgets)
        self.pool_free = list(budgets)
        self.kind_pool = [kind.pool if per_kind else 0 for kind in layout.page_kinds]
        # Bytes a block index costs per page kind: its KV-cache groups' pages, or (a pool per
        # kind) one page of just its own layers, no padding.
        self.block_cost = [kind.group.count * kind.tokens_per_page * kind.entry_bytes if per_kind
                           else kind.per_block * kind.page_bytes for kind in layout.page_kinds]
        self.seqs: dict[int, HybridSeq] = {}
        self.num_window_released_pages = 0  # pages released because every token in them left a window

    @classmethod
    def from_pool(cls, pool, max_model_len: int, pools: str = "shared"):
        """(Prefix caching goes to sim.kvcache.hybrid_prefix; BlockAllocator.from_pool routes.)"""
        if pools not in POOLS:
            raise ConfigError(f"unknown pools '{pools}', allocator key pools, use shared (vLLM) or per_kind (TensorRT-LLM)")
        layout = pool.layout
        if pools == "shared":
            return cls([pool.num_blocks * pool.bytes_per_token * pool.block_size], pool.block_size, layout)
        if any(kind.pooled or kind.per_sequence for kind in layout.page_kinds):
            raise ConfigError("pools=per_kind for compressed or state layers is not modelled, allocator key pools, "
                              "use pools=shared")
        budgets = [share * pool.pool_bytes for share in per_kind_shares(layout, max_model_len)]
        allocator = cls(budgets, pool.block_size, layout, per_kind=True)
        short = [kind.group.kind for kind, nbytes in zip(layout.page_kinds, allocator.whole_sequence_bytes(max_model_len))
                 if nbytes > budgets[kind.pool]]
        if short:
            raise ConfigError(f"pools=per_kind leaves the {', '.join(short)} pool smaller than one max_model_len "
                              f"sequence, allocator key pools, use pools=shared or lower max_model_len")
        return allocator

    def whole_sequence_bytes(self, tokens: int) -> list[float]:
        """Per page kind, the bytes one sequence of `tokens` tokens admitted whole takes."""
        return [kind.blocks(0, tokens) * cost for kind, cost in zip(self.layout.page_kinds, self.block_cost)]

    @property
    def num_free(self) -> float:
        return sum(self.pool_free)

    def completion_need(self, seq, step_tokens: int) -> list[float]:
        """guaranteed_no_evict (sim.scheduler.reservations): per pool, the most bytes seq can
        hold on its way to its final length. A window or chunk kind holds, in a step adding up
        to step_tokens tokens, the window's last tokens and the step's: at most
        ceil((window - 1 + step_tokens) / page) + 1 pages."""
        need = [0.0] * len(self.pool_bytes)
        for kind, pool, cost in zip(self.layout.page_kinds, self.kind_pool, self.block_cost):
            blocks = kind.blocks(0, seq.final_len)
            if kind.window and not kind.pooled:
                blocks = min(blocks, -(-(kind.window - 1 + step_tokens) // kind.tokens_per_page) + 1)
            need[pool] += blocks * cost
        return need

    def fork_need(self, seq, step_tokens: int) -> list[float]:
        """Nothing: a forked sample here recomputes its prompt, admitted on its own (fork)."""
        return [0.0] * len(self.pool_bytes)

    @property
    def completion_capacity(self) -> list[float]:
        return list(self.pool_bytes)

    @property
    def capacity(self) -> int:
        return int(sum(self.pool_bytes))

    def state_bytes(self) -> int:
        return 4096  # counts, not block tables

    def lookup_prefix(self, seq):
        return NO_HIT

    def cached_prefix_tokens(self, request) -> int:
        return 0

    def _bytes(self, first_live: list[int], end: int) -> tuple[list[int], list[float]]:
        """(blocks per page kind, bytes per pool) of a sequence holding tokens up to `end`."""
        blocks, paid = [], [0.0] * len(self.pool_bytes)
        for kind, first, pool, cost in zip(self.layout.page_kinds, first_live, self.kind_pool, self.block_cost):
            count = kind.blocks(first, end)
            blocks.append(count)
            paid[pool] += count * cost
        return blocks, paid

    def allocate(self, seq, num_new_tokens: int, hit=NO_HIT, full_tokens: int = 0, watermark: float = 0.0):
        """Pages for num_new_tokens more tokens (freeing those that left a window first), or None."""
        record = self.seqs.get(seq.seq_id)
        computed = record.num_tokens if record else 0
        end = computed + num_new_tokens
        first_live = [kind.first_live(computed) for kind in self.layout.page_kinds]
        blocks, paid = self._bytes(first_live, end)
        held = self._bytes(record.first_live, record.num_tokens)[1] if record else [0.0] * len(paid)
        needed = [new - old for new, old in zip(paid, held)]
        required = needed
        if record is None and (full_tokens or watermark):
            whole = self._bytes([0] * len(blocks), full_tokens)[1]
            required = [max(n, w) + watermark * total for n, w, total in zip(needed, whole, self.pool_bytes)]
        if any(r > free + 1e-6 for r, free in zip(required, self.pool_free)):
            return None
        self.pool_free = [free - n for free, n in zip(self.pool_free, needed)]
        if record is None:
            self.seqs[seq.seq_id] = HybridSeq(end, seq.final_len, first_live, blocks)
            return ()
        for kind, old, new in zip(self.layout.page_kinds, record.first_live, first_live):
            if kind.window:  # pages whose tokens all left the window, released
                size = kind.tokens_per_page
                self.num_window_released_pages += (new // size - old // size) * kind.per_block
        record.num_tokens, record.first_live, record.blocks = end, first_live, blocks
        return ()

    def free(self, seq) -> None:
        record = self.seqs.pop(seq.seq_id)
        held = self._bytes(record.first_live, record.num_tokens)[1]
        self.pool_free = [free + n for free, n in zip(self.pool_free, held)]

    def fork(self, parent, child) -> bool:
        """No page sharing here: a forked sample recomputes its prompt (the scheduler's path for a
        fork without memory)."""
        return False

    def usage(self, first_waiting=None) -> KVUsage:
        token_states = reserved = 0.0
        for record in self.seqs.values():
            end, final = record.num_tokens, record.final_len
            for kind, first, blocks in zip(self.layout.page_kinds, record.first_live, record.blocks):
                if not blocks:
                    continue
                layers = kind.group.count * kind.entry_bytes
                if kind.per_sequence:  # a state: live whole (its page's padding is internal)
                    token_states += layers
                elif kind.pooled:
                    ratio = kind.group.ratio
                    slots = blocks * kind.tokens_per_page // ratio
                    token_states += end // ratio * layers
                    reserved += max(0, min(slots, final // ratio) - end // ratio) * layers
                else:
                    start = first // kind.tokens_per_page * kind.tokens_per_page
                    ahead, _ = slack_split(start + blocks * kind.tokens_per_page, end, final)
                    token_states += (end - first) * layers
                    reserved += ahead * layers
        capacity = self.capacity
        used = capacity - round(self.num_free)
        token_states, reserved = round(token_states), round(reserved)
        return KVUsage(capacity, token_states, reserved, used - token_states - reserved, 0, 0, capacity - used)
