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
block pool's (without prefix caching only counts are kept: block ids never matter then).

Every jitted function and the constants they read live in this one module: numba's cache checks
only the source file of the function it caches, so code split across modules could run stale.
"""
from __future__ import annotations

import math

import numba
import numpy as np

# Sequence columns (int64).
PROMPT, OUTPUT_LEN, FINAL_LEN, TOKENS, COMPUTED, OUTPUTS, PREEMPTIONS, REPLICA, ADMITTED, \
    SLOTS_TOKENS, BLOCKS, HAS_BLOCKS, NEXT_TURN, STATUS, PREFIX_HIT, SLOT, KEYED, SEGMENTS, \
    NUM_SEGMENTS, PROMPT_PREFIX, OUTPUT_CONTENT = range(21)
SEQ_INTS = 21
PENDING, FINISHED, REJECTED = range(3)  # STATUS
# Sequence columns (float64): ARRIVAL when the client sends it, SUBMIT when it reaches the engine
# (serving_overhead_s later), THINK_S the think time before it once its previous turn is done.
ARRIVAL, SUBMIT, FIRST_TOKEN, LAST_TOKEN, FINISH, THINK_S = range(6)
SEQ_FLOATS = 6
# Replica columns (int64).
NUM_RUNNING, WAIT_HEAD, NUM_WAITING, FREE_BLOCKS, TOTAL_RESERVED, TOTAL_INTERNAL, STEPPING, \
    PLAN_LEN, PLAN_PREEMPTED, PLAN_TOKENS, WOKEN, QUEUE_HEAD, QUEUE_LEN, CACHED_FREE, EVER_KEYED, \
    FREE_SLOTS, MEMO_SEQ, MEMO_COUNT, MEMO_REVIVED, MEMO_EPOCH = range(20)
REPLICA_INTS = 20
# Replica columns (float64).
STEP_END, WAKE = range(2)
# Parameters (int64).
(P_REPLICAS, P_BLOCK_SIZE, P_NUM_BLOCKS, P_MAX_SEQS, P_BUDGET, P_CHUNKED, P_MAX_MODEL_LEN,
 P_RESERVE_FULL, P_PP, P_ROUTER, P_LAYERS, P_ASYNC_OUTPUT, P_EXPERT_PARALLEL, P_NEXT_ROUND_ROBIN,
 P_NEXT_START, P_NUM_LATER, P_LATER_COUNT, P_CACHING) = range(18)
PARAM_INTS = 18
# The block pool with prefix caching (pool = core.run's tuple), per replica: each block's state
# in one row of 32 bytes (reference count, whether it holds a key, the stale entries revivals
# left in the free queue, the epoch of the last lookup that found it, the table slot where its
# key finds it, -1 when the key finds another block or none); the free queue (a ring of block ids, LRU order); each running
# sequence's block table (by slot) and the free slots; the cached blocks by key (BlockPool.cached,
# an open-addressing table with linear probing and deletion by backward shift, of rows (prefix id
# << 32 | content id, offset << 32 | block), EMPTY where none); the requests'
# prompt segments as rows (start, length, content id, prefix id before it); the last lookup's
# hit blocks. That lookup (of the head of the queue, asked again each step while it waits) is
# kept while none of its blocks is evicted; how many are free is kept as their counts change.
POOL_BLOCKS, POOL_QUEUE, POOL_TABLES, POOL_SLOTS, POOL_CACHED, POOL_SEGMENTS, POOL_MEMO = range(7)
B_REF, B_HAS_KEY, B_STALE, B_WATCH, B_SLOT = range(5)
BLOCK_FIELDS = 8
EMPTY = np.uint64(0xFFFFFFFFFFFFFFFF)
LOW_32 = np.uint64(0xFFFFFFFF)
# Parameters (float64).
P_WATERMARK, P_GRAPH_LAUNCH_S, P_EAGER_LAUNCH_S, P_OVERHEAD_S = range(4)
PARAM_FLOATS = 4
# Routers.
ROUTE_REQUESTS, ROUTE_WAITING, ROUTE_QUEUED_TOKENS, ROUTE_ROUND_ROBIN = range(4)
# Token-count table columns: QKV and O projections, MLP, all-reduce, all-to-all, send/recv.
T_QKV, T_MLP, T_ALLREDUCE, T_ALL_TO_ALL, T_SEND_RECV = range(5)
# Attention operator parameters: peak, bandwidth, e_c, e_m, t0, per sequence, causal e, heads per
# rank, query-key width, value width, KV bytes per token per layer per rank, has a table.
A_PEAK, A_BW, A_EC, A_EM, A_T0, A_PER_SEQ, A_CAUSAL_EC, A_HEADS, A_QK, A_V, A_KV_BYTES, A_TABLE = range(12)
ACTIVATION_BYTES, CAUSAL_TILE = 2, 128  # sim.latency.operators
# Timeline int columns (sim.recorder.INT_COLUMNS).
TIMELINE_INTS = 15
# What run() stopped at.
DONE, OUT_OF_ROWS, SUBMITS_DONE, STUCK = range(4)

jit = numba.njit(cache=True, nogil=True)


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
    """CalibratedOp.corrected on Roofline.time and datasheet_time."""
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
        lm_head = lm_graph[graph]
    else:
        count = prefill_tokens + decode_seqs
        qkv, mlp = tokens_table[row, count, T_QKV], tokens_table[row, count, T_MLP]
        allreduce, all_to_all = tokens_table[row, count, T_ALLREDUCE], tokens_table[row, count, T_ALL_TO_ALL]
        send_recv = tokens_table[row, count, T_SEND_RECV]
        lm_head = lm_table[row, sampled]
    attention_prefill = 0.0
    if m_prefill_tokens != 0.0:
        attention_prefill = layers * _prefill_attention(prefill_par, prefill_grid, prefill_factors, m_prefill_seqs,
                                                        m_pairs, m_causal, m_kv, m_prefill_tokens)
    attention_decode = 0.0
    if m_decode_seqs != 0.0:
        attention_decode = layers * _decode_attention(decode_par, decode_grid, decode_factors, m_decode_seqs,
                                                      m_decode_context)
    gpu = qkv + mlp + p * lm_head + attention_prefill + attention_decode + allreduce
    if pi[P_EXPERT_PARALLEL]:
        gpu += all_to_all
    if pp > 1:
        gpu += (pp - 1) * send_recv
        if prefill_tokens:  # the chunk crosses every stage whole (LatencyModel.breakdown)
            chunk = tokens_table[0, prefill_tokens]
            latency = chunk[T_QKV] + chunk[T_MLP] + 1.0 * lm_table[0, min(sampled, prefill_seqs)] \
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
    if pi[P_ASYNC_OUTPUT]:
        output = max(0.0, output - gpu)
    return gpu + launch + cpu + output


@jit
def _slack(slots, tokens, final_len):
    """sim.kvcache.base.slack_split: (reserved, internal fragmentation)."""
    reserved = max(0, min(slots, final_len) - tokens)
    return reserved, slots - tokens - reserved


@jit
def _count_slack(rep, r, seqs, s, size, sign):
    reserved, internal = _slack(seqs[s, BLOCKS] * size, seqs[s, SLOTS_TOKENS], seqs[s, FINAL_LEN])
    rep[r, TOTAL_RESERVED] += sign * reserved
    rep[r, TOTAL_INTERNAL] += sign * internal


@jit
def _block_key(pi, seqs, segments, s, i, j):
    """Request.prefix_key((i + 1) * block_size) as (prefix id << 32 | content id, offset), and
    the segment cursor: the segment holding the block's last token (the last of equal starts;
    j < 0: found by search, else moved on from j as blocks go left to right), or the output
    after the prompt."""
    end = (i + 1) * pi[P_BLOCK_SIZE]
    prompt = seqs[s, PROMPT]
    if end > prompt:
        return _chain(seqs[s, PROMPT_PREFIX], seqs[s, OUTPUT_CONTENT]), end - prompt, j
    if j < 0:
        j = _first_segment(seqs, segments, s, end)
    last_segment = seqs[s, SEGMENTS] + seqs[s, NUM_SEGMENTS] - 1
    while j < last_segment and segments[j + 1, 0] <= end - 1:
        j += 1
    return _chain(segments[j, 3], segments[j, 2]), end - segments[j, 0], j


@jit
def _home(table, chain, offset):
    """Where a key (chain = prefix id << 32 | content id, offset) starts its probe in a
    replica's table (a power of two): MurmurHash3's 64-bit finalizer of the two combined."""
    h = chain * np.uint64(0x9E3779B97F4A7C15) + offset
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xFF51AFD7ED558CCD)
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xC4CEB9FE1A85EC53)
    h ^= h >> np.uint64(33)
    return np.int64(h & np.uint64(table.shape[1] - 1))


@jit
def _chain(prefix, content):
    return (np.uint64(prefix) << np.uint64(32)) | np.uint64(content)


@jit
def _cached_block(table, r, chain, offset):
    """BlockPool.cached.get(key): the block a lookup finds for the key, or -1."""
    mask = table.shape[1] - 1
    offset = np.uint64(offset)
    i = _home(table, chain, offset)
    while True:  # (elements, not row views: a view costs two atomic reference counts)
        here = table[r, i, 1]
        if here == EMPTY:
            return -1
        if here >> np.uint64(32) == offset and table[r, i, 0] == chain:
            return np.int64(here & LOW_32)
        i = (i + 1) & mask


@jit
def _cache_block(table, r, chain, offset, block):
    """cached.setdefault(key, block): the slot where the key now finds this block, or -1 when
    it keeps another."""
    mask = table.shape[1] - 1
    offset = np.uint64(offset)
    i = _home(table, chain, offset)
    while True:
        here = table[r, i, 1]
        if here == EMPTY:
            table[r, i, 0], table[r, i, 1] = chain, (offset << np.uint64(32)) | np.uint64(block)
            return i
        if here >> np.uint64(32) == offset and table[r, i, 0] == chain:
            return -1
        i = (i + 1) & mask


@jit
def _uncache_slot(table, state, r, slot):
    """del cached[key] of the block the key at `slot` finds (BlockPool.take's eviction): later
    rows of its probe run move back into the gap (their blocks' slots follow)."""
    mask = table.shape[1] - 1
    gap, j = slot, slot
    while True:
        j = (j + 1) & mask
        chain, here = table[r, j, 0], table[r, j, 1]
        if here == EMPTY:
            break
        home = _home(table, chain, here >> np.uint64(32))
        # The row may fill the gap unless its home lies cyclically in (gap, j].
        if (gap <= j and (home <= gap or home > j)) or (gap > j and home <= gap and home > j):
            table[r, gap, 0], table[r, gap, 1] = chain, here
            state[r, np.int64(here & LOW_32), B_SLOT] = gap
            gap = j
    table[r, gap, 1] = EMPTY


@jit
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


@jit
def _forget_lookup(rep, r):
    rep[r, MEMO_SEQ] = -1
    rep[r, MEMO_EPOCH] += 1


@jit
def _lookup(pi, seqs, pool, rep, r, s):
    """BlockAllocator.lookup_prefix: cached full blocks at the start of s, never its last token
    (a pure query): their ids in pool[POOL_MEMO][r, :count], their count and how many are free returned.
    Asked again for the same sequence, it goes on from the blocks found before if none of them
    was evicted since (keys are only added then, and a key keeps its block)."""
    if not pi[P_CACHING]:
        return 0, 0
    memo, state, table = pool[POOL_MEMO], pool[POOL_BLOCKS], pool[POOL_CACHED]
    segments = pool[POOL_SEGMENTS]
    count = (seqs[s, TOKENS] - 1) // pi[P_BLOCK_SIZE]
    if rep[r, MEMO_SEQ] != s:
        _forget_lookup(rep, r)
        rep[r, MEMO_SEQ], rep[r, MEMO_COUNT], rep[r, MEMO_REVIVED] = s, 0, 0
    epoch, found, revived = rep[r, MEMO_EPOCH], rep[r, MEMO_COUNT], rep[r, MEMO_REVIVED]
    j = -1
    while found < count:
        chain, offset, j = _block_key(pi, seqs, segments, s, found, j)
        block = _cached_block(table, r, chain, offset)
        if block < 0:
            break
        memo[r, found] = block
        state[r, block, B_WATCH] = epoch
        revived += state[r, block, B_REF] == 0
        found += 1
    rep[r, MEMO_COUNT], rep[r, MEMO_REVIVED] = found, revived
    return found, revived


@jit
def _take(pi, rep, r, pool, count, slot, at):
    """BlockPool.take in LRU's free order: count blocks into the block table of slot (from
    position at), their keys dropped."""
    blocks = pool[POOL_TABLES]
    state, queue, table = pool[POOL_BLOCKS], pool[POOL_QUEUE], pool[POOL_CACHED]
    length = queue.shape[1]
    rep[r, FREE_BLOCKS] -= count
    evicted = taken = 0
    while taken < count:
        block = queue[r, rep[r, QUEUE_HEAD]]
        rep[r, QUEUE_HEAD] = (rep[r, QUEUE_HEAD] + 1) % length
        rep[r, QUEUE_LEN] -= 1
        if state[r, block, B_STALE]:  # an entry a revival left behind
            state[r, block, B_STALE] -= 1
            continue
        if state[r, block, B_WATCH] == rep[r, MEMO_EPOCH]:  # a block the last lookup found
            _forget_lookup(rep, r)
        if rep[r, EVER_KEYED] and state[r, block, B_HAS_KEY]:
            evicted += 1
            if state[r, block, B_SLOT] >= 0:
                _uncache_slot(table, state, r, state[r, block, B_SLOT])
                state[r, block, B_SLOT] = -1
            state[r, block, B_HAS_KEY] = 0
        state[r, block, B_REF] = 1
        blocks[r, slot, at + taken] = block
        taken += 1
    rep[r, CACHED_FREE] -= evicted


@jit
def _release(pi, rep, r, pool, slot, num_blocks):
    """BlockPool.release of the first num_blocks of slot's block table, deepest first: a block
    whose count reaches 0 joins the free queue (compacted first when it would overflow; its
    order kept)."""
    blocks = pool[POOL_TABLES]
    state, queue = pool[POOL_BLOCKS], pool[POOL_QUEUE]
    length = queue.shape[1]
    if rep[r, QUEUE_LEN] + num_blocks > length:
        kept, head = 0, rep[r, QUEUE_HEAD]
        for i in range(rep[r, QUEUE_LEN]):
            block = queue[r, (head + i) % length]
            if state[r, block, B_STALE]:
                state[r, block, B_STALE] -= 1
            else:
                queue[r, (head + kept) % length] = block
                kept += 1
        rep[r, QUEUE_LEN] = kept
    for i in range(num_blocks - 1, -1, -1):
        block = blocks[r, slot, i]
        state[r, block, B_REF] -= 1
        if state[r, block, B_REF] == 0:
            if state[r, block, B_WATCH] == rep[r, MEMO_EPOCH]:
                rep[r, MEMO_REVIVED] += 1
            queue[r, (rep[r, QUEUE_HEAD] + rep[r, QUEUE_LEN]) % length] = block
            rep[r, QUEUE_LEN] += 1
            rep[r, FREE_BLOCKS] += 1
            if rep[r, EVER_KEYED] and state[r, block, B_HAS_KEY]:
                rep[r, CACHED_FREE] += 1


@jit
def _touch(rep, r, pool, num_hit):
    """BlockPool.touch: one more reference to each hit block, out of the free queue if free."""
    state = pool[POOL_BLOCKS]
    for i in range(num_hit):
        block = pool[POOL_MEMO][r, i]
        if state[r, block, B_REF] == 0:
            rep[r, FREE_BLOCKS] -= 1
            if state[r, block, B_HAS_KEY]:
                rep[r, CACHED_FREE] -= 1
            state[r, block, B_STALE] += 1
            if state[r, block, B_WATCH] == rep[r, MEMO_EPOCH]:
                rep[r, MEMO_REVIVED] -= 1
        state[r, block, B_REF] += 1


@jit
def _key_full_blocks(pi, rep, r, seqs, pool, s, end):
    """BlockAllocator.key_full_blocks: the blocks tokens up to `end` filled get their keys (a
    block keyed already keeps its key; the first block with a key is the one lookups find)."""
    first, last = seqs[s, KEYED], end // pi[P_BLOCK_SIZE]
    if last <= first:
        return
    state, table, segments = pool[POOL_BLOCKS], pool[POOL_CACHED], pool[POOL_SEGMENTS]
    blocks, slot = pool[POOL_TABLES], seqs[s, SLOT]
    rep[r, EVER_KEYED] = 1
    j = -1
    for i in range(first, last):
        block = blocks[r, slot, i]
        if not state[r, block, B_HAS_KEY]:
            chain, offset, j = _block_key(pi, seqs, segments, s, i, j)
            state[r, block, B_HAS_KEY] = 1
            state[r, block, B_SLOT] = _cache_block(table, r, chain, offset, block)
    seqs[s, KEYED] = last


@jit
def _fills_slack(pi, seqs, s, num_new):
    """Whether num_new more tokens of a sequence holding blocks land in its last block's slack
    and fill no block to key: BlockAllocator.allocate's fast path, which needs no pool."""
    size = pi[P_BLOCK_SIZE]
    end = seqs[s, SLOTS_TOKENS] + num_new
    return (seqs[s, HAS_BLOCKS] and end <= seqs[s, BLOCKS] * size
            and not (pi[P_CACHING] and end // size > seqs[s, KEYED]))


@jit
def _fill_slack(rep, r, seqs, s, num_new):
    start = seqs[s, SLOTS_TOKENS]
    end = start + num_new
    consumed = max(0, min(end, seqs[s, FINAL_LEN]) - start)
    rep[r, TOTAL_RESERVED] -= consumed
    rep[r, TOTAL_INTERNAL] -= num_new - consumed
    seqs[s, SLOTS_TOKENS] = end


@jit
def _allocate(pi, pf, rep, r, seqs, s, num_new, full_tokens, watermark, pool, num_hit, revived):
    """BlockAllocator.allocate without forks (so without copy-on-write); on admission (s holds
    no blocks) after a prefix hit of num_hit blocks (the last lookup's), revived of them free.
    False: no memory. Without prefix caching only counts are kept (block ids never matter)."""
    size, caching = pi[P_BLOCK_SIZE], pi[P_CACHING]
    if not seqs[s, HAS_BLOCKS]:  # admission (BlockAllocator._admit)
        end = num_hit * size + num_new
        needed = -(-end // size) - num_hit
        required = needed
        if full_tokens or watermark != 0.0:
            required = max(needed, -(-full_tokens // size) - num_hit) + int(watermark * pi[P_NUM_BLOCKS])
        if required > rep[r, FREE_BLOCKS] - revived:
            return False
        if caching:
            slots = pool[POOL_SLOTS]
            rep[r, FREE_SLOTS] -= 1
            slot = slots[r, rep[r, FREE_SLOTS]]
            seqs[s, SLOT] = slot
            _touch(rep, r, pool, num_hit)
            blocks, memo = pool[POOL_TABLES], pool[POOL_MEMO]
            for i in range(num_hit):
                blocks[r, slot, i] = memo[r, i]
            _forget_lookup(rep, r)  # s leaves the queue
            _take(pi, rep, r, pool, needed, slot, num_hit)
        else:
            rep[r, FREE_BLOCKS] -= needed
        seqs[s, HAS_BLOCKS], seqs[s, BLOCKS], seqs[s, SLOTS_TOKENS] = 1, num_hit + needed, end
        seqs[s, KEYED] = num_hit
        _count_slack(rep, r, seqs, s, size, 1)
        if caching:
            _key_full_blocks(pi, rep, r, seqs, pool, s, end)
        return True
    start = seqs[s, SLOTS_TOKENS]
    end = start + num_new
    if end <= seqs[s, BLOCKS] * size:  # the tokens land in the last block's slack
        _fill_slack(rep, r, seqs, s, num_new)
        if caching and end // size > seqs[s, KEYED]:
            _key_full_blocks(pi, rep, r, seqs, pool, s, end)
        return True
    needed = -(-end // size) - seqs[s, BLOCKS]
    if needed > rep[r, FREE_BLOCKS]:
        return False
    _count_slack(rep, r, seqs, s, size, -1)
    if caching:
        _take(pi, rep, r, pool, needed, seqs[s, SLOT], seqs[s, BLOCKS])
    else:
        rep[r, FREE_BLOCKS] -= needed
    seqs[s, BLOCKS] += needed
    seqs[s, SLOTS_TOKENS] = end
    _count_slack(rep, r, seqs, s, size, 1)
    if caching:
        _key_full_blocks(pi, rep, r, seqs, pool, s, end)
    return True


@jit
def _free(pi, rep, r, seqs, s, pool):
    _count_slack(rep, r, seqs, s, pi[P_BLOCK_SIZE], -1)
    if pi[P_CACHING]:
        _release(pi, rep, r, pool, seqs[s, SLOT], seqs[s, BLOCKS])
        pool[POOL_SLOTS][r, rep[r, FREE_SLOTS]] = seqs[s, SLOT]
        rep[r, FREE_SLOTS] += 1
    else:
        rep[r, FREE_BLOCKS] += seqs[s, BLOCKS]
    seqs[s, HAS_BLOCKS], seqs[s, BLOCKS], seqs[s, SLOTS_TOKENS] = 0, 0, 0


@jit
def _waiting_at(rep, waiting, r, i):
    return waiting[r, (rep[r, WAIT_HEAD] + i) % waiting.shape[1]]


@jit
def _push_front(rep, waiting, r, s):
    head = (rep[r, WAIT_HEAD] - 1) % waiting.shape[1]
    waiting[r, head] = s
    rep[r, WAIT_HEAD] = head
    rep[r, NUM_WAITING] += 1


@jit
def _push_back(rep, waiting, r, s):
    waiting[r, (rep[r, WAIT_HEAD] + rep[r, NUM_WAITING]) % waiting.shape[1]] = s
    rep[r, NUM_WAITING] += 1


@jit
def _pop_front(rep, waiting, r):
    rep[r, WAIT_HEAD] = (rep[r, WAIT_HEAD] + 1) % waiting.shape[1]
    rep[r, NUM_WAITING] -= 1


@jit
def _schedule(pi, pf, rep, r, seqs, running, waiting, plan, pool):
    """Scheduler.schedule (FCFS, recompute preemption): the plan's (sequence, new tokens) rows in
    plan[r], its length and preemptions in rep."""
    budget = pi[P_BUDGET]
    num_planned = 0
    num_preempted = 0
    index = 0
    while index < rep[r, NUM_RUNNING] and budget > 0:
        s = running[r, index]
        num_new = min(seqs[s, TOKENS] - seqs[s, COMPUTED], budget)
        preempted_self = False
        # (the fast path without passing the pool: a tuple argument costs reference counts)
        if _fills_slack(pi, seqs, s, num_new):
            _fill_slack(rep, r, seqs, s, num_new)
            fits = True
        else:
            fits = _allocate(pi, pf, rep, r, seqs, s, num_new, 0, 0.0, pool, 0, 0)
        while not fits:
            last = rep[r, NUM_RUNNING] - 1  # Fcfs.victim: the newest running sequence
            victim = running[r, last]
            rep[r, NUM_RUNNING] = last
            _free(pi, rep, r, seqs, victim, pool)  # Scheduler._preempt, recompute
            seqs[victim, PREEMPTIONS] += 1
            seqs[victim, COMPUTED] = 0
            _push_front(rep, waiting, r, victim)
            num_preempted += 1
            if victim == s:
                preempted_self = True
                break
            fits = _allocate(pi, pf, rep, r, seqs, s, num_new, 0, 0.0, pool, 0, 0)
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
            num_hit, revived = _lookup(pi, seqs, pool, rep, r, s)
            hit_tokens = num_hit * pi[P_BLOCK_SIZE]
            num_new = seqs[s, TOKENS] - hit_tokens
            if num_new > budget:
                if not pi[P_CHUNKED]:
                    break
                num_new = budget
            full_tokens = seqs[s, TOKENS] if pi[P_RESERVE_FULL] else 0
            watermark = pf[P_WATERMARK] if rep[r, NUM_RUNNING] else 0.0
            if not _allocate(pi, pf, rep, r, seqs, s, num_new, full_tokens, watermark, pool, num_hit, revived):
                break
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
            _free(pi, rep, r, seqs, s, pool)
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


@jit
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
        if not _plan(pi, pf, rep, r, seqs, running, waiting, plan, shape, rep_times, when, tables, pool):
            stuck[0] = r
            out_counts[0], out_counts[1], out_counts[2], out_counts[3] = rows, gap_rows, num_done, events
            return STUCK
