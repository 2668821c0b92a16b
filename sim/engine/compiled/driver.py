"""Runs the compiled loop (sim.engine.compiled.core) over a workload and hands its rows to the
recorder: the same records the Python engine's replicas and cluster append, in columns."""
from __future__ import annotations

import math
from contextlib import contextmanager

import numpy as np
import pandas as pd

from sim.engine.compiled import core
from sim.engine.compiled.rows import RequestRows, arrival_clock, request_rows
from sim.engine.compiled.tables import latency_parameters, latency_tables
from sim.engine.records import StepRecord
from sim.recorder import REQUEST_COLUMNS, Recorder
from sim.router.round_robin import RoundRobin

ROWS_PER_CALL = 1 << 16          # timeline rows the loop writes before handing them over
SESSIONS_PER_CALL = 1 << 14      # sessions started per call (progress is reported between calls)
ROUTERS = {"requests": core.ROUTE_REQUESTS, "waiting": core.ROUTE_WAITING,
           "queued_tokens": core.ROUTE_QUEUED_TOKENS}


def _parameters(setup, allocator, router) -> tuple[np.ndarray, np.ndarray]:
    spec = setup.spec
    ints = np.zeros(core.PARAM_INTS, dtype=np.int64)
    floats = np.zeros(core.PARAM_FLOATS, dtype=np.float64)
    ints[core.P_REPLICAS], ints[core.P_BLOCK_SIZE], ints[core.P_NUM_BLOCKS] = (
        spec.num_replicas, allocator.block_size, allocator.num_blocks)
    ints[core.P_MAX_SEQS], ints[core.P_BUDGET] = spec.max_num_seqs, spec.max_num_batched_tokens
    ints[core.P_CHUNKED], ints[core.P_MAX_MODEL_LEN] = int(spec.enable_chunked_prefill), spec.max_model_len
    ints[core.P_RESERVE_FULL] = int(spec.scheduler_reserve_full_isl)
    ints[core.P_CACHING] = int(allocator.enable_caching)
    ints[core.P_NO_EVICT] = int(spec.capacity_scheduler_policy == "guaranteed_no_evict")
    ints[core.P_ROUTER] = (core.ROUTE_ROUND_ROBIN if type(router) is RoundRobin or spec.num_replicas == 1
                           else ROUTERS[router.metric])
    floats[core.P_WATERMARK], floats[core.P_OVERHEAD_S] = spec.watermark, spec.serving_overhead_s
    latency_ints, latency_floats = latency_parameters(setup.latency)
    for index, value in latency_ints.items():
        ints[index] = value
    for index, value in latency_floats.items():
        floats[index] = value
    return ints, floats


def _state(num: int, num_replicas: int, max_seqs: int) -> tuple:
    """Zeroed arrays of core.run for num requests on num_replicas replicas: sequences (ints,
    floats), replicas (ints, floats), running lists, waiting rings, plans, later turns (times,
    rows, creation order)."""
    seqs = np.zeros((num, core.SEQ_INTS), dtype=np.int64)
    seq_times = np.full((num, core.SEQ_FLOATS), math.nan)
    rep = np.zeros((num_replicas, core.REPLICA_INTS), dtype=np.int64)
    rep_times = np.zeros((num_replicas, 2))
    running = np.zeros((num_replicas, max_seqs), dtype=np.int64)
    waiting = np.zeros((num_replicas, max(num, 1)), dtype=np.int64)
    plan = np.zeros((num_replicas, max_seqs, 2), dtype=np.int64)
    later = (np.zeros(max(num, 1)), np.zeros(max(num, 1), dtype=np.int64), np.zeros(max(num, 1), dtype=np.int64))
    return seqs, seq_times, rep, rep_times, running, waiting, plan, later


def _outputs(rows: int, max_seqs: int) -> tuple:
    """Buffers for rows timeline rows and their gaps (core.run fills and hands them over)."""
    return (np.empty(rows), np.empty((rows, core.TIMELINE_INTS), dtype=np.int64),
            np.empty((rows + max_seqs, 2)), np.empty((rows + max_seqs, 2), dtype=np.int64))


# The part of each replica's chain table in use at first (core._add_chain doubles it as needed).
FIRST_CHAIN_ROWS = 1024
# How many times the block store holds what compaction can keep at most (core._new_extent).
STORE_ROOMS = 2


