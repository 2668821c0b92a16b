"""The compiled cluster loop (numba): the Python engine's replicas, scheduler, paged allocator,
router and step clock over arrays, for the runs sim.engine.compiled.scope admits.

Each replica keeps the Python engine's state in rows of arrays: its running sequences in order,
its waiting queue (a ring: preempted sequences go back to its front), its free blocks and slack
totals, and the step in flight (planned at its start, committed at its end). The loop takes the
earliest of: a step's end (commit, then plan the next at once), an idle replica's wake-up, the
next request reaching the engine (route, queue). At equal times a step's end comes before a
request, and a request before a woken replica plans, as SimPy orders them in sim.engine (see
sim.engine.replica). Sequence ids are rows of the sequence arrays, in arrival order.

Every operation is the Python engine's, in the same order, on the same floats: the step time is
LatencyModel.breakdown summed left to right (its token-count terms come from tables the model
itself computed, sim.engine.compiled.tables), allocation is BlockAllocator.allocate's and the
block pool's. Block ids never matter, only counts, which keys are cached and the free queue's
order: without prefix caching only counts are kept; with it, blocks are kept in runs (one
admission's own blocks, a chain's keys, a stretch of the free queue), so that a request costs
work per segment and per run rather than per block (see the pool's layout below).

Every jitted function and the constants they read live in this one module: numba's cache checks
only the source file of the function it caches, so code split across modules could run stale.
"""
from __future__ import annotations

import math

import numba
import numpy as np

# Sequence columns (int64).
PROMPT, OUTPUT_LEN, FINAL_LEN, TOKENS, COMPUTED, OUTPUTS, PREEMPTIONS, REPLICA, ADMITTED, \
    SLOTS_TOKENS, BLOCKS, NEXT_TURN, STATUS, PREFIX_HIT, EXTENT, HIT_BLOCKS, KEYED, \
    SEGMENTS, NUM_SEGMENTS, PROMPT_PREFIX, OUTPUT_CONTENT, ROOM = range(22)
SEQ_INTS = 22
# With prefix caching: EXTENT the extent of s's own blocks (from depth HIT_BLOCKS, room up to
# depth ROOM), KEYED the blocks keyed (the extent's X_HIGH, X_LIVE and X_KEYED follow BLOCKS
# and KEYED only when s frees it: see the pool's layout).
PENDING, FINISHED, REJECTED = range(3)  # STATUS
# Sequence columns (float64): ARRIVAL when the client sends it, SUBMIT when it reaches the engine
# (serving_overhead_s later), THINK_S the think time before it once its previous turn is done.
ARRIVAL, SUBMIT, FIRST_TOKEN, LAST_TOKEN, FINISH, THINK_S = range(6)
SEQ_FLOATS = 6
# Replica columns (int64).
NUM_RUNNING, WAIT_HEAD, NUM_WAITING, FREE_BLOCKS, TOTAL_RESERVED, TOTAL_INTERNAL, STEPPING, \
    PLAN_LEN, PLAN_PREEMPTED, PLAN_TOKENS, WOKEN, CACHED_FREE, QUEUE_HEAD, QUEUE_TAIL, FREE_ENTRIES, \
    UNUSED_ENTRIES, FREE_EXTENTS, UNUSED_EXTENTS, FREE_CLAIMS, UNUSED_CLAIMS, STORE_TOP, HELD_ROOM, \
    ORDER_LEN, MEMO_RUNS, POOL_FAULT, CHAIN_MASK, NUM_CHAINS, RESERVED_BLOCKS, BLOCKED_CLAIMED, \
    BLOCKED_HEAD, BLOCKED_HIT, BLOCKED_CHAIN = range(32)
REPLICA_INTS = 32
# A waiting head whose admission failed for memory is remembered (BLOCKED_HEAD, -1: none) with
# its prefix hit, the chain of its first block not found (BLOCKED_CHAIN) and whether a key of
# that chain was claimed since (BLOCKED_CLAIMED; see _still_blocked).
# Replica columns (float64).
STEP_END, WAKE = range(2)
# Parameters (int64).
(P_REPLICAS, P_BLOCK_SIZE, P_NUM_BLOCKS, P_MAX_SEQS, P_BUDGET, P_CHUNKED, P_MAX_MODEL_LEN,
 P_RESERVE_FULL, P_PP, P_ROUTER, P_LAYERS, P_ASYNC_OUTPUT, P_EXPERT_PARALLEL, P_NEXT_ROUND_ROBIN,
 P_NEXT_START, P_NUM_LATER, P_LATER_COUNT, P_CACHING, P_NO_EVICT, P_ASYNC_SCHEDULING) = range(20)
PARAM_INTS = 20
# The block pool with prefix caching (core.run's pool tuple; the functions below take its arrays
# one by one, as a tuple argument costs a reference count per array), per replica, kept in runs
# of blocks rather than block by block (block ids never matter, only which keys are cached and
# the free queue's order). Each admission's own blocks form an extent (one sequence's blocks
# from the depth its prefix hit ends): its blocks' reference counts (-1: evicted) and free-queue
# entries lie side by side in the replica's block store (POOL_STORE's rows REF and PLACE;
# compacted in store order, POOL_ORDER, when its top passes a soft limit: _new_extent). The free
# queue is a linked list of entries, each a run of one extent's free blocks taken deepest first
# (a first entry of extent -1 holds the blocks never used). Depths count blocks from a
# sequence's first; a claim's offsets count tokens within its chain. BlockPool.cached is a table
# of chains (POOL_CHAIN_TABLE: a prefix id << 32 | content id, the keys of one segment or of the
# output after a prompt, and its record), each chain's record holding a list of claims: a run of
# the chain's offsets (one per block, block_size apart) whose keys find an extent's blocks from a
# depth on (evicting a block takes its key out of its claim, so a claim holds live blocks only
# and there are never more claims than blocks). An extent also lists its own claims, deepest
# first, so that evicting its blocks finds their claims without hashing or segment search.
# While its sequence holds an extent (X_HELD), the blocks it takes touch neither the extent's
# row nor its store lines: its depths and counts are the sequence's (BLOCKS, KEYED) until the
# sequence frees it, and its blocks' reference counts are written when they are claimed or
# freed (_held_once), as no other sequence can find an unclaimed block. Extents, entries and
# claims (chain records among them) are rows taken from and returned to free lists (their last
# field links them). POOL_MEMO
# holds the last lookup's runs (extent, first depth, end depth; BlockAllocator.free's walk
# writes there too, never between a lookup and its admission); POOL_SEGMENTS the requests'
# prompt segments as rows (start, content id, the prefix id before it).
POOL_SEGMENTS, POOL_STORE, POOL_EXTENTS, POOL_ENTRIES, POOL_CLAIMS, POOL_CHAIN_TABLE, POOL_ORDER, \
    POOL_MEMO = range(8)
REF, PLACE = range(2)  # the store's rows
X_SEQ, X_BASE, X_STORE_LOW, X_CAPACITY, X_HIGH, X_KEYED, X_CLAIMED, X_LIVE, X_HELD, X_CLAIMS, \
    X_LINK = range(11)
EXTENT_FIELDS = 11
Q_EXTENT, Q_LOW, Q_HIGH, Q_PREV, Q_NEXT = range(5)
ENTRY_FIELDS = 5
# A claim: its extent, offsets, first depth, chain record, the chain's list (doubly linked) and
# its extent's own list (deepest first: X_CLAIMS its head), so that eviction finds it unhashed.
C_EXTENT, C_LOW, C_HIGH, C_DEPTH, C_CHAIN, C_PREV, C_OWN_NEXT, C_NEXT = range(8)
CLAIM_FIELDS = 8
H_HEAD, H_SLOT = range(2)  # a chain's record: a row of the claims array
EMPTY = np.uint64(0xFFFFFFFFFFFFFFFF)
NO_END = 1 << 62  # the output chain's end depth
# Parameters (float64).
P_WATERMARK, P_GRAPH_LAUNCH_S, P_EAGER_LAUNCH_S, P_OVERHEAD_S = range(4)
PARAM_FLOATS = 4
# Routers.
ROUTE_REQUESTS, ROUTE_WAITING, ROUTE_QUEUED_TOKENS, ROUTE_ROUND_ROBIN = range(4)
# Token-count table columns: QKV and O projections, MLP, all-reduce, all-to-all, elementwise
# kernels, send/recv.
T_QKV, T_MLP, T_ALLREDUCE, T_ALL_TO_ALL, T_ELEMENTWISE, T_SEND_RECV = range(6)
TOKEN_TERMS = 6
# Attention operator parameters: peak, bandwidth, e_c, e_m, t0, per sequence, causal e, heads per
# rank, query-key width, value width, KV bytes per token per layer per rank, has a table.
A_PEAK, A_BW, A_EC, A_EM, A_T0, A_PER_SEQ, A_CAUSAL_EC, A_HEADS, A_QK, A_V, A_KV_BYTES, A_TABLE = range(12)
ACTIVATION_BYTES, CAUSAL_TILE = 2, 128  # sim.latency.operators
# Timeline int columns (sim.recorder.INT_COLUMNS).
TIMELINE_INTS = 15
# What run() stopped at.
DONE, OUT_OF_ROWS, SUBMITS_DONE, STUCK, STORE_FULL = range(5)

