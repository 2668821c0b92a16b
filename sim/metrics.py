"""The metrics.json summary of one run's request and timeline tables (sim.recorder builds them).

Definitions (issue 2 / DESIGN.md): TTFT = end of the step that computed the last prompt token
minus arrival (a session turn arrives when it becomes eligible); TPOT = (e2e - TTFT) / (output
tokens - 1) over requests with more than one output token; percentiles as numpy computes them by
default; ITL = the gap between consecutive output tokens of a sequence, over every token
(as vllm bench serve pools them), percentiles by inverted CDF. The KV breakdown is sampled after
each step's commit and held until that replica's next step; each category's time integral over
the capacity's, summed over replicas.

Measurement window (`measure.*`): from first arrival + warmup_s to the last finish, or to the
arrival of the last new session with exclude_drain. Latency covers finished requests that arrived inside it;
throughput counts output tokens sampled and requests finished inside it per second of it
(measurement.duration_s is its length; sim_duration_s stays last finish - first arrival); KV
shares are integrals over it. Request counts, rejections,
unserved requests, prefix-cache figures and preemptions always cover every request.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from sim.errors import ConfigError
from sim.kvcache.base import USAGE_FIELDS
from sim.recorder import TIMELINE_COLUMNS
from sim.slo import SloSpec, slo_block

__all__ = ["TIMELINE_COLUMNS", "summarize", "kv_fractions", "weighted_percentiles", "flatten"]

# A statistic of nothing (no request measured, no KV in use, no step run): NaN in memory, null in
# metrics.json, n/a in the tables, never a 0 that reads like a measurement.
NO_DATA = float("nan")
NO_SAMPLES = {"mean": NO_DATA, "p50": NO_DATA, "p90": NO_DATA, "p99": NO_DATA}


def _percentiles(values: pd.Series) -> dict[str, float]:
    data = values.dropna().to_numpy()
    if data.size == 0:
        return dict(NO_SAMPLES)
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


@dataclass(frozen=True, slots=True)
class Window:
    """The measured span [start_s, end_s] and what the whole run spans."""
    start_s: float
    end_s: float
    first_arrival_s: float
    last_finish_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    def as_dict(self) -> dict:
        return {"window_s": [self.start_s, self.end_s],
                "excluded_warmup_s": [self.first_arrival_s, self.start_s],
                "excluded_drain_s": [self.end_s, self.last_finish_s]}


def measurement_window(requests: pd.DataFrame, warmup_s: float, exclude_drain: bool,
                       last_session_arrival_s: float | None = None) -> Window:
    """[first arrival + warmup_s, last finish], or, excluding the drain, up to the arrival of the
    last new session (a property of the workload, so every allocator gets the same window; later
    turns of running sessions are the drain)."""
    done = requests[requests.status == "finished"]
    first = float(requests.arrival_time_s.min()) if len(requests) else 0.0
    last_finish = float(done.finish_time_s.max()) if len(done) else first
    start = first + warmup_s
    if last_session_arrival_s is None:
        last_session_arrival_s = float(requests.arrival_time_s.max()) if len(requests) else first
    end = last_session_arrival_s if exclude_drain else last_finish
    if (warmup_s or exclude_drain) and end <= start:
        raise ConfigError(f"measure.warmup_s={warmup_s:g} leaves no span to measure (arrivals end "
                          f"{end - first:.1f} s after the first), key measure.warmup_s, "
                          f"lower it or run more requests")
    return Window(start, max(end, start), first, last_finish)


def weighted_percentiles(values: np.ndarray, weights: np.ndarray) -> dict[str, float]:
    """Mean and inverted-CDF percentiles of values repeated weights times."""
    if values.size == 0 or weights.sum() == 0:
        return dict(NO_SAMPLES)
    order = np.argsort(values, kind="stable")
    values, cumulative = values[order], np.cumsum(weights[order])
    total = cumulative[-1]
    at = {q: float(values[np.searchsorted(cumulative, q / 100 * total)]) for q in (50, 90, 99)}
    return {"mean": float((values * weights[order]).sum() / total),
            "p50": at[50], "p90": at[90], "p99": at[99]}


def _itl(samples, window: Window) -> dict[str, float]:
    data = np.asarray(samples, dtype=float).reshape(-1, 3)
    inside = (data[:, 0] > window.start_s) & (data[:, 0] <= window.end_s)
    return weighted_percentiles(data[inside, 1], data[inside, 2])


def _unserved(requests: pd.DataFrame, num_workload_requests: int, counts: dict) -> dict[str, int]:
    """Requests not served as asked, by reason."""
    done = requests[requests.status == "finished"]
    return {
        "rejected_prompt_too_long": int((requests.status == "rejected").sum()),
        "truncated_prompt": int(counts.get("truncated_prompt", 0)),
        "truncated_output": int((done.output_tokens < done.requested_output_tokens).sum()),
        "skipped_malformed_records": int(counts.get("skipped_malformed_records", 0)),
        "failed_in_trace": int(counts.get("failed_in_trace", 0)),
        "unfinished": int(num_workload_requests - len(requests)),
    }


def summarize(requests: pd.DataFrame, timeline: pd.DataFrame, *, wall_time_s: float,
              gpu: str, profile_source: str, warmup_s: float = 0.0, exclude_drain: bool = False,
              itl_samples=(), num_workload_requests: int | None = None,
              workload_counts: dict | None = None, last_session_arrival_s: float | None = None,
              max_model_len: int | None = None, workload_facts: dict | None = None,
              operator_sources: dict | None = None, slo: SloSpec | None = None) -> dict:
    done = requests[requests.status == "finished"]
    window = measurement_window(requests, warmup_s, exclude_drain, last_session_arrival_s)
    duration = window.duration_s
    measured = measured_requests(requests, window.start_s, window.end_s)
    kv = kv_fractions(timeline, window.start_s, window.end_s)
    kv = {"token_states_frac": kv["token_states_frac"], "reserved_frac": kv["reserved_frac"],
          "internal_frag_frac": kv["internal_frag_frac"],
          "external_frag_frac": kv["external_frag_frac"],
          "cached_idle_frac": kv["cached_idle_frac"], "free_frac": kv["free_frac"]}
    in_use = 1.0 - kv["free_frac"] - kv["cached_idle_frac"]
    wasted = kv["reserved_frac"] + kv["internal_frag_frac"] + kv["external_frag_frac"]
    kv["waste_frac"] = wasted / in_use if in_use > 0 else NO_DATA
    for name in USAGE_FIELDS:  # the same shares, named by their denominator
        kv[f"{name}_of_capacity"] = kv[f"{name}_frac"]
    kv["waste_of_used"] = kv["waste_frac"]
    kv["token_states_of_used"] = kv["token_states_frac"] / in_use if in_use > 0 else NO_DATA
    hit_tokens = int(done.prefix_hit_tokens.sum())
    prompt_tokens = int(done.prompt_tokens.sum())
    step_batch_sizes = timeline.batch_size[timeline.batch_size > 0]  # one column, not the table
    in_window = (timeline.time_s > window.start_s) & (timeline.time_s <= window.end_s)
    output_tokens = float(timeline.num_output_tokens[in_window].sum())
    finished_in_window = done[(done.finish_time_s > window.start_s) & (done.finish_time_s <= window.end_s)]
    if not (warmup_s or exclude_drain):  # the whole run: every finished request counts
        output_tokens, finished_in_window = float(done.total_output_tokens.sum()), done
    rate = (lambda amount: amount / duration) if duration > 0 else (lambda amount: 0.0)
    latency = {"ttft": _percentiles(measured.ttft_s), "tpot": _percentiles(measured.tpot_s),
               "e2e": _percentiles(measured.e2e_s), "itl": _itl(itl_samples, window)}
    throughput = {"requests_per_s": rate(len(finished_in_window)),
                  "output_tokens_per_s": rate(output_tokens),
                  "total_tokens_per_s": rate(output_tokens + float(finished_in_window.prompt_tokens.sum()))}
    num_workload = len(requests) if num_workload_requests is None else num_workload_requests
    arrived = (requests.arrival_time_s >= window.start_s) & (requests.arrival_time_s <= window.end_s)
    num_unfinished_measured = int((arrived & (requests.status != "finished")).sum())
    return {
        "num_requests": int(len(requests)),
        "num_finished": int(len(done)),
        "num_rejected": int((requests.status == "rejected").sum()),
        "sim_duration_s": window.last_finish_s - window.first_arrival_s,
        "wall_time_s": wall_time_s,
        "throughput": throughput,
        "latency_s": latency,
        "vllm_bench": vllm_bench_block(latency, throughput, len(finished_in_window)),
        "measurement": {**window.as_dict(), "duration_s": duration,
                        "num_measured_requests": int(len(measured)),
                        "num_finished_in_window": int(len(finished_in_window))},
        "unserved": _unserved(requests, num_workload, workload_counts or {}),
        "slo": slo_block(slo or SloSpec(), measured, num_unfinished_measured, duration, finished_in_window),
        "routing": routing_balance(done, int(timeline.replica.max()) + 1 if len(timeline) else 1),
        "kv": kv,
        "prefix_cache": {"hit_rate": hit_tokens / prompt_tokens if prompt_tokens else NO_DATA,
                         "hit_tokens": hit_tokens, "prompt_tokens": prompt_tokens},
        "scheduler": {"num_preemptions": int(done.num_preemptions.sum()),
                      "mean_batch_size": float(step_batch_sizes.mean()) if len(step_batch_sizes) else NO_DATA,
                      "num_steps": int(len(step_batch_sizes)),
                      "swapped_tokens": int(timeline.num_swapped_tokens.sum())},
        "latency_profile": {"gpu": gpu, "source": profile_source,
                            **({"operators": operator_sources} if operator_sources else {})},
        **({} if max_model_len is None else {"max_model_len": max_model_len}),
        **({} if workload_facts is None else {"workload": workload_facts}),
    }


def measured_requests(requests: pd.DataFrame, start_s: float, end_s: float) -> pd.DataFrame:
    """The finished requests that arrived in [start_s, end_s]: those latency_s and the SLOs measure."""
    done = requests[requests.status == "finished"]
    return done[(done.arrival_time_s >= start_s) & (done.arrival_time_s <= end_s)]


def busiest_over_mean(values) -> float:
    """The largest of per-replica amounts over their mean (1: even; 1 when nothing was done)."""
    total = sum(values)
    return float(max(values) / (total / len(values))) if total else 1.0


def routing_balance(done: pd.DataFrame, num_replicas: int) -> dict:
    """How the router spread the work: finished requests and prefilled prompt tokens (prompt
    minus prefix hit) per replica, and the busiest replica's over the mean (1: even)."""
    per_replica = done.groupby("replica")
    finished = per_replica.size().reindex(range(num_replicas), fill_value=0).to_numpy()
    prefilled = (done.prompt_tokens - done.prefix_hit_tokens).groupby(done.replica).sum() \
        .reindex(range(num_replicas), fill_value=0).to_numpy()
    return {"finished_requests_per_replica": [int(v) for v in finished],
            "prefilled_tokens_per_replica": [int(v) for v in prefilled],
            "busiest_over_mean_finished_requests": busiest_over_mean(finished),
            "busiest_over_mean_prefilled_tokens": busiest_over_mean(prefilled)}


def vllm_bench_block(latency: dict, throughput: dict, num_completed: int) -> dict:
    """The result keys of `vllm bench serve --save-result`, latencies in milliseconds;
    completed = requests finished inside the window, so request_throughput = completed / span."""
    block = {"completed": num_completed, "request_throughput": throughput["requests_per_s"],
             "output_throughput": throughput["output_tokens_per_s"],
             "total_token_throughput": throughput["total_tokens_per_s"]}
    for metric in ("ttft", "tpot", "itl", "e2e"):
        name = "e2el" if metric == "e2e" else metric  # vLLM's name for end-to-end latency
        values = latency[metric]
        block[f"mean_{name}_ms"] = values["mean"] * 1e3
        block[f"median_{name}_ms"] = values["p50"] * 1e3
        block[f"p99_{name}_ms"] = values["p99"] * 1e3
    return block


def flatten(metrics: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat
