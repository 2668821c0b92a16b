"""kvsim's grouped GEMMs (a MoE layer's experts) against published fused_moe kernel times.

vLLM's and SGLang's Triton fused_moe run each expert's tokens as tiles of one kernel; kvsim times
it as the dense GEMM of the experts' summed work, corrected at each expert's share of the tokens,
at shares of the dense GEMM's compute and memory efficiencies, with its own fixed cost and a cost
per touched expert (sim.latency.calibrated.CalibratedGemm.grouped_time, GroupedKernel). fit_grouped
finds the four that best match measured times (least squares of log(kvsim / measured) over
grids); sim.latency.calibrated.GROUPED holds the fit to the `fit` rows of
calibration/published/fused_moe_times.csv, and tests/test_moe_kernels.py checks it against the
held-out rows.

    python -m calibration.grouped_gemm     # the fit and kvsim / measured per row and role
"""
from __future__ import annotations

import csv
import dataclasses
import itertools
import math
import statistics
from importlib import resources

from sim.latency.calibrated import GroupedKernel
from sim.latency.model import LatencyModel, group_quant_bytes, moe_quant_widths
from sim.latency.operators import copy_work
from sim.latency.profile import load_profile
from sim.models import ModelSpec, load_model

SHARE_GRID = tuple(x / 100 for x in range(40, 101, 2))
T0_GRID = tuple(x * 1e-6 for x in range(0, 15))                # the grouped kernel's fixed cost, s
PER_GROUP_GRID = tuple(x * 1e-8 for x in range(0, 41, 2))       # per touched expert, 0-0.4 us
MEMORY_GRID = tuple(x / 100 for x in range(60, 101, 2))       # searched jointly with the two costs
GRIDS = (SHARE_GRID, MEMORY_GRID, T0_GRID, PER_GROUP_GRID)
NAMES = ("compute_share", "memory_share", "t0_s", "per_group_s")
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
    """kvsim's fused_moe time for each row, at any GroupedKernel (one latency model per
    distinct model, GPU, TP, dtype and expert shape among the rows)."""

    def __init__(self, rows: list[dict]):
        self.rows = rows
        self._latency: dict[tuple, LatencyModel] = {}
        for row in rows:
            key = tuple(row[c] for c in SHAPE_COLUMNS)
            if key not in self._latency:
                self._latency[key] = LatencyModel(moe_model(row), load_profile(row["gpu"]),
                                                  int(row["tensor_parallel_size"]), "bf16")

    def predicted_us(self, grouped: GroupedKernel | None = None) -> list[float]:
        """MoeLayer.fused_time per row, plus for block-scaled FP8 the two per-token-group
        quantizations vLLM's fused_experts runs inside the call (kvsim counts them with the
        layer's other elementwise kernels)."""
        times = []
        for row in self.rows:
            latency = self._latency[tuple(row[c] for c in SHAPE_COLUMNS)]
            tokens = int(row["batch_size"])
            kept = latency.gemm.grouped
            if grouped is not None:
                latency.gemm.grouped = grouped
            try:
                seconds = latency.moe.fused_time(tokens)
            finally:
                latency.gemm.grouped = kept
            if row["dtype"] == "fp8_block":
                widths = moe_quant_widths(latency.model, latency.tp)
                seconds += sum(latency.elementwise_op.time("stream", tokens * group_quant_bytes(w), copy_work)
                               for w in widths)
            times.append(seconds * 1e6)
        return times

    def ratios(self, grouped: GroupedKernel | None = None) -> list[float]:
        """kvsim / measured per row."""
        return [p / float(row["time_us"]) for p, row in zip(self.predicted_us(grouped), self.rows, strict=True)]


def _constrained(errors: dict, axis: int) -> None:
    if max(errors.values()) - min(errors.values()) < 1e-12:
        raise ValueError(f"the rows do not constrain the {NAMES[axis]} (their error is the same at every value)")


def fit_grouped(bench: FusedMoeBench, measured_us: list[float] | None = None,
                start: GroupedKernel = GroupedKernel(0.8, 0.8, 7e-6, 0.2e-6)) -> GroupedKernel:
    """The GroupedKernel on GRIDS minimising the mean squared log ratio of kvsim's times to
    measured_us (by default the rows' published times): from `start`, the compute share alone and
    then the memory share, the fixed cost and the cost per group together (they trade against each
    other: one at a time stops short of the optimum), until nothing moves. Raises ValueError when
    the rows leave a parameter unconstrained (the error flat along it) or put a share on its grid's
    lower edge."""
    measured = [float(row["time_us"]) for row in bench.rows] if measured_us is None else measured_us

    def error(values: tuple) -> float:
        predicted = bench.predicted_us(GroupedKernel(*values))
        return sum(math.log(p / m) ** 2 for p, m in zip(predicted, measured, strict=True)) / len(measured)
    best = tuple(min(grid, key=lambda g, v=v: abs(g - v)) for grid, v in zip(GRIDS, (
        start.compute_share, start.memory_share, start.t0_s, start.per_group_s)))
    for _ in range(20):
        along = {value: error((value,) + best[1:]) for value in SHARE_GRID}
        _constrained(along, 0)
        compute = min(along, key=lambda v: (along[v], -v))
        joint = {rest: error((compute,) + rest)
                 for rest in itertools.product(MEMORY_GRID, T0_GRID, PER_GROUP_GRID)}
        for axis in (1, 2, 3):
            _constrained({rest: e for rest, e in joint.items()
                          if all(rest[i - 1] == best[i] for i in (1, 2, 3) if i != axis)}, axis)
        moved = (compute,) + min(joint, key=lambda r: (joint[r], -r[0], -r[1], -r[2]))
        if moved == best:
            break
        best = moved
    for axis in (0, 1):
        if best[axis] == GRIDS[axis][0]:
            raise ValueError(f"the best {NAMES[axis]} is its grid's lowest, {GRIDS[axis][0]}: widen the grid")
    return GroupedKernel(*best)


def main() -> None:
    fit = fit_grouped(FusedMoeBench(published_rows("fit")))
    print(f"fitted grouped kernel: compute share {fit.compute_share:.2f}, memory share {fit.memory_share:.2f}, "
          f"fixed cost {fit.t0_s * 1e6:g} us, {fit.per_group_s * 1e6:.2f} us per touched expert")
    for role in ("fit", "held_out", "known_gap"):
        bench = FusedMoeBench(published_rows(role))
        ratios = bench.ratios()
        print(f"{role}: median kvsim/measured {statistics.median(ratios):.2f}")
        for row, ratio in zip(bench.rows, ratios, strict=True):
            print(f"  {row['model']:<14} {row['gpu']:<5} tp {row['tensor_parallel_size']} {row['dtype']:<9} "
                  f"batch {row['batch_size']:>5}: measured {float(row['time_us']):8.1f} us, kvsim/measured {ratio:.2f}")


if __name__ == "__main__":
    main()
