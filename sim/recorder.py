"""Collects one run's records and turns them into the request and timeline tables.

Appends only: step and stretch records from the replicas (sim.engine.records), finished and
rejected requests from the cluster. Timeline rows come out in time order (replica order on a tie),
inter-token gaps replica by replica in time order, whatever order the records came in. Rows are
packed into arrays as they come (times as float64, counts as int32 when they fit), and small
arrays joined as they pile up, so a run of millions of steps keeps about 70 bytes per step.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from sim.engine.records import StepRecord, StretchRecord
from sim.kvcache.base import USAGE_FIELDS

REQUEST_COLUMNS = ("request_id", "session_id", "turn", "replica", "status", "arrival_time_s",
                   "first_token_time_s", "finish_time_s", "prompt_tokens", "output_tokens",
                   "total_output_tokens", "num_samples", "prefix_hit_tokens", "num_preemptions",
                   "requested_output_tokens")
TIMELINE_COLUMNS = ("replica", "time_s", "capacity", *USAGE_FIELDS, "batch_size",
                    "num_batched_tokens", "num_running", "num_waiting", "num_preempted",
                    "num_swapped_tokens", "num_output_tokens")
ROWS_PER_BLOCK = 4096  # single-step rows are packed into arrays this many at a time


INT_COLUMNS = tuple(name for name in TIMELINE_COLUMNS if name != "time_s")
COLUMN = {name: i for i, name in enumerate(INT_COLUMNS)}
PIECES_PER_BLOCK = 256  # small arrays are joined this many at a time


def _compact(ints: np.ndarray) -> np.ndarray:
    """int32 when every value fits (token counts of one pool do), else int64."""
    if ints.size and (ints.max() > np.iinfo(np.int32).max or ints.min() < np.iinfo(np.int32).min):
        return ints.astype(np.int64)
    return ints.astype(np.int32)


class Pieces:
    """Arrays appended one after another, joined as they pile up (one array each costs ~100 B)."""

    def __init__(self):
        self.blocks: list[np.ndarray] = []
        self._pending: list[np.ndarray] = []

    def append(self, array: np.ndarray) -> None:
        self._pending.append(array)
        if len(self._pending) >= PIECES_PER_BLOCK:
            self.blocks.append(np.concatenate(self._pending))
            self._pending = []

    def take_all(self, empty: np.ndarray) -> np.ndarray:
        """Everything appended, as one array; the pieces are let go (memory is the point)."""
        parts, self.blocks, self._pending = self.blocks + self._pending, [], []
        joined = np.concatenate(parts) if parts else empty
        del parts
        return joined


class Recorder:
    def __init__(self):
        self.requests: list[tuple] = []
        self._request_frames: list[pd.DataFrame] = []
        self._rows: list[tuple] = []     # single steps not yet packed: (time_s, *INT_COLUMNS)
        self._times, self._ints = Pieces(), Pieces()    # packed timeline rows
        self._itl: list[tuple[float, float, int, int]] = []  # (time_s, gap_s, replica, count)
        self._itl_floats, self._itl_ints = Pieces(), Pieces()  # packed: (time_s, gap_s), (replica, count)

    def append_step(self, record: StepRecord) -> None:
        usage = record.usage
        self._rows.append((record.time_s, record.replica, usage.capacity, *usage.as_tuple(),
                           record.batch_size, record.num_batched_tokens, record.num_running,
                           record.num_waiting, record.num_preempted, record.num_swapped_tokens,
                           record.num_output_tokens))
        if len(self._rows) >= ROWS_PER_BLOCK:
            self._pack()
        replica, time_s = record.replica, record.time_s
        self._itl.extend((time_s, gap, replica, count) for gap, count in record.itl)
        if len(self._itl) >= ROWS_PER_BLOCK:
            self._pack_itl()

    def append_stretch(self, record: StretchRecord) -> None:
        """Packed apart from single steps: tables() orders rows by time, gaps by replica and time."""
        ints = np.zeros((len(record.times_s), len(INT_COLUMNS)), dtype=np.int64)
        ints[:, COLUMN["replica"]] = record.replica
        ints[:, COLUMN["capacity"]] = record.capacity
        for i, name in enumerate(USAGE_FIELDS):
            ints[:, COLUMN[name]] = record.usage[:, i]
        for name in ("batch_size", "num_batched_tokens", "num_running", "num_output_tokens"):
            ints[:, COLUMN[name]] = record.batch_size  # one token each, every sequence running
        ints[:, COLUMN["num_waiting"]] = record.num_waiting
        self._times.append(np.asarray(record.times_s, dtype=np.float64))
        self._ints.append(_compact(ints))
        itl = np.asarray(record.itl, dtype=np.float64).reshape(-1, 3)
        self._itl_floats.append(itl[:, :2].copy())
        self._itl_ints.append(np.column_stack((np.full(len(itl), record.replica, dtype=np.int32),
                                               itl[:, 2].astype(np.int32))))

    def append_timeline(self, times_s: np.ndarray, ints: np.ndarray) -> None:
        """Timeline rows in columns: each step's end and its INT_COLUMNS (the compiled loop's)."""
        if len(times_s):
            self._times.append(times_s)
            self._ints.append(_compact(ints))

    def append_itl(self, floats: np.ndarray, ints: np.ndarray) -> None:
        """Inter-token gaps in columns: (time_s, gap_s) and (replica, count) rows."""
        if len(floats):
            self._itl_floats.append(floats)
            self._itl_ints.append(ints.astype(np.int32))

    def append_request_frame(self, frame: pd.DataFrame) -> None:
        """Request rows in columns (REQUEST_COLUMNS), as append_finished writes them one by one."""
        self._request_frames.append(frame)

    def append_finished(self, samples) -> None:
        """One row per request; with n > 1 samples, output_tokens is the longest sample's."""
        first = samples[0]
        r = first.request
        self.requests.append((
            r.request_id, r.session_id, r.turn, first.replica, "finished", first.arrival_time_s,
            min(s.first_token_time_s for s in samples), max(s.finish_time_s for s in samples),
            r.prompt_len, max(s.num_output for s in samples), sum(s.num_output for s in samples),
            len(samples), first.prefix_hit_tokens, sum(s.num_preemptions for s in samples),
            r.output_len))

    def append_rejected(self, request, time_s: float) -> None:
        self.requests.append((request.request_id, request.session_id, request.turn, -1,
                              "rejected", time_s, math.nan, math.nan, request.prompt_len, 0, 0,
                              request.n, 0, 0, request.output_len))

    def _pack(self) -> None:
        if self._rows:
            rows = np.array(self._rows, dtype=np.float64)
            self._times.append(rows[:, 0].copy())
            self._ints.append(_compact(rows[:, 1:].astype(np.int64)))
            self._rows = []

    def _pack_itl(self) -> None:
        if self._itl:
            rows = np.array(self._itl, dtype=np.float64)
            self._itl_floats.append(rows[:, :2].copy())
            self._itl_ints.append(rows[:, 2:].astype(np.int32))
            self._itl = []

    def itl_samples(self) -> np.ndarray:
        """(time_s, gap_s, count) rows, replica by replica, each replica's in time order (the
        gaps of one step in the order its commit counted them). Once, at the end of a run."""
        self._pack_itl()
        floats = self._itl_floats.take_all(np.empty((0, 2)))
        ints = self._itl_ints.take_all(np.empty((0, 2), dtype=np.int32))
        order = np.lexsort((floats[:, 0], ints[:, 0]))  # stable: a step's gaps stay together
        return np.column_stack((floats[order], ints[order, 1]))

    def tables(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        """The request and timeline tables, once, at the end of a run: the records are handed
        over (a million-request run would otherwise hold them twice)."""
        requests = pd.DataFrame.from_records(self.requests, columns=REQUEST_COLUMNS)
        if self._request_frames:
            requests = pd.concat([requests, *self._request_frames], ignore_index=True) if len(requests) \
                else pd.concat(self._request_frames, ignore_index=True)
        self.requests, self._request_frames = [], []
        requests = requests.sort_values("request_id", kind="stable").reset_index(drop=True)
        for name in ("arrival_time_s", "first_token_time_s", "finish_time_s"):  # (SimPy's clock starts as int 0)
            requests[name] = requests[name].astype(np.float64)
        requests["ttft_s"] = requests.first_token_time_s - requests.arrival_time_s
        requests["e2e_s"] = requests.finish_time_s - requests.arrival_time_s
        multi = requests.output_tokens > 1
        requests["tpot_s"] = np.where(
            multi, (requests.e2e_s - requests.ttft_s) / (requests.output_tokens - 1).clip(lower=1), np.nan)
        self._pack()
        times = self._times.take_all(np.empty(0))
        ints = self._ints.take_all(np.empty((0, len(INT_COLUMNS)), dtype=np.int64))
        order = np.lexsort((ints[:, 0], times))  # by time, then replica
        columns = {"time_s": times[order]}
        del times
        for i, name in enumerate(INT_COLUMNS):
            columns[name] = ints[order, i].astype(np.int64)
        del ints, order
        timeline = pd.DataFrame({name: columns[name] for name in TIMELINE_COLUMNS}, copy=False)
        return requests, timeline
