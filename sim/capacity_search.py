"""`python -m sim capacity`: the highest arrival rate, or the fewest replicas, that meets the SLOs.

search=rate scales the workload's arrivals (every session's arrival time, relative to the first,
divided by the scale; think times and lengths unchanged) and bisects the scale: from the
workload as given it doubles (or halves) until the SLOs flip, then bisects until the bracket is
within `tolerance`. measure.warmup_s is compressed with the arrivals (the same share of the
arrival span is left out at every rate). The rate reported is the offered request rate at that scale: the workload's
requests over its sessions' arrival span. search=replicas keeps the workload's rate and finds the
fewest replicas (doubling, then bisecting). Either assumes that the SLOs hold below some rate (or
above some replica count) and fail beyond it; each step is one simulation, printed as it ends.
Each allocator is searched on its own.
"""
from __future__ import annotations

import dataclasses
import math
import sys

from sim.errors import ConfigError
from sim.run import Setup, simulate
from sim.slo import TARGETS
from sim.workload.request import Workload

SEARCHES = ("rate", "replicas")


@dataclasses.dataclass(frozen=True, slots=True)
class CapacitySpec:
    search: str = "rate"
    tolerance: float = 0.05   # stop when the bracket's high end is within this share of its low end
    max_steps: int = 16       # simulations per allocator at most
    max_replicas: int = 64    # search=replicas: the most replicas tried

    def __post_init__(self):
        if self.search not in SEARCHES:
            raise ConfigError(f"unknown capacity.search '{self.search}', key capacity.search, use rate or replicas")
        if not 0 < self.tolerance < 1 or self.max_steps < 2 or self.max_replicas < 1:
            raise ConfigError(f"capacity.tolerance={self.tolerance}, capacity.max_steps={self.max_steps}, "
                              f"capacity.max_replicas={self.max_replicas}: need a tolerance in (0, 1), "
                              f"at least 2 steps and 1 replica, key capacity, fix the values")


def scale_arrivals(workload: Workload, scale: float) -> Workload:
    """The workload offered `scale` times as fast: session arrivals compressed toward the first."""
    if not workload.sessions:
        return workload
    first = min(s.arrival_time_s for s in workload.sessions)
    sessions = tuple(dataclasses.replace(s, arrival_time_s=first + (s.arrival_time_s - first) / scale)
                     for s in workload.sessions)
    return dataclasses.replace(workload, sessions=sessions)


def offered_rate_rps(workload: Workload) -> float:
    """Requests over the span of session arrivals (every turn counted; inf for one instant)."""
    times = [s.arrival_time_s for s in workload.sessions]
    span = max(times) - min(times) if times else 0.0
    return workload.num_requests / span if span > 0 else math.inf


def step_row(allocator: str, step: int, setting: dict, metrics: dict) -> dict:
    slo = metrics["slo"]
    row = {"allocator": allocator, "step": step, **setting, "met": slo["all_met"],
           "num_measured_requests": slo["num_measured_requests"],
           "goodput_requests_per_s": slo["goodput_requests_per_s"],
           "attained_all_share_of_measured_requests": slo["attained_all_share_of_measured_requests"]}
    for name in TARGETS:
        if name in slo:
            row[f"{name}_p{slo['percentile']:g}_s"] = slo[name][f"p{slo['percentile']:g}_s"]
            row[f"{name}_target_s"] = slo[name]["target_s"]
    return row


def describe(row: dict) -> str:
    parts = []
    for name in TARGETS:
        key = next((k for k in row if k.startswith(f"{name}_p")), None)
        if key:
            value = row[key]
            shown = "never (unfinished requests)" if value is None else f"{value:.3f} s"
            parts.append(f"{name} {key.split('_')[1]} {shown} (target {row[f'{name}_target_s']:g} s)")
    where = (f"rate {row['rate_rps']:.3f} req/s (x{row['scale']:.4g})" if "rate_rps" in row
             else f"{row['num_replicas']} replicas")
    return (f"{row['allocator']} step {row['step']}: {where}: {', '.join(parts)} over "
            f"{row['num_measured_requests']} requests: {'met' if row['met'] else 'missed'}")


