"""kvsim's grouped GEMMs (a MoE layer's experts) against vLLM's published fused_moe kernel times.

vLLM's Triton fused_moe runs each expert's tokens as tiles of one kernel; kvsim times it as the
dense GEMM of the experts' summed work, corrected at each expert's share of the tokens
(sim.latency.calibrated.CalibratedGemm.grouped_time), at a share of the dense GEMM's compute and
memory efficiencies. fit_shares finds the two shares that best match measured times (least
squares of log(kvsim / measured) over a grid); sim.latency.calibrated holds the shares fitted to
the `fit` rows of calibration/published/fused_moe_times.csv, and tests/test_moe_kernels.py
checks them against its held-out rows.

    python -m calibration.grouped_gemm     # the fit and kvsim / measured per row and role
"""
from __future__ import annotations

import csv
import dataclasses
import math
import statistics
from importlib import resources

from sim.latency.model import LatencyModel, group_quant_bytes, moe_quant_widths
from sim.latency.operators import copy_work
from sim.latency.profile import load_profile
from sim.models import ModelSpec, load_model

SHARE_GRID = tuple(x / 100 for x in range(40, 101, 2))
# A row's dtype: kvsim's weight dtype and block size (DeepSeek's checkpoints scale 128 x 128 blocks).
DTYPES = {"bf16": ("bf16", 0), "fp8": ("fp8", 0), "fp8_block": ("fp8", 128)}
SHAPE_COLUMNS = ("model", "gpu", "tensor_parallel_size", "dtype", "num_experts", "num_active_experts",
                 "hidden_size", "expert_intermediate_size")


def published_rows(role: str | None = None) -> list[dict]:
    """Rows of calibration/published/fused_moe_times.csv (all, or those of one role)."""
    text = (resources.files("calibration") / "published" / "fused_moe_times.csv").read_text()
    return [row for row in csv.DictReader(text.splitlines()) if role is None or row["role"] == role]


def moe_model(row: dict) -> ModelSpec:
    """A MoE model of the row's experts (what fused_moe runs; the rest of the model is never timed)."""
    if row["dtype"] not in DTYPES:
        raise ValueError(f"fused_moe row {row['model']} batch {row['batch_size']}: dtype {row['dtype']!r} "
                         f"is none of {', '.join(DTYPES)}")
    weight_dtype, block = DTYPES[row["dtype"]]
    return dataclasses.replace(
        load_model("llama31_8b"), name=row["model"], hidden_size=int(row["hidden_size"]),
        num_experts=int(row["num_experts"]), num_active_experts=int(row["num_active_experts"]),
        expert_intermediate_size=int(row["expert_intermediate_size"]), num_shared_experts=0, num_dense_layers=0,
        weight_dtype=weight_dtype, weight_block_size=block)


class FusedMoeBench:
    """kvsim's fused_moe time for each row, at any grouped-GEMM shares (one latency model per
    distinct model, GPU, TP, dtype and expert shape among the rows)."""

    def __init__(self, rows: list[dict]):
        self.rows = rows
        self._latency: dict[tuple, LatencyModel] = {}
        for row in rows:
            key = tuple(row[c] for c in SHAPE_COLUMNS)
            if key not in self._latency:
                self._latency[key] = LatencyModel(moe_model(row), load_profile(row["gpu"]),
                                                  int(row["tensor_parallel_size"]), "bf16")

    def predicted_us(self, shares: tuple[float, float] | None = None) -> list[float]:
        """MoeLayer.fused_time per row, plus for block-scaled FP8 the two per-token-group
        quantizations vLLM's fused_experts runs inside the call (kvsim counts them with the
        layer's other elementwise kernels)."""
        times = []
        for row in self.rows:
            latency = self._latency[tuple(row[c] for c in SHAPE_COLUMNS)]
            tokens = int(row["batch_size"])
            kept = latency.gemm.grouped_shares
            if shares is not None:
                latency.gemm.grouped_shares = shares
            try:
                seconds = latency.moe.fused_time(tokens)
            finally:
                latency.gemm.grouped_shares = kept
            if row["dtype"] == "fp8_block":
                widths = moe_quant_widths(latency.model, latency.tp)
                seconds += sum(latency.elementwise_op.time("stream", tokens * group_quant_bytes(w), copy_work)
                               for w in widths)
            times.append(seconds * 1e6)
        return times

    def ratios(self, shares: tuple[float, float] | None = None) -> list[float]:
        """kvsim / measured per row."""
        return [p / float(row["time_us"]) for p, row in zip(self.predicted_us(shares), self.rows, strict=True)]


def fit_shares(bench: FusedMoeBench, measured_us: list[float] | None = None) -> tuple[float, float]:
    """(compute share, memory share) on SHARE_GRID minimising the mean squared log ratio of
    kvsim's times to measured_us (by default the rows' published times). Raises ValueError when
    the rows leave a share unconstrained (the error flat along it) or put it on the grid's
    lower edge (the grid too narrow)."""
    measured = [float(row["time_us"]) for row in bench.rows] if measured_us is None else measured_us
    errors = {}
    for compute in SHARE_GRID:
        for memory in SHARE_GRID:
            predicted = bench.predicted_us((compute, memory))
            errors[compute, memory] = sum(math.log(p / m) ** 2 for p, m in zip(predicted, measured, strict=True)) / len(measured)
    best = min(errors, key=lambda shares: (errors[shares], -shares[0], -shares[1]))
    for axis, name in enumerate(("compute", "memory")):
        along = [errors[(s, best[1]) if axis == 0 else (best[0], s)] for s in SHARE_GRID]
        if max(along) - min(along) < 1e-12:
            raise ValueError(f"the rows do not constrain the {name} share (their error is the same at every value)")
        if best[axis] == SHARE_GRID[0]:
            raise ValueError(f"the best {name} share is the grid's lowest, {SHARE_GRID[0]}: widen SHARE_GRID")
    return best


def main() -> None:
    fit = fit_shares(FusedMoeBench(published_rows("fit")))
    print(f"fitted grouped-GEMM shares: compute {fit[0]:.2f}, memory {fit[1]:.2f}")
    for role in ("fit", "held_out", "known_gap"):
        bench = FusedMoeBench(published_rows(role))
        ratios = bench.ratios()
        print(f"{role}: median kvsim/measured {statistics.median(ratios):.2f}")
        for row, ratio in zip(bench.rows, ratios, strict=True):
            print(f"  {row['model']:<14} {row['gpu']:<5} tp {row['tensor_parallel_size']} {row['dtype']:<9} "
                  f"batch {row['batch_size']:>5}: measured {float(row['time_us']):8.1f} us, kvsim/measured {ratio:.2f}")


if __name__ == "__main__":
    main()
