"""Service-level objectives: latency targets, whether a run meets them, and goodput.

A request meets the SLOs when it finished and each set target holds for it (TTFT, TPOT, E2E; a
request with one output token has no TPOT and meets that target). A run meets them when each set
target holds at `percentile` over the measured requests (the requests that arrived in the
measurement window; a request that arrived there and did not finish counts as missing every
target). Goodput is the rate of requests that finished in the window and meet every target,
per second of the window (DistServe's "requests that meet the SLOs per second"): the requests
throughput.requests_per_s counts, less those that missed a target, so never above it.
Attainment is a share of the measured requests.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from sim.errors import ConfigError

TARGETS = ("ttft", "tpot", "e2e")


@dataclass(frozen=True, slots=True)
class SloSpec:
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    percentile: float = 90.0

    @property
    def targets(self) -> dict[str, float]:
        """The set targets: metric -> seconds."""
        given = {"ttft": self.ttft_s, "tpot": self.tpot_s, "e2e": self.e2e_s}
        return {name: value for name, value in given.items() if value is not None}


def slo_spec(values: dict) -> SloSpec:
    spec = SloSpec(values.get("ttft_s"), values.get("tpot_s"), values.get("e2e_s"),
                   float(values.get("percentile", 90.0)))
    for name, value in spec.targets.items():
        if not value > 0:
            raise ConfigError(f"slo.{name}_s={value} is not positive, key slo.{name}_s, "
                              f"give seconds > 0 or null (no target)")
    if not 0 < spec.percentile <= 100:
        raise ConfigError(f"slo.percentile={spec.percentile} is not in (0, 100], key slo.percentile, "
                          f"use e.g. 90 (the default) or 99")
    return spec


def _meets(spec: SloSpec, requests: pd.DataFrame, name: str) -> np.ndarray:
    """Per finished request: whether its `name` target holds (no TPOT with one output token)."""
    values = requests[f"{name}_s"].to_numpy(dtype=float)
    target = spec.targets[name]
    return np.isnan(values) | (values <= target) if name == "tpot" else values <= target


def slo_block(spec: SloSpec, measured: pd.DataFrame, num_unfinished_measured: int,
              duration_s: float, finished_in_window: pd.DataFrame | None = None) -> dict:
    """metrics.json's `slo` block. measured: finished requests that arrived in the window;
    num_unfinished_measured: those that arrived there and never finished (rejected or unserved);
    finished_in_window: the requests finished in the window (goodput's; default: measured)."""
    finished_in_window = measured if finished_in_window is None else finished_in_window
    total = len(measured) + num_unfinished_measured
    good = np.ones(len(finished_in_window), dtype=bool)
    meets_all = np.ones(len(measured), dtype=bool)
    block: dict = {"percentile": spec.percentile, "num_measured_requests": total}
    all_met = True
    for name, target in spec.targets.items():
        values = measured[f"{name}_s"].to_numpy(dtype=float)
        meets = _meets(spec, measured, name)
        meets_all &= meets
        good &= _meets(spec, finished_in_window, name)
        at = _percentile_with_missing(values, num_unfinished_measured, spec.percentile, name == "tpot")
        met = at <= target
        all_met &= met
        block[name] = {"target_s": target, f"p{spec.percentile:g}_s": at if math.isfinite(at) else None,
                       "met": bool(met),
                       "attained_share_of_measured_requests": float(meets.sum()) / total if total else math.nan}
    block["all_met"] = bool(all_met) and total > 0
    block["attained_all_share_of_measured_requests"] = int(meets_all.sum()) / total if total else math.nan
    block["goodput_requests_per_s"] = int(good.sum()) / duration_s if duration_s > 0 else 0.0
    return block


def _percentile_with_missing(values: np.ndarray, num_missing: int, percentile: float, skip_nan: bool) -> float:
    """The percentile (numpy's default, as latency_s) over the values and num_missing requests
    counted as infinitely late."""
    data = values[~np.isnan(values)] if skip_nan else values
    data = np.concatenate((data, np.full(num_missing, math.inf)))
    if data.size == 0:
        return 0.0
    with np.errstate(invalid="ignore"):  # inf - inf between two missing requests: nan, read as inf
        at = float(np.percentile(data, percentile))
    return math.inf if math.isnan(at) else at
