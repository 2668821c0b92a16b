"""Collectors for one simulation run, turned into pandas tables and the metrics.json summary.

Definitions (issue 2 / DESIGN.md): TTFT = end of the step that computed the last prompt token
minus arrival (a session turn arrives when it becomes eligible); TPOT = (e2e - TTFT) / (output
tokens - 1) over requests with more than one output token; percentiles as numpy computes them by
default; sim_duration_s = last finish - first arrival. The KV breakdown is sampled after each
step's commit and held until that replica's next step; each category's time integral over the
capacity's, from first arrival to last finish, summed over replicas.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from sim.kvcache.base import USAGE_FIELDS

REQUEST_COLUMNS = ("request_id", "session_id", "turn", "replica", "status", "arrival_time_s",
                   "first_token_time_s", "finish_time_s", "prompt_tokens", "output_tokens",
                   "total_output_tokens", "num_samples", "prefix_hit_tokens", "num_preemptions")
TIMELINE_COLUMNS = ("replica", "time_s", "capacity", *USAGE_FIELDS, "batch_size",
                    "num_batched_tokens", "num_running", "num_waiting", "num_preempted",
                    "num_swapped_tokens")


class Recorder:
    def __init__(self):
        self.requests: list[tuple] = []
        self.timeline: list[tuple] = []

    def record_initial(self, replica: int, time_s: float, allocator) -> None:
        usage = allocator.usage(None)
        self.timeline.append((replica, time_s, usage.capacity, *usage.as_tuple(), 0, 0, 0, 0, 0, 0))

    def record_step(self, replica: int, time_s: float, plan, scheduler) -> None:
        usage = scheduler.allocator.usage(scheduler.first_waiting)
        self.timeline.append((
            replica, time_s, usage.capacity, *usage.as_tuple(), len(plan.scheduled),
            plan.shape.num_tokens, len(scheduler.running), len(scheduler.waiting),
            plan.num_preempted, plan.shape.swap_tokens))

    def record_finished(self, samples) -> None:
        """One row per request; with n > 1 samples, output_tokens is the longest sample's."""
        first = samples[0]
        r = first.request
        self.requests.append((
            r.request_id, r.session_id, r.turn, first.replica, "finished", first.arrival_time_s,
            min(s.first_token_time_s for s in samples), max(s.finish_time_s for s in samples),
            r.prompt_len, max(s.num_output for s in samples), sum(s.num_output for s in samples),
            len(samples), first.prefix_hit_tokens, sum(s.num_preemptions for s in samples)))

    def record_rejected(self, request, time_s: float) -> None:
        self.requests.append((request.request_id, request.session_id, request.turn, -1,
                              "rejected", time_s, math.nan, math.nan, request.prompt_len, 0, 0,
                              request.n, 0, 0))

    def tables(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        requests = pd.DataFrame.from_records(self.requests, columns=REQUEST_COLUMNS)
        requests = requests.sort_values("request_id", kind="stable").reset_index(drop=True)
        requests["ttft_s"] = requests.first_token_time_s - requests.arrival_time_s
        requests["e2e_s"] = requests.finish_time_s - requests.arrival_time_s
        multi = requests.output_tokens > 1
        requests["tpot_s"] = np.where(
            multi, (requests.e2e_s - requests.ttft_s) / (requests.output_tokens - 1).clip(lower=1), np.nan)
        timeline = pd.DataFrame.from_records(self.timeline, columns=TIMELINE_COLUMNS)
        return requests, timeline


def _percentiles(values: pd.Series) -> dict[str, float]:
    data = values.dropna().to_numpy()
    if data.size == 0:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    p50, p90, p99 = np.percentile(data, [50, 90, 99])
    return {"mean": float(data.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def kv_fractions(timeline: pd.DataFrame, start_s: float, end_s: float) -> dict[str, float]:
    """Time-weighted fractions of KV capacity per category, summed over replicas."""
    totals = dict.fromkeys(USAGE_FIELDS, 0.0)
    capacity_time = 0.0
    for _, rows in timeline.groupby("replica", sort=True):
        times = np.clip(rows.time_s.to_numpy(), start_s, end_s)
        held = np.diff(np.append(times, end_s))
        capacity_time += float((rows.capacity.to_numpy() * held).sum())
        for name in USAGE_FIELDS:
            totals[name] += float((rows[name].to_numpy() * held).sum())
    if capacity_time <= 0:
        return {f"{name}_frac": (1.0 if name == "free" else 0.0) for name in USAGE_FIELDS}
    return {f"{name}_frac": totals[name] / capacity_time for name in USAGE_FIELDS}


def summarize(requests: pd.DataFrame, timeline: pd.DataFrame, *, wall_time_s: float,
              gpu: str, profile_source: str) -> dict:
    done = requests[requests.status == "finished"]
    start_s = float(requests.arrival_time_s.min()) if len(requests) else 0.0
    end_s = float(done.finish_time_s.max()) if len(done) else start_s
    duration = end_s - start_s
    kv = kv_fractions(timeline, start_s, end_s)
    kv = {"token_states_frac": kv["token_states_frac"], "reserved_frac": kv["reserved_frac"],
          "internal_frag_frac": kv["internal_frag_frac"],
          "external_frag_frac": kv["external_frag_frac"],
          "cached_idle_frac": kv["cached_idle_frac"], "free_frac": kv["free_frac"]}
    in_use = 1.0 - kv["free_frac"] - kv["cached_idle_frac"]
    wasted = kv["reserved_frac"] + kv["internal_frag_frac"] + kv["external_frag_frac"]
    kv["waste_frac"] = wasted / in_use if in_use > 0 else 0.0
    hit_tokens = int(done.prefix_hit_tokens.sum())
    prompt_tokens = int(done.prompt_tokens.sum())
    steps = timeline[timeline.batch_size > 0]
    return {
        "num_requests": int(len(requests)),
        "num_finished": int(len(done)),
        "num_rejected": int((requests.status == "rejected").sum()),
        "sim_duration_s": duration,
        "wall_time_s": wall_time_s,
        "throughput": {
            "requests_per_s": len(done) / duration if duration > 0 else 0.0,
            "output_tokens_per_s": float(done.total_output_tokens.sum()) / duration if duration > 0 else 0.0,
        },
        "latency_s": {"ttft": _percentiles(done.ttft_s), "tpot": _percentiles(done.tpot_s),
                      "e2e": _percentiles(done.e2e_s)},
        "kv": kv,
        "prefix_cache": {"hit_rate": hit_tokens / prompt_tokens if prompt_tokens else 0.0,
                         "hit_tokens": hit_tokens, "prompt_tokens": prompt_tokens},
        "scheduler": {"num_preemptions": int(done.num_preemptions.sum()),
                      "mean_batch_size": float(steps.batch_size.mean()) if len(steps) else 0.0,
                      "num_steps": int(len(steps)),
                      "swapped_tokens": int(timeline.num_swapped_tokens.sum())},
        "latency_profile": {"gpu": gpu, "source": profile_source},
    }


def flatten(metrics: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat
