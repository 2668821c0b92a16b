"""kvsim's grouped GEMMs (a MoE layer's experts) against vLLM's published fused_moe kernel times.

vLLM's Triton fused_moe runs each expert's tokens as tiles of one kernel; kvsim times it as the
dense GEMM of the experts' summed work, corrected at each expert's share of the tokens
(sim.latency.calibrated.CalibratedGemm.grouped_time), at a share of the dense GEMM's compute and
memory efficiencies. fit_shares finds the two shares that best match measured times (least
squares of log(kvsim / measured) over a grid); sim.latency.calibrated holds the shares fitted to
the `fit` rows of calibration/published/fused_moe_times.csv, and tests/test_moe_kernels.py
checks them against its held-out rows.
"""
from __future__ import annotations

import csv
import dataclasses
import math
from importlib import resources

from sim.latency.model import LatencyModel
from sim.latency.profile import load_profile
from sim.models import ModelSpec, load_model

SHARE_GRID = tuple(x / 100 for x in range(40, 101, 2))
BLOCK_SIZE = 128  # DeepSeek's block-scaled FP8 checkpoints scale 128 x 128 blocks


def published_rows(role: str | None = None) -> list[dict]:
    """Rows of calibration/published/fused_moe_times.csv (all, or those of one role)."""
    text = (resources.files("calibration") / "published" / "fused_moe_times.csv").read_text()
    return [row for row in csv.DictReader(text.splitlines()) if role is None or row["role"] == role]


def moe_model(row: dict) -> ModelSpec:
    """A MoE model of the row's experts (what fused_moe runs; the rest of the model is never timed)."""
    return dataclasses.replace(
        load_model("llama31_8b"), name=row["model"], hidden_size=int(row["hidden_size"]),
        num_experts=int(row["num_experts"]), num_active_experts=int(row["num_active_experts"]),
        expert_intermediate_size=int(row["expert_intermediate_size"]), num_shared_experts=0, num_dense_layers=0,
        weight_dtype="bf16" if row["dtype"] == "bf16" else "fp8",
        weight_block_size=BLOCK_SIZE if row["dtype"] == "fp8_block" else 0)


class FusedMoeBench:
    """kvsim's fused_moe time for each row, at any grouped-GEMM shares (one latency model per
    model, GPU and TP among the rows)."""

    def __init__(self, rows: list[dict]):
        self.rows = rows
        self._latency: dict[tuple, LatencyModel] = {}
        for row in rows:
            key = (row["model"], row["gpu"], row["tensor_parallel_size"])
            if key not in self._latency:
                self._latency[key] = LatencyModel(moe_model(row), load_profile(row["gpu"]),
                                                  int(row["tensor_parallel_size"]), "bf16")

    def predicted_us(self, shares: tuple[float, float] | None = None) -> list[float]:
        times = []
        for row in self.rows:
            latency = self._latency[(row["model"], row["gpu"], row["tensor_parallel_size"])]
            kept = latency.gemm.grouped_shares
            if shares is not None:
                latency.gemm.grouped_shares = shares
            try:
                times.append(latency.moe.fused_time(int(row["batch_size"])) * 1e6)
            finally:
                latency.gemm.grouped_shares = kept
        return times

    def ratios(self, shares: tuple[float, float] | None = None) -> list[float]:
        """kvsim / measured per row."""
        return [p / float(row["time_us"]) for p, row in zip(self.predicted_us(shares), self.rows)]


def fit_shares(bench: FusedMoeBench, measured_us: list[float] | None = None) -> tuple[float, float]:
    """(compute share, memory share) on SHARE_GRID minimising the mean squared log ratio of
    kvsim's times to measured_us (by default the rows' published times); ties go to the
    larger shares."""
    measured = measured_us or [float(row["time_us"]) for row in bench.rows]
    best, best_error = (1.0, 1.0), math.inf
    for compute in reversed(SHARE_GRID):
        for memory in reversed(SHARE_GRID):
            predicted = bench.predicted_us((compute, memory))
            error = sum(math.log(p / m) ** 2 for p, m in zip(predicted, measured)) / len(measured)
            if error < best_error - 1e-12:
                best, best_error = (compute, memory), error
    return best
