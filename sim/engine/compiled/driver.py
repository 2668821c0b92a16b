"""Runs the compiled loop (sim.engine.compiled.core) over a workload and hands its rows to the
recorder: the same records the Python engine's replicas and cluster append, in columns."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from sim.engine.compiled import core
from sim.engine.compiled.tables import latency_parameters, latency_tables
from sim.engine.records import StepRecord
from sim.recorder import REQUEST_COLUMNS, Recorder
from sim.router.round_robin import RoundRobin

ROWS_PER_CALL = 1 << 16          # timeline rows the loop writes before handing them over
REQUESTS_PER_CALL = 1 << 14      # requests submitted per call (progress is reported between calls)
ROUTERS = {"requests": core.ROUTE_REQUESTS, "waiting": core.ROUTE_WAITING,
           "queued_tokens": core.ROUTE_QUEUED_TOKENS}


def _requests(workload, max_model_len: int, serving_overhead_s: float, recorder: Recorder, on_progress):
    """The served requests in arrival order, with their arrival and submit times as the cluster's
    SimPy clock reaches them (one addition after another); prompts over max_model_len are
    rejected on arrival, as sim.engine.cluster does."""
    requests, arrivals, submits = [], [], []
    now = 0.0
    for session in workload.in_arrival_order():
        if session.arrival_time_s > now:
            now = now + (session.arrival_time_s - now)
        request = session.turns[0]
        if request.prompt_len > max_model_len:
            recorder.append_rejected(request, now)
            on_progress(now)
            continue
        requests.append(request)
        arrivals.append(now)
        submits.append(now + serving_overhead_s if serving_overhead_s else now)
    return requests, np.array(arrivals, dtype=np.float64), np.array(submits, dtype=np.float64)


def _parameters(setup, allocator, router) -> tuple[np.ndarray, np.ndarray]:
    spec = setup.spec
    ints = np.zeros(core.PARAM_INTS, dtype=np.int64)
    floats = np.zeros(3, dtype=np.float64)
    ints[core.P_REPLICAS], ints[core.P_BLOCK_SIZE], ints[core.P_NUM_BLOCKS] = (
        spec.num_replicas, allocator.block_size, allocator.num_blocks)
    ints[core.P_MAX_SEQS], ints[core.P_BUDGET] = spec.max_num_seqs, spec.max_num_batched_tokens
    ints[core.P_CHUNKED], ints[core.P_MAX_MODEL_LEN] = int(spec.enable_chunked_prefill), spec.max_model_len
    ints[core.P_RESERVE_FULL] = int(spec.scheduler_reserve_full_isl)
    ints[core.P_ROUTER] = (core.ROUTE_ROUND_ROBIN if type(router) is RoundRobin or spec.num_replicas == 1
                           else ROUTERS[router.metric])
    floats[core.P_WATERMARK] = spec.watermark
    latency_ints, latency_floats = latency_parameters(setup.latency)
    for index, value in latency_ints.items():
        ints[index] = value
    for index, value in latency_floats.items():
        floats[index] = value
    return ints, floats


def warm_up() -> None:
    """Load the compiled loop (numba's cache, or a first compile) before a run is timed: a run
    of no requests through the same types."""
    ints, floats = np.zeros(core.PARAM_INTS, dtype=np.int64), np.zeros(3)
    ints[core.P_REPLICAS] = ints[core.P_MAX_SEQS] = 1
    i1, i2, i3 = (np.zeros((1,) * n, dtype=np.int64) for n in (1, 2, 3))
    f1, f2, f3 = (np.zeros((1,) * n) for n in (1, 2, 3))
    tables = (f3, f2, f2, f1, f2, f2, i1, f1, f1, f1, f1, f1, f1)
    core.run(ints, floats, np.zeros((0, core.SEQ_INTS), dtype=np.int64), np.zeros((0, core.SEQ_FLOATS)),
             np.zeros((1, core.REPLICA_INTS), dtype=np.int64), np.zeros((1, 2)), i2, i2, i3, tables, 0,
             f1, np.zeros((1, core.TIMELINE_INTS), dtype=np.int64), f2, i2, np.zeros(4, dtype=np.int64), i1)


def simulate_compiled(setup, workload, allocator, router, recorder: Recorder, on_progress) -> int:
    """The run as the Python engine would make it, recorded in the same rows; returns the
    events the loop handled."""
    spec = setup.spec
    requests, arrivals, submits = _requests(workload, spec.max_model_len, spec.serving_overhead_s,
                                            recorder, on_progress)
    num, num_replicas, max_seqs = len(requests), spec.num_replicas, spec.max_num_seqs
    first_arrival = workload.first_arrival_s
    empty = allocator.usage()
    for index in range(num_replicas):
        recorder.append_step(StepRecord(index, first_arrival, empty, 0, 0, 0, 0))
    seqs = np.zeros((max(num, 1), core.SEQ_INTS), dtype=np.int64)
    prompts = np.fromiter((r.prompt_len for r in requests), dtype=np.int64, count=num)
    outputs = np.fromiter((r.output_len for r in requests), dtype=np.int64, count=num)
    seqs[:num, core.PROMPT] = seqs[:num, core.TOKENS] = prompts
    seqs[:num, core.OUTPUT_LEN] = outputs
    seqs[:num, core.FINAL_LEN] = np.minimum(prompts + outputs, spec.max_model_len)
    seqs[:, core.REPLICA] = -1
    seq_times = np.full((max(num, 1), core.SEQ_FLOATS), math.nan)
    seq_times[:num, core.ARRIVAL], seq_times[:num, core.SUBMIT] = arrivals, submits
    seqs, seq_times = seqs[:num], seq_times[:num]
    rep = np.zeros((num_replicas, core.REPLICA_INTS), dtype=np.int64)
    rep[:, core.FREE_BLOCKS] = allocator.num_blocks
    rep_times = np.zeros((num_replicas, 2))
    running = np.zeros((num_replicas, max_seqs), dtype=np.int64)
    waiting = np.zeros((num_replicas, max(num, 1)), dtype=np.int64)
    plan = np.zeros((num_replicas, max_seqs, 2), dtype=np.int64)
    ints, floats = _parameters(setup, allocator, router)
    tables = latency_tables(setup.latency, spec.max_num_batched_tokens, max_seqs)
    timeline_times = np.empty(ROWS_PER_CALL)
    timeline_ints = np.empty((ROWS_PER_CALL, core.TIMELINE_INTS), dtype=np.int64)
    itl_floats = np.empty((ROWS_PER_CALL + max_seqs, 2))
    itl_ints = np.empty((ROWS_PER_CALL + max_seqs, 2), dtype=np.int64)
    counts, stuck = np.zeros(4, dtype=np.int64), np.zeros(1, dtype=np.int64)
    num_events = 0
    submit_end = 0
    while True:
        if ints[core.P_NEXT_SUBMIT] >= submit_end:
            submit_end = min(num, submit_end + REQUESTS_PER_CALL)
        status = core.run(ints, floats, seqs, seq_times, rep, rep_times, running, waiting, plan, tables,
                          submit_end, timeline_times, timeline_ints, itl_floats, itl_ints, counts, stuck)
        rows, gap_rows, finished, events = (int(c) for c in counts)
        num_events += events
        recorder.append_timeline(timeline_times[:rows].copy(), timeline_ints[:rows])
        recorder.append_itl(itl_floats[:gap_rows].copy(), itl_ints[:gap_rows])
        if finished:
            last = float(timeline_times[rows - 1])
            for _ in range(finished):
                on_progress(last)
        if status == core.STUCK:
            raise RuntimeError(f"replica {int(stuck[0])} cannot schedule its waiting queue")
        if status == core.DONE:
            break
    recorder.append_request_frame(_finished_frame(requests, seqs, seq_times))
    return num_events


def _finished_frame(requests, seqs: np.ndarray, seq_times: np.ndarray) -> pd.DataFrame:
    """Recorder.append_finished's rows of every request (each served, one sample)."""
    outputs = seqs[:, core.OUTPUTS]
    columns = {
        "request_id": [r.request_id for r in requests], "session_id": [r.session_id for r in requests],
        "turn": [r.turn for r in requests], "replica": seqs[:, core.REPLICA], "status": "finished",
        "arrival_time_s": seq_times[:, core.ARRIVAL], "first_token_time_s": seq_times[:, core.FIRST_TOKEN],
        "finish_time_s": seq_times[:, core.FINISH], "prompt_tokens": seqs[:, core.PROMPT],
        "output_tokens": outputs, "total_output_tokens": outputs, "num_samples": 1, "prefix_hit_tokens": 0,
        "num_preemptions": seqs[:, core.PREEMPTIONS], "requested_output_tokens": seqs[:, core.OUTPUT_LEN]}
    return pd.DataFrame({name: columns[name] for name in REQUEST_COLUMNS})