# Only run() allocates arrays; every function it calls is compiled without numba's reference
# counting (_nrt=False), which otherwise costs two atomic operations per array argument per
# call: a third of the loop's time (measured with perf, benchmarks/README.md). They only read
# and write the arrays run() holds, so no count is needed to keep them alive.
entry = numba.njit(cache=True, nogil=True, error_model="numpy")
jit = numba.njit(cache=True, nogil=True, _nrt=False, error_model="numpy")
# Small helpers called per sequence or per run of blocks are inlined where they are called, and
# so is most of the pool's path from a running sequence's growth to the eviction of a cached
# block (_grow, _unclaim, _key_full_blocks; _take stays one call) and the keying and walking of
# a prefix (_claim, _key_range, _walk, _touch): a call passes each array as about ten words
# (data, shape, strides), and a dozen of them cost more than the work (rag_agents_100k's prefix
# loop 1.80 -> 1.39 s, benchmarks/README.md). _take inlined too measured the same loop and a
# first compile of 60 s against 44 s; inlining _lookup and _release measured no gain (71 s).
inline = numba.njit(cache=True, nogil=True, _nrt=False, inline="always", error_model="numpy")


@jit
def _factor(grid, factors, size):
    """CalibratedOp.factor: interpolated in log2(size), held at the edges."""
    x = math.log2(size)
    if x <= grid[0]:
        return factors[0]
    if x >= grid[-1]:
        return factors[-1]
    i = np.searchsorted(grid, x, side="right") - 1
    return factors[i] + (factors[i + 1] - factors[i]) * ((x - grid[i]) / (grid[i + 1] - grid[i]))


@jit
def _corrected(par, grid, factors, size, flops, nbytes, num_seqs, causal_flops):
    """CalibratedOp.corrected on Roofline.time and floor_time (attention: no read ceiling)."""
    compute = flops / (par[A_PEAK] * par[A_EC])
    if causal_flops != 0.0:
        compute += causal_flops / (par[A_PEAK] * par[A_CAUSAL_EC])
    fitted = par[A_T0] + par[A_PER_SEQ] * num_seqs + max(compute, nbytes / (par[A_BW] * par[A_EM]))
    floor = max((flops + causal_flops) / par[A_PEAK], nbytes / par[A_BW])
    if par[A_TABLE] == 0.0 or size <= 0:
        return max(fitted, floor)
    return max(fitted * _factor(grid, factors, size), floor)


@jit
def _prefill_attention(par, grid, factors, chunks, context_pairs, causal_pairs, kv_tokens, new_tokens):
    """LatencyModel.attention_prefill_time (sim.latency.operators.attention_prefill_work)."""
    width = par[A_QK] + par[A_V]
    per_pair = 2.0 * par[A_HEADS] * width
    nbytes = kv_tokens * par[A_KV_BYTES] + new_tokens * par[A_HEADS] * width * ACTIVATION_BYTES
    computed = causal_pairs + new_tokens * (CAUSAL_TILE - 1) / 2
    return _corrected(par, grid, factors, new_tokens / max(chunks, 1.0), per_pair * context_pairs, nbytes,
                      chunks, per_pair * computed)


@jit
def _decode_attention(par, grid, factors, num_seqs, context_tokens):
    """LatencyModel.attention_decode_time (sim.latency.operators.attention_decode_work)."""
    flops = 2.0 * par[A_HEADS] * (par[A_QK] + par[A_V]) * context_tokens
    return _corrected(par, grid, factors, context_tokens, flops, context_tokens * par[A_KV_BYTES], num_seqs, 0.0)


@jit
def step_time(pi, pf, shape, tokens_table, graph_table, lm_table, lm_graph, cpu_table, output_table,
              capture, prefill_par, prefill_grid, prefill_factors, decode_par, decode_grid, decode_factors):
    """sum(LatencyModel.breakdown(shape).values()) for a shape of integers: prefill tokens,
    prefill chunks, context pairs, causal pairs, prefill KV tokens, decode sequences, decode
    context tokens, sampled sequences."""
    pp, layers = pi[P_PP], pi[P_LAYERS]
    prefill_tokens, prefill_seqs, decode_seqs, sampled = shape[0], shape[1], shape[5], shape[7]
    whole_seqs = prefill_seqs + decode_seqs
    parts = max(1, min(pp, whole_seqs))
    p = float(parts)
    # The micro-batch (BatchShape.micro_batch): exact, parts being 1 or 2.
    m_prefill_tokens, m_prefill_seqs = prefill_tokens / p, prefill_seqs / p
    m_pairs, m_causal, m_kv = shape[2] / p, shape[3] / p, shape[4] / p
    m_decode_seqs, m_decode_context = decode_seqs / p, shape[6] / p
    graph = 0
    if m_prefill_tokens == 0.0 and len(capture) and m_decode_seqs <= capture[-1]:
        graph = capture[np.searchsorted(capture, m_decode_seqs, side="left")]
    row = parts - 1
    if graph:  # (elements, not row views: a view costs two atomic reference counts)
        qkv, mlp, allreduce = graph_table[graph, T_QKV], graph_table[graph, T_MLP], graph_table[graph, T_ALLREDUCE]
        all_to_all, send_recv = graph_table[graph, T_ALL_TO_ALL], graph_table[graph, T_SEND_RECV]
        elementwise = graph_table[graph, T_ELEMENTWISE]
        lm_head = lm_graph[graph]
    else:
        count = prefill_tokens + decode_seqs
        qkv, mlp = tokens_table[row, count, T_QKV], tokens_table[row, count, T_MLP]
        allreduce, all_to_all = tokens_table[row, count, T_ALLREDUCE], tokens_table[row, count, T_ALL_TO_ALL]
        send_recv, elementwise = tokens_table[row, count, T_SEND_RECV], tokens_table[row, count, T_ELEMENTWISE]
        lm_head = lm_table[row, sampled]
    attention_prefill = 0.0
    if m_prefill_tokens != 0.0:
        attention_prefill = layers * _prefill_attention(prefill_par, prefill_grid, prefill_factors, m_prefill_seqs,
                                                        m_pairs, m_causal, m_kv, m_prefill_tokens)
    attention_decode = 0.0
    if m_decode_seqs != 0.0:
        attention_decode = layers * _decode_attention(decode_par, decode_grid, decode_factors, m_decode_seqs,
                                                      m_decode_context)
    gpu = qkv + mlp + elementwise + p * lm_head + attention_prefill + attention_decode + allreduce
    if pi[P_EXPERT_PARALLEL]:
        gpu += all_to_all
    if pp > 1:
        gpu += (pp - 1) * send_recv
        if prefill_tokens:  # the chunk crosses every stage whole (LatencyModel.breakdown)
            chunk = tokens_table[0, prefill_tokens]
            latency = chunk[T_QKV] + chunk[T_MLP] + chunk[T_ELEMENTWISE] + 1.0 * lm_table[0, min(sampled, prefill_seqs)] \
                + layers * _prefill_attention(prefill_par, prefill_grid, prefill_factors, float(prefill_seqs),
                                              float(shape[2]), float(shape[3]), float(shape[4]),
                                              float(prefill_tokens)) + 0.0 + chunk[T_ALLREDUCE]
            if pi[P_EXPERT_PARALLEL]:
                latency += chunk[T_ALL_TO_ALL]
            latency += (pp - 1) * chunk[T_SEND_RECV]
            gpu += max(0.0, latency - gpu)
    if graph:
        launch = p * pf[P_GRAPH_LAUNCH_S]
    else:
        launch = max(0.0, pf[P_EAGER_LAUNCH_S] - gpu)
    cpu = p * cpu_table[row, whole_seqs]
    output = p * output_table[row, whole_seqs]
    if pi[P_ASYNC_SCHEDULING]:  # (LatencyModel.breakdown)
        cpu, output = max(0.0, cpu + output - gpu), 0.0
    elif pi[P_ASYNC_OUTPUT]:
        output = max(0.0, output - gpu)
    return gpu + launch + cpu + output


@inline
def _slack(slots, tokens, final_len):
    """sim.kvcache.base.slack_split: (reserved, internal fragmentation)."""
    reserved = max(0, min(slots, final_len) - tokens)
    return reserved, slots - tokens - reserved


@inline
def _count_slack(rep, r, seqs, s, size, sign):
    reserved, internal = _slack(seqs[s, BLOCKS] * size, seqs[s, SLOTS_TOKENS], seqs[s, FINAL_LEN])
    rep[r, TOTAL_RESERVED] += sign * reserved
    rep[r, TOTAL_INTERNAL] += sign * internal


@inline
def _chain(prefix, content):
    return (np.uint64(prefix) << np.uint64(32)) | np.uint64(content)