def _pool(allocator, num_replicas: int, max_seqs: int, max_model_len: int, requests: RequestRows, seqs) -> tuple:
    """core.run's block pool (core.POOL_*): empty, every block free and never used, as BlockPool
    starts; without prefix caching placeholders of the same types (only counts are kept). Fills
    each request's segment columns of seqs."""
    if not allocator.enable_caching:
        return _pool_arrays(1, 1, 1, 1, 1, np.zeros((0, 3), dtype=np.int64))
    blocks, size = allocator.num_blocks, allocator.block_size
    keys = requests.keys
    seqs[:, core.NUM_SEGMENTS] = keys.num_segments
    seqs[:, core.SEGMENTS] = keys.first_segment
    seqs[:, core.OUTPUT_CONTENT] = keys.output_content
    seqs[:, core.PROMPT_PREFIX] = keys.prompt_prefix
    longest = int(seqs[:, core.FINAL_LEN].max()) if len(requests) else 1
    # Every live block and each running sequence's room for its final length, STORE_ROOMS times.
    store = STORE_ROOMS * (blocks + max_seqs * (-(-longest // size) + 2)) + 1024
    pool = _pool_arrays(num_replicas, blocks, max_seqs, store, max_model_len // size + 1, keys.segments)
    entries = pool[core.POOL_ENTRIES]
    entries[:, 0, core.Q_EXTENT], entries[:, 0, core.Q_LOW], entries[:, 0, core.Q_HIGH] = -1, 0, blocks
    entries[:, 0, core.Q_PREV] = entries[:, 0, core.Q_NEXT] = -1
    return pool


def _pool_arrays(num_replicas: int, blocks: int, max_seqs: int, store: int, max_blocks: int,
                 segments: np.ndarray) -> tuple:
    """The pool's arrays, zeroed: memory is touched as the run uses it (core._new_row takes
    rows never used after the free ones)."""
    num_extents, num_rows = blocks + max_seqs + 2, blocks + 4
    with _small_pages():
        return (segments, np.zeros((num_replicas, 2, store), dtype=np.int32),
                np.zeros((num_replicas, num_extents, core.EXTENT_FIELDS), dtype=np.int64),
                np.zeros((num_replicas, num_rows, core.ENTRY_FIELDS), dtype=np.int64),
                np.zeros((num_replicas, 2 * num_rows, core.CLAIM_FIELDS), dtype=np.int64),  # chain records too
                _chain_table(num_replicas, 1 << (2 * num_rows).bit_length()),
                np.zeros((num_replicas, 2 * num_extents, 2), dtype=np.int64),
                np.zeros((num_replicas, max_blocks, 3), dtype=np.int64))


def _chain_table(num_replicas: int, rows: int) -> np.ndarray:
    """Each replica's chain table (rows, a power of two) and as many rows of scratch room after
    it (core._grow_chain_table); the first rows in use are empty, the rest untouched."""
    table = np.zeros((num_replicas, 2 * rows, 2), dtype=np.uint64)
    table[:, :min(rows, FIRST_CHAIN_ROWS), 1] = core.EMPTY
    return table


@contextmanager
def _small_pages():
    """Arrays allocated in it get the kernel's small pages. numpy asks for huge (2 MB) pages for
    big arrays, and the kernel zeroes a huge page whole when it is first touched: the pool's
    arrays are sized for the worst case (every block its own extent) but only the first rows of
    each replica's part are used, so huge pages zeroed about 110 MB at rag_agents_100k (9% of
    the prefix loop, perf: clear_page_erms) where small pages zero a few MB."""
    was = _set_hugepage_advice(False)
    try:
        yield
    finally:
        _set_hugepage_advice(was)


def _set_hugepage_advice(enabled: bool) -> bool:
    """Sets whether numpy advises huge pages for the big arrays it allocates; returns what it was."""
    try:  # numpy 2; numpy 1.26 keeps it in numpy.core
        from numpy._core.multiarray import _set_madvise_hugepage
    except ImportError:
        from numpy.core.multiarray import _set_madvise_hugepage
    return _set_madvise_hugepage(enabled)


def warm_up() -> None:
    """Load the compiled loop (numba's cache, or a first compile) before a run is timed: a run
    of no requests through the same types."""
    ints, floats = np.zeros(core.PARAM_INTS, dtype=np.int64), np.zeros(core.PARAM_FLOATS)
    ints[core.P_REPLICAS] = ints[core.P_MAX_SEQS] = ints[core.P_BLOCK_SIZE] = ints[core.P_MAX_MODEL_LEN] = 1
    i1 = np.zeros(1, dtype=np.int64)
    f1, f2, f3 = (np.zeros((1,) * n) for n in (1, 2, 3))
    tables = (f3, f2, f2, f1, f2, f2, i1, f1, f1, f1, f1, f1, f1)
    seqs, seq_times, rep, rep_times, running, waiting, plan, later = _state(0, 1, 1)
    pool = _pool(BlockAllocatorShape(), 1, 1, 1, None, seqs)
    core.run(ints, floats, seqs, seq_times, rep, rep_times, running, waiting, plan, tables, pool,
             np.zeros(0, dtype=np.int64), 0, *later, *_outputs(1, 1), np.zeros(4, dtype=np.int64), i1)


class BlockAllocatorShape:
    """What _pool reads of an allocator, for warm_up's empty run."""
    enable_caching, num_blocks, block_size = False, 1, 1


def simulate_compiled(setup, workload, allocator, router, recorder: Recorder, on_progress) -> int:
    """The run as the Python engine would make it, recorded in the same rows; returns the
    events the loop handled."""
    spec = setup.spec
    requests = request_rows(workload, with_keys=allocator.enable_caching)
    arrivals = arrival_clock(requests.arrival_s)
    submits = arrivals + spec.serving_overhead_s if spec.serving_overhead_s else arrivals
    num, num_replicas, max_seqs = len(requests), spec.num_replicas, spec.max_num_seqs
    empty = allocator.usage()
    for index in range(num_replicas):
        recorder.append_step(StepRecord(index, workload.first_arrival_s, empty, 0, 0, 0, 0))
    seqs, seq_times, rep, rep_times, running, waiting, plan, later = _state(num, num_replicas, max_seqs)
    seqs[:, core.PROMPT] = seqs[:, core.TOKENS] = requests.prompt
    seqs[:, core.OUTPUT_LEN] = requests.output
    seqs[:, core.FINAL_LEN] = np.minimum(requests.prompt + requests.output, spec.max_model_len)
    seqs[:, core.REPLICA] = -1
    seqs[:, core.NEXT_TURN] = requests.next_turn
    seq_times[:, core.THINK_S] = requests.think_s
    starts = requests.starts
    seq_times[starts, core.ARRIVAL], seq_times[starts, core.SUBMIT] = arrivals, submits
    rep[:, core.FREE_BLOCKS] = allocator.num_blocks
    rep[:, core.QUEUE_HEAD] = rep[:, core.QUEUE_TAIL] = 0  # the entry of blocks never used
    rep[:, core.FREE_ENTRIES] = rep[:, core.FREE_EXTENTS] = rep[:, core.FREE_CLAIMS] = -1
    rep[:, core.UNUSED_ENTRIES] = 1
    rep[:, core.BLOCKED_HEAD] = -1
    pool = _pool(allocator, num_replicas, max_seqs, spec.max_model_len, requests, seqs)
    rep[:, core.CHAIN_MASK] = min(pool[core.POOL_CHAIN_TABLE].shape[1] // 2, FIRST_CHAIN_ROWS) - 1
    ints, floats = _parameters(setup, allocator, router)
    tables = latency_tables(setup.latency, spec.max_num_batched_tokens, max_seqs)
    buffers = _outputs(ROWS_PER_CALL, max_seqs)
    counts, stuck = np.zeros(4, dtype=np.int64), np.zeros(1, dtype=np.int64)
    num_events, start_end, now = 0, 0, 0.0
    while True:
        if ints[core.P_NEXT_START] >= start_end:
            start_end = min(len(starts), start_end + SESSIONS_PER_CALL)
        status = core.run(ints, floats, seqs, seq_times, rep, rep_times, running, waiting, plan, tables, pool,
                          starts, start_end, *later, *buffers, counts, stuck)
        rows, gap_rows, done, events = (int(c) for c in counts)
        num_events += events
        timeline_times, timeline_ints, itl_floats, itl_ints = buffers
        recorder.append_timeline(timeline_times[:rows].copy(), timeline_ints[:rows])
        recorder.append_itl(itl_floats[:gap_rows].copy(), itl_ints[:gap_rows])
        now = float(timeline_times[rows - 1]) if rows else now
        for _ in range(done):
            on_progress(now)
        if status == core.STUCK:
            raise RuntimeError(f"replica {int(stuck[0])} cannot schedule its waiting queue")
        if status == core.STORE_FULL:
            raise RuntimeError(f"replica {int(stuck[0])}: the compiled prefix cache ran out of room (its "
                               "block store is full; run with engine=python)")
        if status == core.DONE:
            break
    recorder.append_request_frame(_request_frame(requests, seqs, seq_times))
    return num_events


def _request_frame(requests: RequestRows, seqs: np.ndarray, seq_times: np.ndarray) -> pd.DataFrame:
    """The rows Recorder.append_finished and append_rejected write, of every request done."""
    done = seqs[:, core.STATUS] != core.PENDING
    seqs, seq_times = seqs[done], seq_times[done]
    finished = seqs[:, core.STATUS] == core.FINISHED
    outputs = np.where(finished, seqs[:, core.OUTPUTS], 0)
    columns = {
        "request_id": requests.request_id[done], "session_id": requests.session_id[done],
        "turn": requests.turn[done],
        "replica": np.where(finished, seqs[:, core.REPLICA], -1),
        "status": np.where(finished, "finished", "rejected").astype(object),
        "arrival_time_s": seq_times[:, core.ARRIVAL], "first_token_time_s": seq_times[:, core.FIRST_TOKEN],
        "finish_time_s": seq_times[:, core.FINISH], "prompt_tokens": seqs[:, core.PROMPT],
        "output_tokens": outputs, "total_output_tokens": outputs, "num_samples": 1,
        "prefix_hit_tokens": seqs[:, core.PREFIX_HIT],
        "num_preemptions": seqs[:, core.PREEMPTIONS], "requested_output_tokens": seqs[:, core.OUTPUT_LEN]}
    return pd.DataFrame({name: columns[name] for name in REQUEST_COLUMNS})
