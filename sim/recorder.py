"""Collects one run's records and turns them into the request and timeline tables.

Appends only: step and stretch records from the replicas (sim.engine.records), finished and
rejected requests from the cluster. Timeline rows come out in time order (replica order on a tie),
inter-token gaps replica by replica in time order, whatever order the records came in.
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


class Recorder:
    def __init__(self):
        self.requests: list[tuple] = []
        self._rows: list[tuple] = []
        self._blocks: list[np.ndarray] = []
        self._itl: list[tuple[int, float, float, int]] = []  # (replica, time_s, gap_s, count)
        self._itl_blocks: list[np.ndarray] = []

    def append_step(self, record: StepRecord) -> None:
        usage = record.usage
        self._rows.append((record.replica, record.time_s, usage.capacity, *usage.as_tuple(),
                           record.batch_size, record.num_batched_tokens, record.num_running,
                           record.num_waiting, record.num_preempted, record.num_swapped_tokens,
                           record.num_output_tokens))
        if len(self._rows) >= ROWS_PER_BLOCK:
            self._pack()
        replica, time_s = record.replica, record.time_s
        self._itl.extend((replica, time_s, gap, count) for gap, count in record.itl)
        if len(self._itl) >= ROWS_PER_BLOCK:
            self._pack_itl()

    def append_stretch(self, record: StretchRecord) -> None:
        self._pack()
        steps = len(record.times_s)
        block = np.empty((steps, len(TIMELINE_COLUMNS)))
        block[:, 0] = record.replica
        block[:, 1] = record.times_s
        block[:, 2] = record.capacity
        block[:, 3:3 + len(USAGE_FIELDS)] = record.usage
        tail = 3 + len(USAGE_FIELDS)
        block[:, tail:] = (record.batch_size, record.batch_size, record.num_running, 0, 0, 0,
                           record.batch_size)
        block[:, tail + 3] = record.num_waiting
        self._blocks.append(block)
        self._pack_itl()
        self._itl_blocks.append(np.column_stack((np.full(len(record.itl), record.replica), record.itl)))

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
            self._blocks.append(np.array(self._rows, dtype=np.float64))
            self._rows = []

    def _pack_itl(self) -> None:
        if self._itl:
            self._itl_blocks.append(np.array(self._itl, dtype=np.float64))
            self._itl = []

    def itl_samples(self) -> np.ndarray:
        """(time_s, gap_s, count) rows, replica by replica, each replica's in time order."""
        self._pack_itl()
        if not self._itl_blocks:
            return np.empty((0, 3))
        data = np.concatenate(self._itl_blocks)
        order = np.argsort(data[:, 0], kind="stable")
        return data[order, 1:]

    def tables(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        requests = pd.DataFrame.from_records(self.requests, columns=REQUEST_COLUMNS)
        requests = requests.sort_values("request_id", kind="stable").reset_index(drop=True)
        requests["ttft_s"] = requests.first_token_time_s - requests.arrival_time_s
        requests["e2e_s"] = requests.finish_time_s - requests.arrival_time_s
        multi = requests.output_tokens > 1
        requests["tpot_s"] = np.where(
            multi, (requests.e2e_s - requests.ttft_s) / (requests.output_tokens - 1).clip(lower=1), np.nan)
        self._pack()
        data = (np.concatenate(self._blocks) if self._blocks
                else np.empty((0, len(TIMELINE_COLUMNS))))
        data = data[np.lexsort((data[:, 0], data[:, 1]))]  # by time, then replica
        timeline = pd.DataFrame({name: (data[:, i] if name == "time_s" else data[:, i].astype(np.int64))
                                 for i, name in enumerate(TIMELINE_COLUMNS)})
        return requests, timeline