@inline
def _first_segment(seqs, segments, s, end):
    """The last of s's segments starting at or before token end - 1."""
    first, count = seqs[s, SEGMENTS], seqs[s, NUM_SEGMENTS]
    low, high = first, first + count
    while high - low > 1:
        middle = (low + high) // 2
        if segments[middle, 0] <= end - 1:
            low = middle
        else:
            high = middle
    return low


@inline
def _chain_span(pi, seqs, segments, s, d, j):
    """The keys of s's blocks from depth d on that share d's chain (Request.prefix_key's prefix
    id << 32 | content id: the segment holding the block's last token, or the output after the
    prompt): (chain, the token its offsets count from, the depth where the chain ends, the
    segment cursor). j < 0: the segment is found by search, else moved on from j."""
    size, prompt = pi[P_BLOCK_SIZE], seqs[s, PROMPT]
    end = (d + 1) * size
    if end > prompt:
        return _chain(seqs[s, PROMPT_PREFIX], seqs[s, OUTPUT_CONTENT]), prompt, NO_END, j
    if j < 0:
        j = _first_segment(seqs, segments, s, end)
    last = seqs[s, SEGMENTS] + seqs[s, NUM_SEGMENTS] - 1
    while j < last and segments[j + 1, 0] <= end - 1:  # the last of equal starts
        j += 1
    next_start = segments[j + 1, 0] if j < last else prompt
    return _chain(segments[j, 2], segments[j, 1]), segments[j, 0], next_start // size, j


@inline
def _chain_home(rep, r, chain):
    """Where a chain starts its probe in the part of a replica's chain table in use (a power
    of two, rep[r, CHAIN_MASK] + 1 rows): MurmurHash3's 64-bit finalizer."""
    h = chain * np.uint64(0x9E3779B97F4A7C15)
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xFF51AFD7ED558CCD)
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xC4CEB9FE1A85EC53)
    h ^= h >> np.uint64(33)
    return np.int64(h & np.uint64(rep[r, CHAIN_MASK]))


@inline
def _find_chain(chain_table, rep, r, chain):
    """The chain's record, or -1 when no block of it is cached."""
    mask = rep[r, CHAIN_MASK]
    i = _chain_home(rep, r, chain)
    while True:
        record = chain_table[r, i, 1]
        if record == EMPTY:
            return -1
        if chain_table[r, i, 0] == chain:
            return np.int64(record)
        i = (i + 1) & mask


@inline
def _new_row(rows, rep, r, head):
    """A row off a free list (its rows linked through their last field; head + 1: the first
    row never used, taken when the list is empty, so that memory is touched as it is used).
    Out of rows (never, by the sizes core.run is given), rep[r, POOL_FAULT] is set."""
    i = rep[r, head]
    if i < 0:
        i = rep[r, head + 1]
        if i == rows.shape[1]:
            rep[r, POOL_FAULT] = 1
            return i - 1
        rep[r, head + 1] += 1
        return i
    rep[r, head] = rows[r, i, rows.shape[2] - 1]
    return i


@inline
def _drop_row(rows, rep, r, head, i):
    rows[r, i, rows.shape[2] - 1] = rep[r, head]
    rep[r, head] = i


@jit
def _add_chain(chain_table, claims, rep, r, chain):
    """A record (a row of the claims array) for a chain, in the table; the part of the table in
    use doubles first if the chain would fill more than half of it."""
    if 2 * (rep[r, NUM_CHAINS] + 1) > rep[r, CHAIN_MASK] + 1 and rep[r, CHAIN_MASK] + 1 < chain_table.shape[1] // 2:
        _grow_chain_table(chain_table, claims, rep, r)
    c = _new_row(claims, rep, r, FREE_CLAIMS)
    _place_chain(chain_table, claims, rep, r, chain, c)
    claims[r, c, H_HEAD] = -1
    rep[r, NUM_CHAINS] += 1
    return c


@inline
def _place_chain(chain_table, claims, rep, r, chain, c):
    mask = rep[r, CHAIN_MASK]
    i = _chain_home(rep, r, chain)
    while chain_table[r, i, 1] != EMPTY:
        i = (i + 1) & mask
    chain_table[r, i, 0], chain_table[r, i, 1] = chain, np.uint64(c)
    claims[r, c, H_SLOT] = i


@jit
def _grow_chain_table(chain_table, claims, rep, r):
    """Twice as much of the chain table in use, its chains placed anew (moved through the
    table's second half, kept as scratch room). The table is sized for the most chains a run
    can hold, but only a few thousand are ever cached at once: a small part in use keeps the
    probes in the CPU's cache (the whole table, 1 MB a replica at rag_agents_100k, missed it
    on most probes)."""
    used, scratch = rep[r, CHAIN_MASK] + 1, chain_table.shape[1] // 2
    kept = 0
    for i in range(used):
        if chain_table[r, i, 1] != EMPTY:
            chain_table[r, scratch + kept, 0], chain_table[r, scratch + kept, 1] = chain_table[r, i, 0], chain_table[r, i, 1]
            kept += 1
    chain_table[r, :2 * used, 1] = EMPTY
    rep[r, CHAIN_MASK] = 2 * used - 1
    for i in range(scratch, scratch + kept):
        _place_chain(chain_table, claims, rep, r, chain_table[r, i, 0], np.int64(chain_table[r, i, 1]))


@jit
def _drop_chain(chain_table, claims, rep, r, c):
    """A chain record with no claims leaves the table: later rows of its probe run move back
    into the gap (backward-shift deletion)."""
    mask = rep[r, CHAIN_MASK]
    gap = j = claims[r, c, H_SLOT]
    while True:
        j = (j + 1) & mask
        chain, other = chain_table[r, j, 0], chain_table[r, j, 1]
        if other == EMPTY:
            break
        home = _chain_home(rep, r, chain)
        # The row may fill the gap unless its home lies cyclically in (gap, j].
        if (gap <= j and (home <= gap or home > j)) or (gap > j and home <= gap and home > j):
            chain_table[r, gap, 0], chain_table[r, gap, 1] = chain, other
            claims[r, np.int64(other), H_SLOT] = gap
            gap = j
    chain_table[r, gap, 1] = EMPTY
    rep[r, NUM_CHAINS] -= 1
    _drop_row(claims, rep, r, FREE_CLAIMS, c)


@inline
def _claim_at(claims, r, head, offset, size):
    """The claim of a chain's list holding the key at offset, or -1."""
    c = head
    while c >= 0:
        low = claims[r, c, C_LOW]
        if low <= offset < claims[r, c, C_HIGH] and (offset - low) % size == 0:
            return c
        c = claims[r, c, C_NEXT]
    return -1


@inline
def _next_claimed(claims, r, head, offset, size, limit):
    """The first offset after `offset` (same stride) where a claim of the list starts, or limit."""
    c, first = head, limit
    while c >= 0:
        low = claims[r, c, C_LOW]
        if offset < low < first and (low - offset) % size == 0:
            first = low
        c = claims[r, c, C_NEXT]
    return first


