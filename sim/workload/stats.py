"""trace-stats: what a trace or a scenario asks of a cache, before any simulation.

Definitions (issue 4): num_requests counts subagent requests (a subagent belongs to its parent's
session); without session data num_sessions = num_requests; duration_s = last - first arrival; a
request's ideal hit = min(block size x the leading run of its block ids already seen earlier in
the trace, its input length), with no last-token rule, at the trace's own block size (a
scenario: block_size, and zero service time, so each turn arrives its think time after the
previous one).
"""
from __future__ import annotations

import numpy as np

from sim.workload.request import Workload
from sim.workload.trace import TraceSpec, read_requests, timed_requests


def _summary(arrivals, inputs, outputs, hits, num_sessions: int, block_size: int) -> dict:
    arrivals, inputs, outputs = (np.asarray(x, dtype=float) for x in (arrivals, inputs, outputs))
    duration = float(arrivals.max() - arrivals.min()) if len(arrivals) else 0.0
    return {
        "num_requests": int(len(inputs)),
        "num_sessions": int(num_sessions),
        "duration_s": duration,
        "arrival_rate_rps": (len(inputs) - 1) / duration if duration > 0 else 0.0,
        "mean_input_tokens": float(inputs.mean()), "p50_input_tokens": float(np.percentile(inputs, 50)),
        "p99_input_tokens": float(np.percentile(inputs, 99)),
        "mean_output_tokens": float(outputs.mean()), "p50_output_tokens": float(np.percentile(outputs, 50)),
        "p99_output_tokens": float(np.percentile(outputs, 99)),
        "ideal_prefix_hit_rate": float(sum(hits) / inputs.sum()) if inputs.sum() else 0.0,
        "block_size": block_size,
    }


def _ideal_hits(block_lists, inputs, block_size: int) -> list[int]:
    seen, hits = set(), []
    for blocks, input_len in zip(block_lists, inputs):
        run = 0
        for block in blocks:
            if block not in seen:
                break
            run += 1
        hits.append(min(block_size * run, input_len))
        seen.update(blocks)
    return hits


def trace_stats(spec: TraceSpec, seed: int) -> dict:
    fmt, raw, skipped, failed = read_requests(spec)
    timed = timed_requests(spec, fmt, raw, seed)
    period = timed[-1].arrival_s * len(timed) / max(len(timed) - 1, 1)
    copies = [(copy, r) for copy in range(spec.repeat) for r in timed]
    arrivals = [r.arrival_s + copy * period for copy, r in copies]
    blocks = [[(copy, b) for b in r.hash_ids] for copy, r in copies]
    inputs = [r.input_len for _, r in copies]
    sessions = ({(copy, r.session) for copy, r in copies} if fmt.has_sessions else None)
    stats = _summary(arrivals, inputs, [r.output_len for _, r in copies],
                     _ideal_hits(blocks, inputs, fmt.block_size),
                     len(sessions) if sessions is not None else len(copies), fmt.block_size)
    stats.update(format=fmt.name, num_skipped_records=skipped, num_failed_requests=failed)
    return stats


def scenario_stats(workload: Workload, block_size: int, name: str) -> dict:
    timed = []
    for session in workload.sessions:
        arrival = session.arrival_time_s
        for index, request in enumerate(session.turns):
            arrival += request.think_time_s if index else 0.0
            timed.append((arrival, request.request_id, request))
    timed.sort(key=lambda item: item[:2])
    requests = [r for _, _, r in timed]
    blocks = [r.prefix_keys(block_size, 0, r.prompt_len // block_size) for r in requests]
    inputs = [r.prompt_len for r in requests]
    hits = _ideal_hits(blocks, inputs, block_size)
    stats = _summary([t for t, _, _ in timed], inputs, [r.output_len for r in requests], hits,
                     len({s.session_id for s in workload.sessions}), block_size)
    stats.update(format=f"scenario {name}", num_skipped_records=0, num_failed_requests=0)
    return stats