def search_rate(setup: Setup, workload: Workload, allocator: str, spec: CapacitySpec, run, say) -> tuple[dict, list]:
    base_rate = offered_rate_rps(workload)
    rows = []

    def meets(scale: float) -> bool:
        scaled_setup = dataclasses.replace(setup, spec=dataclasses.replace(setup.spec, warmup_s=setup.spec.warmup_s / scale))
        metrics = run(scale_arrivals(workload, scale), scaled_setup)
        rows.append(step_row(allocator, len(rows) + 1, {"scale": scale, "rate_rps": base_rate * scale}, metrics))
        say(describe(rows[-1]))
        return rows[-1]["met"]

    def flat() -> bool:
        """Two misses in a row whose SLO percentiles moved by under 1%: a lower rate will not
        meet the targets either (they are below an idle replica's latency)."""
        if len(rows) < 2 or rows[-1]["met"] or rows[-2]["met"]:
            return False
        keys = [k for k in rows[-1] if k.startswith(tuple(f"{name}_p" for name in TARGETS)) and not k.endswith("target_s")]
        return all(rows[-1][k] is not None and rows[-2][k] is not None
                   and abs(rows[-1][k] - rows[-2][k]) <= 0.01 * abs(rows[-2][k]) for k in keys)

    low, high = _bracket(meets, 1.0, spec.max_steps, flat)
    while low is not None and high is not None and high / low - 1 > spec.tolerance and len(rows) < spec.max_steps:
        middle = math.sqrt(low * high)  # geometric: rates span orders of magnitude
        low, high = (middle, high) if meets(middle) else (low, middle)
    result = {"max_rate_rps": base_rate * low if low is not None else 0.0,
              "max_rate_scale": low if low is not None else 0.0,
              "first_missed_rate_rps": base_rate * high if high is not None else None,
              "base_rate_rps": base_rate, "num_steps": len(rows),
              "bracketed": low is not None and high is not None,
              "unreachable": low is None and flat()}
    return result, rows


def _bracket(meets, start: float, max_steps: int, flat=lambda: False):
    """(highest scale seen meeting, lowest seen missing), doubling or halving from start; None
    where the steps ran out first, or halving stopped because lower rates no longer help (flat)."""
    if meets(start):
        low, high, steps = start, None, 1
        while high is None and steps < max_steps:
            candidate, steps = low * 2, steps + 1
            low, high = (candidate, None) if meets(candidate) else (low, candidate)
        return low, high
    low, high, steps = None, start, 1
    while low is None and steps < max_steps and not flat():
        candidate, steps = high / 2, steps + 1
        low, high = (candidate, high) if meets(candidate) else (None, candidate)
    return low, high


def search_replicas(setup: Setup, workload: Workload, allocator: str, spec: CapacitySpec, run, say) -> tuple[dict, list]:
    rows, seen = [], {}

    def meets(replicas: int) -> bool:
        if replicas not in seen:
            sized = dataclasses.replace(setup, spec=dataclasses.replace(setup.spec, num_replicas=replicas))
            metrics = run(workload, sized)
            rows.append(step_row(allocator, len(rows) + 1, {"num_replicas": replicas}, metrics))
            say(describe(rows[-1]))
            seen[replicas] = rows[-1]["met"]
        return seen[replicas]

    low, high = 0, 1  # low misses (0 replicas serve nothing), high is being tried
    while not meets(high):
        if high >= spec.max_replicas or len(rows) >= spec.max_steps:
            high = None
            break
        low, high = high, min(2 * high, spec.max_replicas)
    while high is not None and high - low > 1 and len(rows) < spec.max_steps:
        middle = (low + high) // 2
        low, high = (low, middle) if meets(middle) else (middle, high)
    gpus = setup.spec.gpus_per_replica
    result = {"min_replicas": high, "min_gpus": None if high is None else high * gpus,
              "rate_rps": offered_rate_rps(workload), "num_steps": len(rows),
              "bracketed": high is not None and high - low <= 1}
    return result, rows


def run_search(setup: Setup, workload: Workload, allocator: str, spec: CapacitySpec, router_cfg,
               queue_order_cfg, say=lambda line: print(line, file=sys.stderr)) -> tuple[dict, list]:
    def run(scaled: Workload, sized: Setup) -> dict:
        return simulate(sized, scaled, allocator, router_cfg, queue_order_cfg=queue_order_cfg).metrics

    search = search_rate if spec.search == "rate" else search_replicas
    return search(setup, workload, allocator, spec, run, say)


def plot_search(rows, results: dict, path, title: str, search: str) -> None:
    """Each step's SLO percentiles over their targets (1 = at the target) against the rate or
    the replica count, per allocator; dashed: the capacity found."""
    from sim.report import _pyplot, _save
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    x_key = "rate_rps" if search == "rate" else "num_replicas"
    for index, allocator in enumerate(dict.fromkeys(row["allocator"] for row in rows)):
        color = f"C{index}"
        mine = sorted((row for row in rows if row["allocator"] == allocator), key=lambda row: row[x_key])
        for marker, name in zip("os^", TARGETS):
            key = next((k for k in mine[0] if k.startswith(f"{name}_p")), None) if mine else None
            if key:
                ratios = [math.nan if row[key] is None else row[key] / row[f"{name}_target_s"] for row in mine]
                ax.plot([row[x_key] for row in mine], ratios, marker=marker, color=color,
                        label=f"{allocator} {name}")
        found = results[allocator].get("max_rate_rps" if search == "rate" else "min_replicas")
        if found:
            ax.axvline(found, color=color, linestyle="--", linewidth=1)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("offered request rate (req/s)" if search == "rate" else "replicas")
    ax.set_ylabel("SLO percentile / target (1 = at the target)")
    if search == "rate":
        ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    _save(fig, path)
    plt.close(fig)