@inline
def _claim(pi, claims, extents, chain_table, rep, r, e, chain, low, high, depth):
    """cached.setdefault for the keys at offsets [low, high) of a chain, held by extent e's
    blocks from depth on: e claims the offsets no block claims yet (its other blocks are
    duplicates, keyed but never found). e's claims come deepest first, so the one that may grow
    (ending at the offset, on this chain) is its newest."""
    size = pi[P_BLOCK_SIZE]
    if np.int64(chain) == rep[r, BLOCKED_CHAIN]:  # (see _still_blocked)
        rep[r, BLOCKED_CLAIMED] = 1
    h = _find_chain(chain_table, rep, r, chain)
    if h < 0:
        h = _add_chain(chain_table, claims, rep, r, chain)
    offset = low
    while offset < high:
        c = _claim_at(claims, r, claims[r, h, H_HEAD], offset, size)
        if c >= 0:
            offset = min(claims[r, c, C_HIGH], high)
            continue
        stop = _next_claimed(claims, r, claims[r, h, H_HEAD], offset, size, high)
        c = extents[r, e, X_CLAIMS]
        if c < 0 or claims[r, c, C_CHAIN] != h or claims[r, c, C_HIGH] != offset:
            c = _new_claim(claims, rep, r, h, e, offset, depth + (offset - low) // size)
            claims[r, c, C_OWN_NEXT] = extents[r, e, X_CLAIMS]
            extents[r, e, X_CLAIMS] = c
        claims[r, c, C_HIGH] = stop
        offset = stop


@inline
def _new_claim(claims, rep, r, h, e, offset, depth):
    """A claim of extent e from offset (at depth) on, first in chain record h's list."""
    c = _new_row(claims, rep, r, FREE_CLAIMS)
    head = claims[r, h, H_HEAD]
    claims[r, c, C_EXTENT], claims[r, c, C_LOW], claims[r, c, C_HIGH], claims[r, c, C_DEPTH] = e, offset, offset, depth
    claims[r, c, C_CHAIN], claims[r, c, C_PREV], claims[r, c, C_NEXT] = h, -1, head
    if head >= 0:
        claims[r, head, C_PREV] = c
    claims[r, h, H_HEAD] = c
    return c


@inline
def _drop_claim(claims, chain_table, rep, r, c):
    """A claim leaves its chain's list (and the chain the table, with its last claim)."""
    h, before, after = claims[r, c, C_CHAIN], claims[r, c, C_PREV], claims[r, c, C_NEXT]
    if before < 0:
        claims[r, h, H_HEAD] = after
    else:
        claims[r, before, C_NEXT] = after
    if after >= 0:
        claims[r, after, C_PREV] = before
    _drop_row(claims, rep, r, FREE_CLAIMS, c)
    if claims[r, h, H_HEAD] < 0:
        _drop_chain(chain_table, claims, rep, r, h)


@inline
def _unclaim(pi, claims, extents, chain_table, rep, r, e, low, high):
    """del cached[key] for the keys of extent e's blocks at depths [low, high): its claims (its
    own list, deepest first) lose those depths."""
    size = pi[P_BLOCK_SIZE]
    low_tokens, high_tokens = low * size, high * size  # (depths compared as tokens: no division)
    before, c = -1, extents[r, e, X_CLAIMS]
    while c >= 0:
        following = claims[r, c, C_OWN_NEXT]
        first = claims[r, c, C_DEPTH]
        end_tokens = first * size + claims[r, c, C_HIGH] - claims[r, c, C_LOW]  # its end depth x size
        if end_tokens <= low_tokens:  # and so every claim after it
            break
        if first >= high:
            before, c = c, following
            continue
        if low <= first and end_tokens <= high_tokens:  # all of it
            if before < 0:
                extents[r, e, X_CLAIMS] = following
            else:
                claims[r, before, C_OWN_NEXT] = following
            _drop_claim(claims, chain_table, rep, r, c)
            c = following
            continue
        if first < low and high_tokens < end_tokens:  # its middle: the part above becomes a claim, before it
            upper = _new_claim(claims, rep, r, claims[r, c, C_CHAIN], e,
                               claims[r, c, C_LOW] + (high - first) * size, high)
            claims[r, upper, C_HIGH], claims[r, upper, C_OWN_NEXT] = claims[r, c, C_HIGH], c
            if before < 0:
                extents[r, e, X_CLAIMS] = upper
            else:
                claims[r, before, C_OWN_NEXT] = upper
            claims[r, c, C_HIGH] = claims[r, c, C_LOW] + (low - first) * size
        elif first < low:  # its top
            claims[r, c, C_HIGH] = claims[r, c, C_LOW] + (low - first) * size
        else:  # its bottom
            claims[r, c, C_LOW] += (high - first) * size
            claims[r, c, C_DEPTH] = high
        before, c = c, following


@inline
def _walk(pi, seqs, segments, claims, chain_table, memo, rep, r, s, count):
    """The cached blocks at the start of s, up to count: as runs (extent, first depth, end
    depth) in memo[r, :runs], in s's order; returns (runs, blocks)."""
    size = pi[P_BLOCK_SIZE]
    runs = d = 0
    j = -1
    while d < count:
        chain, start, chain_end, j = _chain_span(pi, seqs, segments, s, d, j)
        h = _find_chain(chain_table, rep, r, chain)
        if h < 0:
            break
        stop = min(chain_end, count)
        while d < stop:
            offset = (d + 1) * size - start
            c = _claim_at(claims, r, claims[r, h, H_HEAD], offset, size)
            if c < 0:
                break
            e = claims[r, c, C_EXTENT]
            at = claims[r, c, C_DEPTH] + (offset - claims[r, c, C_LOW]) // size
            length = min((claims[r, c, C_HIGH] - offset) // size, stop - d)
            if runs and memo[r, runs - 1, 0] == e and memo[r, runs - 1, 2] == at:
                memo[r, runs - 1, 2] = at + length
            else:
                memo[r, runs, 0], memo[r, runs, 1], memo[r, runs, 2] = e, at, at + length
                runs += 1
            d += length
        if d < stop:
            break
    return runs, d


@jit
def _lookup(pi, seqs, segments, claims, chain_table, memo, store, extents, rep, r, s):
    """BlockAllocator.lookup_prefix: cached full blocks at the start of s, never its last token
    (a pure query): their runs kept for the admission that may follow; returns their count and
    how many are free."""
    if not pi[P_CACHING]:
        return 0, 0
    runs, found = _walk(pi, seqs, segments, claims, chain_table, memo, rep, r, s,
                        (seqs[s, TOKENS] - 1) // pi[P_BLOCK_SIZE])
    rep[r, MEMO_RUNS] = runs
    revived = 0
    refs = store[r, REF]
    for k in range(runs):
        e = memo[r, k, 0]
        first = np.uint64(memo[r, k, 1] + extents[r, e, X_BASE] - extents[r, e, X_STORE_LOW])
        for i in range(memo[r, k, 2] - memo[r, k, 1]):  # (unsigned indices: no wraparound, a plain vector loop)
            revived += refs[first + np.uint64(i)] == 0
    return found, revived


@inline
def _join(entries, rep, r, before, after):
    """Entry `after` follows entry `before` in the free queue (-1: the queue's head or tail)."""
    if before < 0:
        rep[r, QUEUE_HEAD] = after
    else:
        entries[r, before, Q_NEXT] = after
    if after < 0:
        rep[r, QUEUE_TAIL] = before
    else:
        entries[r, after, Q_PREV] = before


@inline
def _unlink_entry(entries, rep, r, q):
    _join(entries, rep, r, entries[r, q, Q_PREV], entries[r, q, Q_NEXT])
    _drop_row(entries, rep, r, FREE_ENTRIES, q)


@inline
def _link_entry(entries, rep, r, e, low, high, after):
    """A new queue entry (extent e's free blocks from depth high - 1 down to low, in that
    order) after entry `after` (-1: at the head)."""
    q = _new_row(entries, rep, r, FREE_ENTRIES)
    entries[r, q, Q_EXTENT], entries[r, q, Q_LOW], entries[r, q, Q_HIGH] = e, low, high
    following = rep[r, QUEUE_HEAD] if after < 0 else entries[r, after, Q_NEXT]
    _join(entries, rep, r, after, q)
    _join(entries, rep, r, q, following)
    return q


@jit
def _unqueue(entries, store, rep, r, q, low, high, shift):
    """Blocks [low, high) of entry q's extent leave the free queue (a revival); the entry keeps
    its order, split in two around them if they lie inside it."""
    e, q_low, q_high = entries[r, q, Q_EXTENT], entries[r, q, Q_LOW], entries[r, q, Q_HIGH]
    if q_low == low and q_high == high:
        _unlink_entry(entries, rep, r, q)
    elif q_low == low:
        entries[r, q, Q_LOW] = high
    elif q_high == high:
        entries[r, q, Q_HIGH] = low
    elif low - q_low <= q_high - high:  # the smaller part moves to a new entry
        entries[r, q, Q_LOW] = high
        moved = _link_entry(entries, rep, r, e, q_low, low, q)
        store[r, PLACE, q_low + shift:low + shift] = moved
    else:
        entries[r, q, Q_HIGH] = low
        moved = _link_entry(entries, rep, r, e, high, q_high, entries[r, q, Q_PREV])
        store[r, PLACE, high + shift:q_high + shift] = moved


@inline
def _touch(store, extents, entries, memo, rep, r):
    """BlockPool.touch of the last lookup's blocks: one more reference to each, out of the free
    queue if free."""
    for k in range(rep[r, MEMO_RUNS]):
        e, low, high = memo[r, k, 0], memo[r, k, 1], memo[r, k, 2]
        shift = extents[r, e, X_BASE] - extents[r, e, X_STORE_LOW]
        d = low
        while d < high:
            if store[r, REF, d + shift] != 0:
                store[r, REF, d + shift] += 1
                d += 1
                continue
            q, stop = store[r, PLACE, d + shift], d + 1  # a run of free blocks in one entry
            while stop < high and store[r, REF, stop + shift] == 0 and store[r, PLACE, stop + shift] == q:
                stop += 1
            _unqueue(entries, store, rep, r, q, d, stop, shift)
            store[r, REF, d + shift:stop + shift] = 1
            rep[r, FREE_BLOCKS] -= stop - d
            rep[r, CACHED_FREE] -= stop - d  # a found block holds its key
            d = stop


@jit
def _compact(store, extents, order, rep, r):
    """Move the extents' block state to the front of the replica's store, in store order; an
    extent no sequence holds keeps only the span from its first to its last live block."""
    top = kept = 0
    for i in range(rep[r, ORDER_LEN]):
        e, base = order[r, i, 0], order[r, i, 1]
        if extents[r, e, X_BASE] != base:  # dropped (or dropped and reused)
            continue
        low, high = extents[r, e, X_STORE_LOW], extents[r, e, X_STORE_LOW] + extents[r, e, X_CAPACITY]
        if not extents[r, e, X_HELD]:
            high = extents[r, e, X_HIGH]
            while store[r, REF, base + low - extents[r, e, X_STORE_LOW]] < 0:
                low += 1
            while store[r, REF, base + high - 1 - extents[r, e, X_STORE_LOW]] < 0:
                high -= 1
        source = base + low - extents[r, e, X_STORE_LOW]
        for k in range(high - low):  # forward: the new place is never after the old
            store[r, REF, top + k] = store[r, REF, source + k]
            store[r, PLACE, top + k] = store[r, PLACE, source + k]
        extents[r, e, X_BASE], extents[r, e, X_STORE_LOW], extents[r, e, X_CAPACITY] = top, low, high - low
        if not extents[r, e, X_HELD]:
            extents[r, e, X_HIGH] = high  # (no block above it lives)
        order[r, kept, 0], order[r, kept, 1] = e, top
        kept += 1
        top += high - low
    rep[r, STORE_TOP], rep[r, ORDER_LEN] = top, kept


@jit
def _new_extent(pi, store, extents, order, rep, r, s, low, capacity):
    """The extent of s's own blocks (depths from low on, room for capacity), or -1 when the
    store is full even compacted. The store is compacted once its top passes twice every
    block plus the room of the extents held (about what compaction keeps), so that its memory
    is touched only as far as needed."""
    soft = 2 * (pi[P_NUM_BLOCKS] + rep[r, HELD_ROOM] + capacity) + 1024
    if rep[r, STORE_TOP] + capacity > min(soft, store.shape[2]) or rep[r, ORDER_LEN] == order.shape[1]:
        _compact(store, extents, order, rep, r)
        if rep[r, STORE_TOP] + capacity > store.shape[2]:
            return -1
    e = _new_row(extents, rep, r, FREE_EXTENTS)
    extents[r, e, X_SEQ], extents[r, e, X_BASE], extents[r, e, X_STORE_LOW] = s, rep[r, STORE_TOP], low
    extents[r, e, X_CAPACITY], extents[r, e, X_HIGH], extents[r, e, X_KEYED] = capacity, low, low
    extents[r, e, X_CLAIMED] = low
    extents[r, e, X_LIVE], extents[r, e, X_HELD], extents[r, e, X_CLAIMS] = 0, 1, -1
    order[r, rep[r, ORDER_LEN], 0], order[r, rep[r, ORDER_LEN], 1] = e, rep[r, STORE_TOP]
    rep[r, ORDER_LEN] += 1
    rep[r, STORE_TOP] += capacity
    rep[r, HELD_ROOM] += capacity
    return e


@inline
def _drop_extent_if_done(extents, rep, r, e):
    if extents[r, e, X_LIVE] == 0 and not extents[r, e, X_HELD]:
        extents[r, e, X_BASE] = -1
        _drop_row(extents, rep, r, FREE_EXTENTS, e)


@inline
def _evict(pi, store, extents, claims, chain_table, rep, r, e, low, high):
    """Extent e's free blocks [low, high) are taken: those holding keys lose them."""
    shift = extents[r, e, X_BASE] - extents[r, e, X_STORE_LOW]
    store[r, REF, low + shift:high + shift] = -1
    keyed_high = min(high, extents[r, e, X_KEYED])
    if keyed_high > low:
        rep[r, CACHED_FREE] -= keyed_high - low
        _unclaim(pi, claims, extents, chain_table, rep, r, e, low, keyed_high)
    extents[r, e, X_LIVE] -= high - low
    _drop_extent_if_done(extents, rep, r, e)


@jit
def _take(pi, store, extents, entries, claims, chain_table, rep, r, count):
    """BlockPool.take in LRU's free order (each entry's blocks deepest first): count blocks,
    their keys dropped, leave the free queue to become a held extent's next blocks (that
    extent's row and store lines are left alone: _held_once, _free)."""
    rep[r, FREE_BLOCKS] -= count
    taken = 0
    while taken < count:
        q = rep[r, QUEUE_HEAD]
        victim, low, high = entries[r, q, Q_EXTENT], entries[r, q, Q_LOW], entries[r, q, Q_HIGH]
        m = min(count - taken, high - low)
        entries[r, q, Q_HIGH] = high - m
        if victim >= 0:
            _evict(pi, store, extents, claims, chain_table, rep, r, victim, high - m, high)
        if high - m == low:
            _unlink_entry(entries, rep, r, q)
        taken += m


@inline
def _held_once(store, extents, r, e, low, high):
    """Extent e's blocks [low, high), its sequence's own, are each held once: written when they
    are claimed or freed, not when taken, so that a block taken in decode (most of the
    1.9 million taken at rag_agents_100k) costs no cache miss on its extent's store line."""
    shift = extents[r, e, X_BASE] - extents[r, e, X_STORE_LOW]
    store[r, REF, low + shift:high + shift] = 1


@jit
def _release(store, extents, entries, rep, r, e, low, high):
    """BlockPool.release of extent e's blocks [low, high), deepest first: a block whose count
    reaches 0 joins the free queue's tail. A run of blocks held once joins in one go (the same
    entry as block by block: each extends the entry its deeper neighbour made)."""
    shift = extents[r, e, X_BASE] - extents[r, e, X_STORE_LOW]
    keyed = extents[r, e, X_KEYED]
    d = high - 1
    while d >= low:
        if store[r, REF, d + shift] != 1:
            store[r, REF, d + shift] -= 1
            d -= 1
            continue
        first = d  # the run [first, d] of blocks held once
        while first > low and store[r, REF, first - 1 + shift] == 1:
            first -= 1
        q = rep[r, QUEUE_TAIL]
        if q >= 0 and entries[r, q, Q_EXTENT] == e and entries[r, q, Q_LOW] == d + 1:
            entries[r, q, Q_LOW] = first
        else:
            q = _link_entry(entries, rep, r, e, first, d + 1, q)
        store[r, REF, first + shift:d + 1 + shift] = 0
        store[r, PLACE, first + shift:d + 1 + shift] = q
        rep[r, FREE_BLOCKS] += d + 1 - first
        rep[r, CACHED_FREE] += max(0, min(d + 1, keyed) - first)
        d = first - 1


@inline
def _key_full_blocks(pi, rep, r, seqs, segments, store, extents, claims, chain_table, s, end):
    """BlockAllocator.key_full_blocks: the blocks tokens up to `end` filled get their keys (a
    key another block holds already stays with that block). The keys of a first admission's
    output blocks are claimed when it releases them: until then no other sequence can look
    them up (every workload builder in sim.workload gives each request its own output
    content id, and its next turn arrives after it finishes), and none can claim them first
    (an admission after a preemption claims them as they fill). So the extent's claimed depth
    (X_CLAIMED) is s's keyed one, or the prompt's full blocks if fewer on a first admission,
    and an output block filled in decode is keyed without reading the extent's row."""
    first, last = seqs[s, KEYED], end // pi[P_BLOCK_SIZE]
    if last <= first:
        return
    seqs[s, KEYED] = last
    if not seqs[s, PREEMPTIONS]:
        prompt_blocks = seqs[s, PROMPT] // pi[P_BLOCK_SIZE]
        if first >= prompt_blocks:  # an output block: claimed when s frees it
            return
        last = min(last, prompt_blocks)
    _claim_blocks(pi, rep, r, seqs, segments, store, extents, claims, chain_table, s, last)


@jit
def _claim_blocks(pi, rep, r, seqs, segments, store, extents, claims, chain_table, s, last):
    """The keys of s's blocks from its extent's first unclaimed one up to depth last go in the
    table (their counts written first: _held_once)."""
    e = seqs[s, EXTENT]
    _held_once(store, extents, r, e, extents[r, e, X_CLAIMED], last)
    _key_range(pi, seqs, segments, extents, claims, chain_table, rep, r, e, s, extents[r, e, X_CLAIMED], last)
    extents[r, e, X_CLAIMED] = last


@inline
def _key_range(pi, seqs, segments, extents, claims, chain_table, rep, r, e, s, low, high):
    """The keys of extent e's blocks at depths [low, high) (sequence s's) go in the table, a
    chain at a time."""
    size = pi[P_BLOCK_SIZE]
    d, j = low, -1
    while d < high:
        chain, start, chain_end, j = _chain_span(pi, seqs, segments, s, d, j)
        stop = min(chain_end, high)
        _claim(pi, claims, extents, chain_table, rep, r, e, chain, (d + 1) * size - start, (stop + 1) * size - start, d)
        d = stop


@inline
def _fills_a_block(pi, seqs, s, end):
    """Whether s's tokens up to `end` fill a block past its keyed ones (end // block_size >
    keyed, as a product: the division cost a fifth of _schedule's time)."""
    return end >= (seqs[s, KEYED] + 1) * pi[P_BLOCK_SIZE]


@inline
def _fill_slack(rep, r, seqs, s, num_new):
    start = seqs[s, SLOTS_TOKENS]
    end = start + num_new
    consumed = max(0, min(end, seqs[s, FINAL_LEN]) - start)
    rep[r, TOTAL_RESERVED] -= consumed
    rep[r, TOTAL_INTERNAL] -= num_new - consumed
    seqs[s, SLOTS_TOKENS] = end


@inline
def _grows_past_store(rep, r, seqs, s, needed):
    """Whether s's extent has no room for needed more blocks (its room, up to depth
    seqs[s, ROOM], is its final length's blocks, so never: a check that keeps a mistake from
    writing over another extent)."""
    if seqs[s, BLOCKS] + needed <= seqs[s, ROOM]:
        return False
    rep[r, POOL_FAULT] = 1
    return True


@inline
def _take_or_count(pi, store, extents, entries, claims, chain_table, rep, r, needed):
    """needed free blocks are taken (BlockPool.take); without prefix caching they only leave
    the free count."""
    if pi[P_CACHING]:
        _take(pi, store, extents, entries, claims, chain_table, rep, r, needed)
    else:
        rep[r, FREE_BLOCKS] -= needed


@inline
def _holds(pi, rep, r, seqs, s, segments, store, extents, claims, chain_table, end):
    """s holds its blocks for tokens up to `end`: its slack counted, the blocks filled keyed."""
    _count_slack(rep, r, seqs, s, pi[P_BLOCK_SIZE], 1)
    if pi[P_CACHING]:
        _key_full_blocks(pi, rep, r, seqs, segments, store, extents, claims, chain_table, s, end)


@inline
def _blocks_required(pi, num_hit, num_new, full_tokens, watermark):
    """An admission's new blocks and the free blocks it requires (with the whole prompt's
    blocks when full_tokens, and the watermark's), after a hit of num_hit blocks."""
    size = pi[P_BLOCK_SIZE]
    needed = -(-(num_hit * size + num_new) // size) - num_hit
    required = needed
    if full_tokens or watermark != 0.0:
        required = max(needed, -(-full_tokens // size) - num_hit) + int(watermark * pi[P_NUM_BLOCKS])
    return needed, required


@inline
def _still_blocked(pi, rep, r, seqs, s, budget, full_tokens, watermark):
    """Whether waiting head s surely fails admission again, without a lookup: its last
    admission failed for memory after a hit of h blocks and no key of the chain of its block at
    depth h was claimed since (BLOCKED_CLAIMED unset), so that its hit h' <= h now (the blocks
    found are the longest run of its keys cached: a longer run needs block h's key, and only a
    claim on its chain caches it); the blocks required after a hit are non-increasing in it
    (for a fixed budget, chunked or not: a hit beyond the budget's blocks only shortens the
    prompt's tail), and a lookup's revived blocks only lower the free ones, so h's requirement
    above the free blocks means h' fails too. At rag_agents_100k 217,741 of 382,817 lookups
    (151,280 when any claim on the replica lifted it). (A claim on that chain while the head
    waits was never seen: a lookup comes only with budget left after every running sequence,
    so each running prompt is then whole and later claims are on output chains, each its
    request's own; a cold review's 400 fuzzed runs with each skip checked by a lookup found
    no hit grown. The flag keeps the skip safe should that change.)"""
    if s != rep[r, BLOCKED_HEAD] or rep[r, BLOCKED_CLAIMED]:
        return False
    hit = rep[r, BLOCKED_HIT]
    num_new = min(seqs[s, TOKENS] - hit * pi[P_BLOCK_SIZE], budget)
    return _blocks_required(pi, hit, num_new, full_tokens, watermark)[1] > rep[r, FREE_BLOCKS]


@jit
def _admit(pi, rep, r, seqs, s, num_new, full_tokens, watermark, num_hit, revived,
           segments, store, extents, entries, claims, chain_table, order, memo):
    """BlockAllocator.allocate on admission (BlockAllocator._admit: s holds no blocks) after a
    prefix hit of num_hit blocks (the last lookup's), revived of them free. False: no memory
    (or, with rep[r, POOL_FAULT] set, no room in the block store). Without prefix caching only
    counts are kept (block ids never matter)."""
    size, caching = pi[P_BLOCK_SIZE], pi[P_CACHING]
    end = num_hit * size + num_new
    needed, required = _blocks_required(pi, num_hit, num_new, full_tokens, watermark)
    if required > rep[r, FREE_BLOCKS] - revived:
        return False
    if caching:
        room = -(-seqs[s, FINAL_LEN] // size) + 1 - num_hit
        e = _new_extent(pi, store, extents, order, rep, r, s, num_hit, max(room, needed))
        if e < 0:
            rep[r, POOL_FAULT] = 1
            return False
        seqs[s, EXTENT], seqs[s, HIT_BLOCKS], seqs[s, ROOM] = e, num_hit, num_hit + max(room, needed)
        _touch(store, extents, entries, memo, rep, r)
    _take_or_count(pi, store, extents, entries, claims, chain_table, rep, r, needed)
    seqs[s, BLOCKS], seqs[s, SLOTS_TOKENS] = num_hit + needed, end
    seqs[s, KEYED] = num_hit
    _holds(pi, rep, r, seqs, s, segments, store, extents, claims, chain_table, end)
    return True


@inline
def _grow(pi, rep, r, seqs, s, num_new, segments, store, extents, entries, claims, chain_table):
    """BlockAllocator.allocate without forks (so without copy-on-write) for a sequence holding
    blocks: num_new more tokens, in its last block's slack or in blocks taken. False: no memory
    (or, with rep[r, POOL_FAULT] set, no room in the block store). Inlined where a running
    sequence grows: a call's dozen array arguments cost more than its work (benchmarks/README.md)."""
    size, caching = pi[P_BLOCK_SIZE], pi[P_CACHING]
    start = seqs[s, SLOTS_TOKENS]
    end = start + num_new
    if end <= seqs[s, BLOCKS] * size:  # the tokens land in the last block's slack
        _fill_slack(rep, r, seqs, s, num_new)
        if caching and _fills_a_block(pi, seqs, s, end):
            _key_full_blocks(pi, rep, r, seqs, segments, store, extents, claims, chain_table, s, end)
        return True
    needed = -(-end // size) - seqs[s, BLOCKS]
    if needed > rep[r, FREE_BLOCKS]:
        return False
    if caching and _grows_past_store(rep, r, seqs, s, needed):
        return False
    _count_slack(rep, r, seqs, s, size, -1)
    _take_or_count(pi, store, extents, entries, claims, chain_table, rep, r, needed)
    seqs[s, BLOCKS] += needed
    seqs[s, SLOTS_TOKENS] = end
    _holds(pi, rep, r, seqs, s, segments, store, extents, claims, chain_table, end)
    return True


@jit
def _free(pi, rep, r, seqs, s, segments, store, extents, entries, claims, chain_table, memo):
    """BlockAllocator.free: s's blocks released deepest first (its own, then the ones it found
    cached: the same runs a lookup finds, since a block held keeps its key)."""
    _count_slack(rep, r, seqs, s, pi[P_BLOCK_SIZE], -1)
    if pi[P_NO_EVICT]:
        rep[r, RESERVED_BLOCKS] -= _blocks_to_completion(pi, seqs, s)
    if pi[P_CACHING]:
        e = seqs[s, EXTENT]  # its row's depths and counts, from s's (see the pool's layout)
        extents[r, e, X_KEYED], extents[r, e, X_HIGH] = seqs[s, KEYED], seqs[s, BLOCKS]
        extents[r, e, X_LIVE] = seqs[s, BLOCKS] - seqs[s, HIT_BLOCKS]
        if extents[r, e, X_CLAIMED] < extents[r, e, X_KEYED]:
            _claim_blocks(pi, rep, r, seqs, segments, store, extents, claims, chain_table, s, extents[r, e, X_KEYED])
        _held_once(store, extents, r, e, extents[r, e, X_CLAIMED], extents[r, e, X_HIGH])
        _release(store, extents, entries, rep, r, e, seqs[s, HIT_BLOCKS], extents[r, e, X_HIGH])
        runs, _ = _walk(pi, seqs, segments, claims, chain_table, memo, rep, r, s, seqs[s, HIT_BLOCKS])
        for k in range(runs - 1, -1, -1):
            _release(store, extents, entries, rep, r, memo[r, k, 0], memo[r, k, 1], memo[r, k, 2])
        extents[r, e, X_HELD] = 0
        rep[r, HELD_ROOM] -= extents[r, e, X_CAPACITY]
        _drop_extent_if_done(extents, rep, r, e)
    else:
        rep[r, FREE_BLOCKS] += seqs[s, BLOCKS]
    seqs[s, BLOCKS], seqs[s, SLOTS_TOKENS] = 0, 0


@inline
def _blocks_to_completion(pi, seqs, s):
    """guaranteed_no_evict (Scheduler._blocks_to_completion): the blocks of s's whole length."""
    return -(-seqs[s, FINAL_LEN] // pi[P_BLOCK_SIZE])


@inline
def _waiting_at(rep, waiting, r, i):
    return waiting[r, (rep[r, WAIT_HEAD] + i) % waiting.shape[1]]


@inline
def _push_front(rep, waiting, r, s):
    head = (rep[r, WAIT_HEAD] - 1) % waiting.shape[1]
    waiting[r, head] = s
    rep[r, WAIT_HEAD] = head
    rep[r, NUM_WAITING] += 1


@inline
def _push_back(rep, waiting, r, s):
    waiting[r, (rep[r, WAIT_HEAD] + rep[r, NUM_WAITING]) % waiting.shape[1]] = s
    rep[r, NUM_WAITING] += 1


@inline
def _pop_front(rep, waiting, r):
    rep[r, WAIT_HEAD] = (rep[r, WAIT_HEAD] + 1) % waiting.shape[1]
    rep[r, NUM_WAITING] -= 1


@jit
def _schedule(pi, pf, rep, r, seqs, running, waiting, plan, pool):
    """Scheduler.schedule (FCFS, recompute preemption): the plan's (sequence, new tokens) rows in
    plan[r], its length and preemptions in rep."""
    segments, store, extents, entries, claims, chain_table, order, memo = pool
    budget = pi[P_BUDGET]
    num_planned = 0
    num_preempted = 0
    index = 0
    while index < rep[r, NUM_RUNNING] and budget > 0:
        s = running[r, index]
        num_new = min(seqs[s, TOKENS] - seqs[s, COMPUTED], budget)
        preempted_self = False
        # (_grow has one call site, where it is inlined: the loop allocates, then preempts the
        # newest running sequence and allocates again until it fits or s itself is preempted.)
        while not _grow(pi, rep, r, seqs, s, num_new, segments, store, extents, entries, claims, chain_table):
            last = rep[r, NUM_RUNNING] - 1  # Fcfs.victim: the newest running sequence
            victim = running[r, last]
            rep[r, NUM_RUNNING] = last
            _free(pi, rep, r, seqs, victim, segments, store, extents, entries, claims, chain_table,
                  memo)  # Scheduler._preempt, recompute
            seqs[victim, PREEMPTIONS] += 1
            seqs[victim, COMPUTED] = 0
            _push_front(rep, waiting, r, victim)
            num_preempted += 1
            if victim == s:
                preempted_self = True
                break
        if preempted_self:
            break
        plan[r, num_planned, 0], plan[r, num_planned, 1] = s, num_new
        num_planned += 1
        budget -= num_new
        index += 1
    if num_preempted == 0 or num_planned == 0:  # Scheduler._admit
        while rep[r, NUM_WAITING]:
            if rep[r, NUM_RUNNING] >= pi[P_MAX_SEQS] or budget <= 0:
                break
            s = _waiting_at(rep, waiting, r, 0)
            full_tokens = seqs[s, TOKENS] if pi[P_RESERVE_FULL] else 0
            watermark = pf[P_WATERMARK] if rep[r, NUM_RUNNING] else 0.0
            if _still_blocked(pi, rep, r, seqs, s, budget, full_tokens, watermark):
                break
            num_hit, revived = _lookup(pi, seqs, segments, claims, chain_table, memo, store, extents, rep, r, s)
            hit_tokens = num_hit * pi[P_BLOCK_SIZE]
            num_new = seqs[s, TOKENS] - hit_tokens
            if num_new > budget:
                if not pi[P_CHUNKED]:
                    break
                num_new = budget
            if pi[P_NO_EVICT] and rep[r, RESERVED_BLOCKS] + _blocks_to_completion(pi, seqs, s) > pi[P_NUM_BLOCKS]:
                break  # guaranteed_no_evict: until a sequence finishes
            if not _admit(pi, rep, r, seqs, s, num_new, full_tokens, watermark, num_hit, revived,
                          segments, store, extents, entries, claims, chain_table, order, memo):
                rep[r, BLOCKED_HEAD], rep[r, BLOCKED_HIT], rep[r, BLOCKED_CLAIMED] = s, num_hit, 0
                if pi[P_CACHING]:
                    rep[r, BLOCKED_CHAIN] = np.int64(_chain_span(pi, seqs, segments, s, num_hit, -1)[0])
                break
            rep[r, BLOCKED_HEAD] = -1
            if pi[P_NO_EVICT]:
                rep[r, RESERVED_BLOCKS] += _blocks_to_completion(pi, seqs, s)
            _pop_front(rep, waiting, r)
            seqs[s, COMPUTED] = hit_tokens
            if not seqs[s, ADMITTED]:
                seqs[s, ADMITTED] = 1
                seqs[s, PREFIX_HIT] = hit_tokens
            running[r, rep[r, NUM_RUNNING]] = s
            rep[r, NUM_RUNNING] += 1
            plan[r, num_planned, 0], plan[r, num_planned, 1] = s, num_new
            num_planned += 1
            budget -= num_new
    rep[r, PLAN_LEN], rep[r, PLAN_PREEMPTED] = num_planned, num_preempted


@jit
def _shape(rep, r, seqs, plan, shape):
    """sim.scheduler.scheduler._shape of the plan, into shape (see step_time)."""
    shape[:] = 0
    for i in range(rep[r, PLAN_LEN]):
        s, num_new = plan[r, i, 0], plan[r, i, 1]
        context = seqs[s, COMPUTED]
        if context + num_new == seqs[s, TOKENS]:
            shape[7] += 1
            if num_new == 1 and seqs[s, OUTPUTS]:
                shape[5] += 1
                shape[6] += context + 1
                continue
        shape[0] += num_new
        shape[1] += 1
        shape[4] += context + num_new
        shape[2] += num_new * context
        shape[3] += num_new * (num_new + 1) // 2


@jit
def _commit(pi, rep, r, seqs, seq_times, running, plan, now, gaps, gap_counts, finished, pool):
    """Scheduler.commit of the plan in flight at `now`: the sequences that finished in
    finished[:n], the distinct inter-token gaps in gaps[:k] (first-seen order) with their
    counts; returns (n, k, tokens sampled)."""
    segments, store, extents, entries, claims, chain_table, order, memo = pool
    num_finished = num_gaps = num_sampled = 0
    for i in range(rep[r, PLAN_LEN]):
        s, num_new = plan[r, i, 0], plan[r, i, 1]
        seqs[s, COMPUTED] += num_new
        if seqs[s, COMPUTED] < seqs[s, TOKENS]:
            continue
        seqs[s, TOKENS] += 1
        seqs[s, OUTPUTS] += 1
        num_sampled += 1
        if seqs[s, OUTPUTS] > 1:
            gap = now - seq_times[s, LAST_TOKEN]
            j = 0
            while j < num_gaps and gaps[j] != gap:
                j += 1
            if j == num_gaps:
                gaps[j], gap_counts[j] = gap, 0
                num_gaps += 1
            gap_counts[j] += 1
        seq_times[s, LAST_TOKEN] = now
        if seqs[s, OUTPUTS] == 1:
            seq_times[s, FIRST_TOKEN] = now
        if seqs[s, OUTPUTS] >= seqs[s, OUTPUT_LEN] or seqs[s, TOKENS] >= pi[P_MAX_MODEL_LEN]:
            seq_times[s, FINISH] = now
            _free(pi, rep, r, seqs, s, segments, store, extents, entries, claims, chain_table, memo)
            finished[num_finished] = s
            num_finished += 1
    if num_finished:  # the running list without them, in order
        kept = 0
        for i in range(rep[r, NUM_RUNNING]):
            s = running[r, i]
            if seq_times[s, FINISH] != seq_times[s, FINISH]:  # NaN: not finished
                running[r, kept] = s
                kept += 1
        rep[r, NUM_RUNNING] = kept
    return num_finished, num_gaps, num_sampled


@jit
def _load(pi, rep, r, seqs, running, waiting):
    """sim.router.view.ReplicaView.load for the router's metric."""
    kind = pi[P_ROUTER]
    if kind == ROUTE_REQUESTS:
        return float(rep[r, NUM_RUNNING] + rep[r, NUM_WAITING])
    if kind == ROUTE_WAITING:
        return float(rep[r, NUM_WAITING])
    total = 0
    for i in range(rep[r, NUM_WAITING]):
        s = _waiting_at(rep, waiting, r, i)
        total += seqs[s, TOKENS] - seqs[s, COMPUTED]
    for i in range(rep[r, NUM_RUNNING]):
        s = running[r, i]
        total += seqs[s, TOKENS] - seqs[s, COMPUTED]
    return float(total)


@jit
def _route(pi, rep, seqs, running, waiting):
    """The router's choice (sim.router: least loaded, ties to the lowest index; or round robin)."""
    num = pi[P_REPLICAS]
    if pi[P_ROUTER] == ROUTE_ROUND_ROBIN:
        choice = pi[P_NEXT_ROUND_ROBIN] % num
        pi[P_NEXT_ROUND_ROBIN] += 1
        return choice
    best, best_load = 0, _load(pi, rep, 0, seqs, running, waiting)
    for r in range(1, num):
        load = _load(pi, rep, r, seqs, running, waiting)
        if load < best_load:
            best, best_load = r, load
    return best


@jit
def _plan(pi, pf, rep, r, seqs, running, waiting, plan, shape, rep_times, now, tables, pool):
    """The replica's next step from `now`, or idle; False: it cannot schedule its queue."""
    (tokens_table, graph_table, lm_table, lm_graph, cpu_table, output_table, capture,
     prefill_par, prefill_grid, prefill_factors, decode_par, decode_grid, decode_factors) = tables
    empty_plans = 0
    while rep[r, NUM_RUNNING] or rep[r, NUM_WAITING]:
        _schedule(pi, pf, rep, r, seqs, running, waiting, plan, pool)
        if rep[r, PLAN_LEN] == 0:  # only after a step that preempted every running sequence
            empty_plans += 1
            if empty_plans > 1:
                return False
            continue
        _shape(rep, r, seqs, plan, shape)
        rep[r, PLAN_TOKENS] = shape[0] + shape[5]
        rep_times[r, STEP_END] = now + step_time(
            pi, pf, shape, tokens_table, graph_table, lm_table, lm_graph, cpu_table, output_table, capture,
            prefill_par, prefill_grid, prefill_factors, decode_par, decode_grid, decode_factors)
        rep[r, STEPPING] = 1
        return True
    rep[r, STEPPING] = 0
    return True


@jit
def _later_push(pi, later_times, later_rows, later_order, when, s):
    """A later turn reaching the engine at `when` (a heap by time, then by creation)."""
    i = pi[P_NUM_LATER]
    pi[P_NUM_LATER] = i + 1
    order = pi[P_LATER_COUNT]
    pi[P_LATER_COUNT] = order + 1
    while i > 0:
        parent = (i - 1) // 2
        if later_times[parent] < when or (later_times[parent] == when and later_order[parent] < order):
            break
        later_times[i], later_rows[i], later_order[i] = later_times[parent], later_rows[parent], later_order[parent]
        i = parent
    later_times[i], later_rows[i], later_order[i] = when, s, order


@jit
def _later_pop(pi, later_times, later_rows, later_order):
    n = pi[P_NUM_LATER] - 1
    pi[P_NUM_LATER] = n
    when, s, order = later_times[n], later_rows[n], later_order[n]
    i = 0
    while True:
        child = 2 * i + 1
        if child >= n:
            break
        if child + 1 < n and (later_times[child + 1] < later_times[child] or (
                later_times[child + 1] == later_times[child] and later_order[child + 1] < later_order[child])):
            child += 1
        if when < later_times[child] or (when == later_times[child] and order < later_order[child]):
            break
        later_times[i], later_rows[i], later_order[i] = later_times[child], later_rows[child], later_order[child]
        i = child
    later_times[i], later_rows[i], later_order[i] = when, s, order


@jit
def _next_turn(pi, pf, seqs, seq_times, s, now, later_times, later_rows, later_order):
    """Cluster._next_turn: the session's next turn is sent its think time after `now` and
    reaches the engine serving_overhead_s later."""
    nxt = seqs[s, NEXT_TURN]
    if nxt < 0:
        return
    sent = now + seq_times[nxt, THINK_S]
    seq_times[nxt, ARRIVAL] = sent
    seq_times[nxt, SUBMIT] = sent + pf[P_OVERHEAD_S] if pf[P_OVERHEAD_S] != 0.0 else sent
    _later_push(pi, later_times, later_rows, later_order, seq_times[nxt, SUBMIT], nxt)


@entry
def run(pi, pf, seqs, seq_times, rep, rep_times, running, waiting, plan, tables, pool, starts, start_end,
        later_times, later_rows, later_order, timeline_times, timeline_ints, itl_floats, itl_ints,
        out_counts, stuck):
    """Advance the cluster until the sessions starting below start_end (starts: their first
    turns in arrival order) have reached the engine and no step ends before the next one does
    (start_end = len(starts): to the end), or until the output rows run short. Later turns are
    queued as their previous turns finish. out_counts receives the rows written (timeline,
    gaps), the requests done (finished or rejected) and the events handled (step ends, wake-ups,
    requests reaching the engine); stuck[0] the replica that could not schedule. Returns what it
    stopped at."""
    num_replicas = pi[P_REPLICAS]
    size = pi[P_BLOCK_SIZE]
    capacity = pi[P_NUM_BLOCKS] * size
    shape = np.zeros(8, dtype=np.int64)
    max_seqs = pi[P_MAX_SEQS]
    gaps = np.empty(max_seqs, dtype=np.float64)
    gap_counts = np.empty(max_seqs, dtype=np.int64)
    finished = np.empty(max_seqs, dtype=np.int64)
    rows = gap_rows = num_done = events = 0
    while True:
        # The next request to reach the engine: a session's first turn or a later turn.
        k = pi[P_NEXT_START]
        start_s = seq_times[starts[k], SUBMIT] if k < len(starts) else np.inf
        later_s = later_times[0] if pi[P_NUM_LATER] else np.inf
        submit_s = min(start_s, later_s)
        # The earliest replica event: a step's end (<= the submit), a wake-up (< the submit).
        who, when, is_end = -1, np.inf, False
        for r in range(num_replicas):
            if rep[r, STEPPING]:
                t = rep_times[r, STEP_END]
                if t <= submit_s and t < when:
                    who, when, is_end = r, t, True
            elif rep[r, WOKEN]:
                t = rep_times[r, WAKE]
                if t < submit_s and t < when:
                    who, when, is_end = r, t, False
        if who < 0:
            if submit_s == np.inf or (start_s <= later_s and k >= start_end):
                out_counts[0], out_counts[1], out_counts[2], out_counts[3] = rows, gap_rows, num_done, events
                return DONE if submit_s == np.inf else SUBMITS_DONE
            if start_s <= later_s:
                s = starts[k]
                pi[P_NEXT_START] = k + 1
            else:
                s = later_rows[0]
                _later_pop(pi, later_times, later_rows, later_order)
            events += 1
            if seqs[s, PROMPT] > pi[P_MAX_MODEL_LEN]:  # rejected when sent (Cluster._submit)
                seqs[s, STATUS] = REJECTED
                num_done += 1
                _next_turn(pi, pf, seqs, seq_times, s, seq_times[s, ARRIVAL], later_times, later_rows, later_order)
                continue
            # It reaches the engine: route it, queue it, wake its replica if idle.
            r = _route(pi, rep, seqs, running, waiting)
            seqs[s, REPLICA] = r
            _push_back(rep, waiting, r, s)
            if not rep[r, STEPPING] and not rep[r, WOKEN]:
                rep[r, WOKEN] = 1
                rep_times[r, WAKE] = submit_s
            continue
        r = who
        if is_end:
            if rows + 1 > timeline_times.shape[0] or gap_rows + max_seqs > itl_floats.shape[0]:
                out_counts[0], out_counts[1], out_counts[2], out_counts[3] = rows, gap_rows, num_done, events
                return OUT_OF_ROWS
            num_finished, num_gaps, num_sampled = _commit(pi, rep, r, seqs, seq_times, running, plan, when,
                                                          gaps, gap_counts, finished, pool)
            num_done += num_finished
            for i in range(num_finished):
                seqs[finished[i], STATUS] = FINISHED
                _next_turn(pi, pf, seqs, seq_times, finished[i], when, later_times, later_rows, later_order)
            # The step record (sim.engine.records.StepRecord; BlockAllocator.usage).
            reserved, internal = rep[r, TOTAL_RESERVED], rep[r, TOTAL_INTERNAL]
            free, cached_idle = rep[r, FREE_BLOCKS], rep[r, CACHED_FREE] * size
            timeline_times[rows] = when
            out = timeline_ints
            out[rows, 0], out[rows, 1] = r, capacity
            out[rows, 2] = (pi[P_NUM_BLOCKS] - free) * size - reserved - internal
            out[rows, 3], out[rows, 4], out[rows, 5], out[rows, 6] = reserved, internal, 0, cached_idle
            out[rows, 7], out[rows, 8], out[rows, 9] = free * size - cached_idle, rep[r, PLAN_LEN], rep[r, PLAN_TOKENS]
            out[rows, 10], out[rows, 11], out[rows, 12] = rep[r, NUM_RUNNING], rep[r, NUM_WAITING], rep[r, PLAN_PREEMPTED]
            out[rows, 13], out[rows, 14] = 0, num_sampled
            rows += 1
            for j in range(num_gaps):
                itl_floats[gap_rows, 0], itl_floats[gap_rows, 1] = when, gaps[j]
                itl_ints[gap_rows, 0], itl_ints[gap_rows, 1] = r, gap_counts[j]
                gap_rows += 1
        else:
            rep[r, WOKEN] = 0
        events += 1
        planned = _plan(pi, pf, rep, r, seqs, running, waiting, plan, shape, rep_times, when, tables, pool)
        if not planned or rep[r, POOL_FAULT]:
            stuck[0] = r
            out_counts[0], out_counts[1], out_counts[2], out_counts[3] = rows, gap_rows, num_done, events
            return STORE_FULL if rep[r, POOL_FAULT] else STUCK
