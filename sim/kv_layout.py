"""Per-layer KV layout: what each kind of layer stores per sequence, and what an engine allocates.

A model is a list of layer groups, `count` layers of one kind each (REFERENCE.md sections 1, 8):

    kind        stores per sequence of t tokens                          reads per decode step
    full        t entries of 2 * H_kv * d_h elements (MHA, GQA, MQA)      t
    mla         t latents of kv_lora_rank + qk_rope_head_dim elements     t
    sliding     the last min(t, window) tokens                            min(t, window)
    chunked     the tokens since the current chunk began (Llama 4)        (t - 1) % chunk + 1
    compressed  floor(t / ratio) pooled entries (+ indexer keys), and     top_k entries (all when
                the last min(t, window) raw tokens (DeepSeek-V4 CSA/HCA)  top_k = 0) + the window
    dsa         t latents + t indexer keys (DeepSeek-V3.2)                min(t, top_k)
    shared      nothing: reads another layer's KV (CLA, Gemma 3n)         its source's (window given: a window)
    state       a fixed state per sequence (Mamba-2: a conv state and     the state (read and written)
                an SSM state, vLLM's mamba2_state_shape)
    mlp         nothing: a layer of an MLP block alone (Nemotron-H's -)   nothing

Bytes per entry come from the model's widths and KV dtype, or are given (`entry_bytes`) where an
engine stores a mixed layout (vLLM stores a V3.2 latent in 656 B: 512 FP8 + 16 B of scales + 64
BF16 RoPE; a V4 entry in 584 B), in which case kv_cache_dtype does not change them.

State layers hold one page per sequence whatever its length: vLLM's hybrid Mamba path raises the
attention block size until an attention page holds a state layer's state (16 x ceil(state /
(16 x one token's page)) tokens) and pads the state's page to the attention page
(HybridAttentionMambaModelConfig.verify_and_update_config, vllm/model_executor/models/config.py),
so that state and attention layers share one page size and group like any other kinds.

Allocation follows vLLM: blocks of block_size tokens per group; a window or chunk layer keeps only
the blocks that hold its live tokens (the rest are freed); kinds with equal page sizes share one
page size in groups of the smallest kind's layer count, the last group of a kind padded with
empty layers (vLLM's hybrid KV cache manager: Gemma-3-27B's 52 sliding + 10 full layers make
groups of 10, the last sliding group 2 real layers + 8 padding); compressed layers use their own
pages (`block_tokens` tokens a block, pages padded to a multiple of `page_align` bytes, a
separate window cache in `window_block_tokens`-token blocks), as vLLM's DeepSeek-V4 path does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

from sim.errors import ConfigError

# NVFP4 (weights only): a 4-bit E2M1 value and an FP8 E4M3 scale per block of 16 values.
NVFP4_BLOCK = 16
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4, "nvfp4": 0.5 + 1 / NVFP4_BLOCK}
STATE_DTYPES = ("bf16", "fp16", "fp32")  # an SSM state's (vLLM's mamba_ssm_cache_dtype)
LAYER_KINDS = ("full", "mla", "sliding", "chunked", "compressed", "dsa", "shared", "state", "mlp")
WINDOWED = ("sliding", "chunked")  # kinds whose blocks leave once their tokens leave the window
GROUPED = ("full", "mla", "sliding", "chunked", "dsa", "state")  # kinds of vLLM's one-page-size groups
NO_ATTENTION = ("state", "mlp")  # kinds whose layers run no attention


@dataclass(frozen=True, slots=True)
class LayerGroup:
    kind: str
    count: int
    window: int = 0               # sliding: window; chunked: chunk; compressed: raw window;
                                  # shared: its source's window (0: a full-attention source)
    ratio: int = 1                # compressed: tokens pooled into one stored entry
    top_k: int = 0                # compressed (CSA) and dsa: entries one query reads; 0: all
    entry_bytes: float = 0        # per stored entry per layer; 0: from the model's widths and dtype
    indexer_entry_bytes: float = 0  # an indexer key per stored entry (CSA, DSA); 0: no indexer
    indexer_heads: int = 0        # the indexer's heads and width, for its scoring FLOPs
    indexer_head_dim: int = 0
    state_bytes: int = 0          # state layers: bytes per sequence (0: from the Mamba-2 widths below)
    # State layers (Mamba-2 mixers, as Nemotron-H's config names them): heads (mamba_num_heads), head
    # width (mamba_head_dim), state size N (ssm_state_size), B/C groups (n_groups), the causal
    # conv's kernel (conv_kernel), the chunked scan's chunk (chunk_size) and the state's dtype
    # (vLLM's mamba_ssm_cache_dtype; "" = the model's activations, bf16).
    ssm_heads: int = 0
    ssm_head_dim: int = 0
    ssm_state_size: int = 0
    ssm_groups: int = 1
    conv_kernel: int = 4
    ssm_chunk: int = 256
    ssm_state_dtype: str = ""
    mlp: bool = True              # the layers carry an MLP block (Nemotron-H's mixer layers do not)
    block_tokens: int = 0         # tokens a block covers, when not the engine's block_size (V4: 256)
    page_align: int = 1           # pages padded to a multiple of this many bytes (V4: 576)
    window_block_tokens: int = 0  # compressed: block size of the raw window cache (V4: 64)

    def check(self, where: str) -> None:
        if self.kind not in LAYER_KINDS:
            raise ConfigError(f"layer kind '{self.kind}' is unknown, {where}, "
                              f"use one of: {', '.join(LAYER_KINDS)}")
        if self.count < 1:
            raise ConfigError(f"a layer group needs count >= 1, {where}, fix count")
        if self.kind in WINDOWED and self.window < 1:
            raise ConfigError(f"{self.kind} layers need window >= 1 (their window or chunk), "
                              f"{where}, set window")
        if self.kind == "compressed" and (self.ratio < 1 or self.window < 0):
            raise ConfigError(f"compressed layers need ratio >= 1 and window >= 0, {where}")
        if self.kind == "state" and self.state_bytes <= 0 and not self.has_mixer_widths:
            raise ConfigError(f"state layers need state_bytes > 0 or their Mamba-2 widths (ssm_heads, "
                              f"ssm_head_dim, ssm_state_size), {where}, set them")
        if self.ssm_state_dtype and self.ssm_state_dtype not in STATE_DTYPES:
            raise ConfigError(f"ssm_state_dtype '{self.ssm_state_dtype}' is unknown, {where}, "
                              f"key ssm_state_dtype, use bf16, fp16 or fp32 (or leave it out: the model's dtype)")

    @property
    def has_mixer_widths(self) -> bool:
        """Whether a state layer gives its Mamba-2 widths (needed to time it)."""
        return self.ssm_heads > 0 and self.ssm_head_dim > 0 and self.ssm_state_size > 0

    @property
    def ssm_inner(self) -> int:
        return self.ssm_heads * self.ssm_head_dim

    def groups_per_rank(self, tp: int) -> float:
        """B/C groups on one rank: split when they divide by the TP size, else (one group) on every
        rank, as vLLM pads n_groups for its head shards."""
        return self.ssm_groups / tp if self.ssm_groups % tp == 0 else self.ssm_groups

    def conv_channels(self, tp: int = 1) -> float:
        """Channels of the causal conv on one of tp ranks: x, B and C (vLLM's conv_dim)."""
        return self.ssm_inner / tp + 2 * self.groups_per_rank(tp) * self.ssm_state_size

    def conv_state_bytes(self, tp: int = 1, activation_bytes: int = 2) -> float:
        """The conv state, (conv_kernel - 1) x conv channels in the activations' dtype."""
        return (self.conv_kernel - 1) * self.conv_channels(tp) * activation_bytes

    def mamba_state_bytes(self, tp: int = 1, activation_bytes: int = 2) -> float:
        """One sequence's state in one state layer on one of tp ranks: given (split evenly), or
        vLLM's mamba2_state_shape, the conv state and the SSM state heads x head_dim x N in
        ssm_state_dtype (the activations' when not given)."""
        if self.state_bytes:
            return self.state_bytes / tp
        ssm_bytes = DTYPE_BYTES[self.ssm_state_dtype] if self.ssm_state_dtype else activation_bytes
        return float(self.conv_state_bytes(tp, activation_bytes)
                     + self.ssm_inner / tp * self.ssm_state_size * ssm_bytes)


def layer_group(values: dict, where: str) -> LayerGroup:
    known = {f.name for f in fields(LayerGroup)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown layer field(s) {', '.join(unknown)}, {where}, "
                          f"use only: {', '.join(sorted(known))}")
    if "kind" not in values or "count" not in values:
        raise ConfigError(f"a layer group needs kind and count, {where}")
    group = LayerGroup(**values)
    group.check(where)
    return group


# -- what one sequence stores ----------------------------------------------------------------
def live_window_tokens(group: LayerGroup, tokens: int) -> int:
    """Raw tokens a windowed or compressed layer keeps at context length `tokens`."""
    if tokens <= 0:
        return 0
    if group.kind == "chunked":
        return (tokens - 1) % group.window + 1
    return min(tokens, group.window)


def stored_entries(group: LayerGroup, tokens: int) -> int:
    """Entries of the layer's main cache (full history, pooled, or the window)."""
    if group.kind in ("full", "mla", "dsa"):
        return tokens
    if group.kind in WINDOWED:
        return live_window_tokens(group, tokens)
    if group.kind == "compressed":
        return tokens // group.ratio
    return 0  # shared, state


@dataclass(frozen=True, slots=True)
class KindUsage:
    """One layer group's KV for `batch` sequences of `tokens` (bytes over all its layers)."""
    kind: str
    layers: int
    entries: int             # main-cache entries per sequence per layer
    entry_bytes: float
    stored_bytes: float      # entries x entry bytes (x layers x batch)
    indexer_bytes: float     # indexer keys
    window_bytes: float      # a compressed layer's raw window
    state_bytes: float
    allocated_bytes: float   # whole blocks (pages) the engine holds, layer padding included
    freed_tokens: int        # per sequence: tokens that left a window (their blocks freed)

    @property
    def padding_bytes(self) -> float:
        return self.allocated_bytes - self.stored_bytes - self.indexer_bytes - self.window_bytes - self.state_bytes


def blocks_over(first_token: int, end_token: int, block: int) -> int:
    """Blocks of `block` tokens that hold any of tokens [first_token, end_token)."""
    if end_token <= first_token:
        return 0
    return (end_token - 1) // block - first_token // block + 1


def _aligned(nbytes: float, align: int) -> float:
    return math.ceil(nbytes / align) * align if align > 1 else nbytes


def state_block_size(groups, entry_bytes: list[float], block_size: int, kv_replication: float = 1.0) -> int:
    """The attention block size vLLM runs a model with state layers at: block_size, or 16 x
    ceil(largest state / (16 x one token's attention page)) tokens where that is larger, so that
    one attention page holds a state (HybridAttentionMambaModelConfig); block_size otherwise.
    vLLM compares them on one rank: a state splits across the TP group, KV heads only down to
    one a rank (kv_replication: the copies a TP group keeps of each token's KV)."""
    states = [nbytes for g, nbytes in zip(groups, entry_bytes) if g.kind == "state"]
    token_page = attention_token_page(groups, entry_bytes) * kv_replication
    if not states or not token_page:
        return block_size
    return max(block_size, 16 * math.ceil(max(states) / (16 * token_page)))


def attention_token_page(groups, entry_bytes: list[float]) -> float:
    """One token's page in one layer of the grouped attention kinds (0: none)."""
    return max((nbytes + g.indexer_entry_bytes for g, nbytes in zip(groups, entry_bytes)
                if g.kind in GROUPED and g.kind != "state"), default=0.0)


def kind_usage(group: LayerGroup, entry_bytes: float, tokens: int, batch: int, block_size: int,
               padded_layers: int, state_page: float = 0.0) -> KindUsage:
    """`padded_layers` >= count: the layers whose pages the engine allocates (group padding);
    a state layer's `entry_bytes` is its state in one copy of the cache (the whole state over the
    copies a TP group keeps of the KV: states are split, never copied), held in a page of
    `state_page` bytes (vLLM pads it to the attention page; 0: the state itself)."""
    layers, n = group.count, batch * group.count
    entries = stored_entries(group, tokens)
    stored = n * entries * entry_bytes
    indexer = n * entries * group.indexer_entry_bytes
    window = state = 0.0
    freed = 0
    if group.kind in ("full", "mla", "dsa"):
        page = block_size * (entry_bytes + group.indexer_entry_bytes)
        allocated = batch * padded_layers * blocks_over(0, tokens, block_size) * page
    elif group.kind in WINDOWED:
        live = live_window_tokens(group, tokens)
        freed = tokens - live
        block = group.block_tokens or block_size
        page = _aligned(block * entry_bytes, group.page_align)
        allocated = batch * padded_layers * blocks_over(tokens - live, tokens, block) * page
    elif group.kind == "compressed":
        block = group.block_tokens or block_size
        per_block = max(block // group.ratio, 1)  # entries a block holds
        blocks = -(-entries // per_block)
        page = _aligned(per_block * entry_bytes, group.page_align)
        index_page = _aligned(per_block * group.indexer_entry_bytes, group.page_align) if group.indexer_entry_bytes else 0
        live = live_window_tokens(group, tokens)
        window = n * live * entry_bytes
        window_block = group.window_block_tokens or block_size
        window_pages = blocks_over(tokens - live, tokens, window_block)
        freed = tokens - live
        allocated = n * (blocks * (page + index_page)
                         + window_pages * _aligned(window_block * entry_bytes, group.page_align))
    elif group.kind == "state":
        state = float(n * entry_bytes)
        allocated = float(batch * padded_layers * max(state_page, entry_bytes))
    else:  # shared, mlp
        allocated = 0.0
    return KindUsage(group.kind, layers, entries, entry_bytes, stored, indexer, window, state,
                     allocated, freed)


def padded_layer_counts(groups, page_bytes) -> list[int]:
    """vLLM's hybrid manager: kinds of one page size form groups of the smallest kind's layer
    count; each kind's layers fill whole groups (the last padded). Kinds outside those groups,
    and models with a single grouped kind, allocate their own layers only."""
    grouped = [i for i, g in enumerate(groups) if g.kind in GROUPED]
    padded = [g.count for g in groups]
    if len(grouped) < 2 or len({page_bytes[i] for i in grouped}) > 1:
        return padded
    size = min(groups[i].count for i in grouped)
    for i in grouped:
        padded[i] = -(-groups[i].count // size) * size
    return padded


# -- what one step's attention reads, per layer group ------------------------------------------
PLAIN_ATTENTION = ("full", "mla", "shared")  # every query reads the whole context


def _window_sum(n: int, w: int) -> int:
    """sum over i = 1..n of min(i, w): keys read by queries at positions 0..n-1 under a window w."""
    return n * (n + 1) // 2 if n <= w else w * (w + 1) // 2 + (n - w) * w


def _chunk_sum(n: int, size: int) -> int:
    """sum over positions p < n of p % size + 1: keys read under chunked-local attention."""
    whole, rest = divmod(n, size)
    return whole * size * (size + 1) // 2 + rest * (rest + 1) // 2


def _pooled_sum(n: int, ratio: int, cap: int = 0) -> int:
    """sum over i = 1..n of min(i // ratio, cap) (no cap when cap is 0): pooled entries read by
    queries at positions 0..n-1 of a compressed layer (an entry exists once its ratio tokens do)."""
    def floor_sum(k: int) -> int:  # sum over i = 1..k of i // ratio
        whole, rest = divmod(k, ratio)
        return ratio * whole * (whole - 1) // 2 + whole * (rest + 1)
    if not cap or n < ratio * cap:
        return floor_sum(n)
    return floor_sum(ratio * cap - 1) + cap * (n - ratio * cap + 1)


def decode_reach(group: LayerGroup, context: int) -> int:
    """Keys one layer's decode query reads when the context (its own token included) is `context`
    (a shared layer with a window reads a sliding source's window; layers without attention none)."""
    if group.kind in NO_ATTENTION:
        return 0
    if group.kind == "sliding" or (group.kind == "shared" and group.window):
        return min(context, group.window)
    if group.kind == "chunked":
        return (context - 1) % group.window + 1
    if group.kind == "dsa" and group.top_k:
        return min(context, group.top_k)
    if group.kind == "compressed":  # top-k (or all) pooled entries, then the raw window
        pooled = context // group.ratio
        return (min(pooled, group.top_k) if group.top_k else pooled) + min(context, group.window)
    return context


def prefill_reach(group: LayerGroup, cached: int, new: int) -> tuple[int, int, int]:
    """(pairs against cached keys, causal pairs within the chunk, KV tokens read) of one layer for a
    chunk of `new` tokens after `cached` ones; a DSA layer's top-k counts as a window of k; a
    compressed layer's pooled entries count against the cache, its raw window as a window."""
    if group.kind in NO_ATTENTION:
        return 0, 0, 0
    if group.kind in ("sliding", "shared") and group.window or (group.kind == "dsa" and group.top_k):
        w = group.top_k if group.kind == "dsa" else group.window
        causal = _window_sum(new, w)
        total = _window_sum(cached + new, w) - _window_sum(cached, w)
        return total - causal, causal, min(cached, w - 1) + new
    if group.kind == "chunked":
        size, start = group.window, cached // group.window * group.window
        first = min(new, start + size - cached)  # queries in the cached tokens' attention chunk
        later = _chunk_sum(cached + new, size) - _chunk_sum(cached + first, size)
        causal = first * (first + 1) // 2 + later
        total = _chunk_sum(cached + new, size) - _chunk_sum(cached, size)
        return total - causal, causal, cached - start + new
    if group.kind == "compressed":
        window = prefill_reach(LayerGroup("sliding", 1, window=max(group.window, 1)), cached, new) \
            if group.window else (0, 0, 0)
        pooled = (_pooled_sum(cached + new, group.ratio, group.top_k)
                  - _pooled_sum(cached, group.ratio, group.top_k))
        entries = (cached + new) // group.ratio
        read = min(entries, group.top_k) if group.top_k else entries
        return window[0] + pooled, window[1], window[2] + read
    return new * cached, new * (new + 1) // 2, cached + new


def indexer_keys(group: LayerGroup, context: int) -> int:
    """Keys a DSA or CSA indexer scores for one decode query at that context (all of them)."""
    if not group.indexer_entry_bytes:
        return 0
    return context // group.ratio if group.kind == "compressed" else context


def indexer_pairs(group: LayerGroup, cached: int, new: int) -> int:
    """Keys the indexer scores for a prefill chunk's queries, summed."""
    if not group.indexer_entry_bytes:
        return 0
    if group.kind == "compressed":
        return _pooled_sum(cached + new, group.ratio) - _pooled_sum(cached, group.ratio)
    return new * cached + new * (new + 1) // 2


@dataclass(frozen=True, slots=True)
class PageKind:
    """One kind of page a sequence of a hybrid model holds (sim.kvcache.hybrid)."""
    group: LayerGroup      # the layer group whose KV it holds
    pooled: bool           # pages of pooled entries (a compressed layer's cache or its indexer keys)
    window: int            # token pages: the live window (0: the whole history; chunked: the chunk)
    per_block: int         # pages for each block index (vLLM's KV-cache groups of this kind)
    tokens_per_page: int   # tokens a page covers (pooled: entries x ratio)
    entry_bytes: float     # one entry of one real layer
    page_bytes: float      # one page (of per_block): its layers (padding included), aligned
    pool: int              # the layer group's index (pools=per_kind: its own pool)

    @property
    def per_sequence(self) -> bool:
        """State pages: one per sequence (per KV-cache group), whatever its length."""
        return self.group.kind == "state"

    def first_live(self, computed: int) -> int:
        """The first token this page kind still holds once `computed` tokens are computed: a
        window drops the tokens no later query reads, as vLLM frees them before the next step."""
        if self.pooled or not self.window:
            return 0
        if self.group.kind == "chunked":
            return computed // self.window * self.window
        return max(0, computed - self.window + 1)

    def blocks(self, first_live: int, end: int) -> int:
        if self.per_sequence:
            return 1 if end > 0 else 0
        if self.pooled:
            entries, per_page = end // self.group.ratio, self.tokens_per_page // self.group.ratio
            return -(-entries // per_page)
        return blocks_over(first_live, end, self.tokens_per_page)


@dataclass(frozen=True, slots=True)
class HybridLayout:
    """The pages of a model with window, chunk or compressed layers: vLLM's hybrid manager groups
    layers of one page size into KV-cache groups of `group_size` layers (the last group of a kind
    padded); compressed layers keep their own pages (main, indexer, raw window)."""
    group_size: int
    page_kinds: tuple[PageKind, ...]

    @property
    def equal_pages(self) -> bool:
        return len({k.page_bytes for k in self.page_kinds}) == 1

    def cache_groups(self) -> list[tuple[PageKind, int]]:
        """vLLM's KV-cache groups, each (its page kind, its real layers): a grouped kind's layers
        group_size at a time (its last group holds the padding); a compressed layer group's pages
        hold all its layers."""
        groups = []
        for kind in self.page_kinds:
            if kind.group.kind == "compressed":
                groups.append((kind, kind.group.count))
                continue
            for index in range(kind.per_block):
                groups.append((kind, min(self.group_size, kind.group.count - index * self.group_size)))
        return groups


def hybrid_layout(groups: tuple[LayerGroup, ...], entry_bytes: list[float], block_size: int,
                  scale: float = 1.0, kv_replication: float = 1.0) -> HybridLayout | None:
    """The layout of a model with sliding, chunked, compressed or state layers (None otherwise);
    entry bytes per group (a state layer's: its state), `scale` the copies a replica keeps (TP
    replication, the PP stage factor), kv_replication the TP part of it (states are split, not
    copied). block_size is the attention's, raised already for state layers (state_block_size):
    a state page is padded to an attention page."""
    if not any(g.kind in WINDOWED or g.kind in ("compressed", "state") for g in groups):
        return None
    token_page = attention_token_page(groups, entry_bytes)
    if any(g.kind == "state" for g in groups) and not token_page:
        raise ConfigError("a model of state layers without attention layers is not modelled (its pages have no "
                          "attention page size to pad to), key model, give it attention layers")
    states = {i: nbytes for i, (g, nbytes) in enumerate(zip(groups, entry_bytes)) if g.kind == "state"}
    entry_bytes = [token_page if g.kind == "state" else nbytes for g, nbytes in zip(groups, entry_bytes)]
    grouped = [(i, g) for i, g in enumerate(groups) if g.kind in GROUPED]
    if len({entry_bytes[i] + g.indexer_entry_bytes for i, g in grouped}) > 1:
        raise ConfigError("a model mixing grouped layer kinds of different entry sizes is not padded to one "
                          "page size yet, key model, give its layers one entry size")
    padded = padded_layer_counts([g for _, g in grouped], [0] * len(grouped))
    size = min(g.count for _, g in grouped) if len(grouped) > 1 else (grouped[0][1].count if grouped else 1)
    kinds = []
    for (i, g), layers in zip(grouped, padded):
        tokens, entry = g.block_tokens or block_size, entry_bytes[i] + g.indexer_entry_bytes
        page = size * _aligned(tokens * entry, g.page_align) * scale
        kinds.append(PageKind(g, False, g.window if g.kind in WINDOWED else 0, layers // size, tokens,
                              states[i] * scale / kv_replication if i in states else entry * scale, page, i))
    for i, g in enumerate(groups):
        if g.kind != "compressed":
            continue
        per_page = max((g.block_tokens or block_size) // g.ratio, 1)
        for nbytes in (entry_bytes[i], g.indexer_entry_bytes):
            if nbytes:
                page = g.count * _aligned(per_page * nbytes, g.page_align) * scale
                kinds.append(PageKind(g, True, 0, 1, per_page * g.ratio, nbytes * scale, page, i))
        if g.window:
            tokens = g.window_block_tokens or block_size
            page = g.count * _aligned(tokens * entry_bytes[i], g.page_align) * scale
            kinds.append(PageKind(g, False, g.window, 1, tokens, entry_bytes[i] * scale, page, i))
    return HybridLayout(size, tuple(kinds))
