"""Calibrated operator times: a fitted roofline times an interpolated correction table.

    t(shape) = t0 + max(FLOPs / (peak * e_c), bytes / (bandwidth * e_m))      (fitted roofline)
    t'(shape) = t(shape) * c(x)    c = measured / fitted, interpolated over x = log2 of the op's
                                   size axis (tokens, context or bytes) for the shape's class,
                                   held at the table's edges; the op-wide table for classes
                                   never measured

made monotone in x (the corrected times at the grid points take a cumulative maximum and are
interpolated between them) and never below the datasheet roofline (e_c = e_m = 1, t0 = 0); for
GEMMs that roofline's bandwidth is the share of it the GPU's best measured read kernel reaches
(the profile's `gemm_ceiling`): a correction fitted where the fixed cost dominates would otherwise
time a weight-bound GEMM larger than any it saw at the full datasheet bandwidth. Where a profile
has measured small GEMM kernels (`gemm_floor`), no GEMM kernel is timed under their geometric mean.
Pure Python over a profile's JSON: the simulator and `python -m calibration predict` share it.
"""
from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, replace
from typing import Callable

from sim.latency.operators import gemm_class, gemm_work
from sim.latency.profile import QUANTIZED_GEMMS


@dataclass(frozen=True, slots=True)
class Roofline:
    peak_flops: float
    bandwidth: float
    compute_efficiency: float
    memory_efficiency: float
    t0_s: float
    per_seq_s: float = 0.0
    causal_efficiency: float | None = None  # of causal FLOPs (sim.latency.operators); None: e_c
    bandwidth_ceiling: float = 1.0  # the floor's share of bandwidth (GEMMs: gemm_ceiling)
    kernel_floor_s: float = 0.0     # the least time one kernel takes (GEMMs: gemm_floor)

    def time(self, flops: float, nbytes: float, num_seqs: float = 0.0, causal_flops: float = 0.0) -> float:
        compute = flops / (self.peak_flops * self.compute_efficiency)
        if causal_flops:
            compute += causal_flops / (self.peak_flops * (self.causal_efficiency or self.compute_efficiency))
        return self.t0_s + self.per_seq_s * num_seqs + max(
            compute, nbytes / (self.bandwidth * self.memory_efficiency))

    def floor_time(self, flops: float, nbytes: float, num_seqs: float = 0.0, causal_flops: float = 0.0) -> float:
        """The roofline no corrected time goes below: the datasheet's peak and its bandwidth at
        bandwidth_ceiling, and never under kernel_floor_s."""
        return max((flops + causal_flops) / self.peak_flops, nbytes / (self.bandwidth * self.bandwidth_ceiling),
                   self.kernel_floor_s)


@dataclass(frozen=True, slots=True)
class CorrectionTable:
    grid: tuple[float, ...]                 # x = log2(size), increasing
    factors: tuple[float, ...]              # op-wide factor per grid point
    classes: dict                           # shape class -> factors per grid point

    @classmethod
    def from_json(cls, data: dict | None) -> "CorrectionTable | None":
        if not data:
            return None
        return cls(tuple(data["grid"]), tuple(data["factors"]),
                   {key: tuple(values) for key, values in data.get("classes", {}).items()})

    def to_json(self) -> dict:
        return {"x": "log2 size", "grid": list(self.grid), "factors": list(self.factors),
                "classes": {key: list(values) for key, values in self.classes.items()}}


Work = Callable[[float], tuple[float, float]]  # size -> (FLOPs, bytes) for one shape class


class CalibratedOp:
    """Time of one operator kind; shapes come as (class, size, work function of the size).

    With monotone=True (GEMMs: a class fixes the work as a function of the size) the corrected
    times are made monotone in the size; otherwise (attention: a class leaves the batch or the
    cached context free) the factor is interpolated and applied as it is."""

    def __init__(self, roofline: Roofline, table: CorrectionTable | None, monotone: bool = True):
        self.roofline, self.table, self.monotone = roofline, table, monotone
        self._monotone: dict[str, list[float]] = {}

    def time(self, shape_class: str, size: float, work: Work) -> float:
        amounts = work(size)
        if self.monotone and self.table is not None and size > 0:
            roof = self.roofline
            return self._monotone_time(shape_class, size, work, roof.time(*amounts), roof.floor_time(*amounts))
        return self.corrected(shape_class, size, amounts)

    def corrected(self, shape_class: str, size: float, amounts, floor_amounts=None) -> float:
        """The fitted time of this work times the class's factor at size (interpolated, not made
        monotone), never below the datasheet roofline (of floor_amounts where the fitted work is
        scaled, as a grouped GEMM's is)."""
        roof = self.roofline
        fitted, floor = roof.time(*amounts), roof.floor_time(*(floor_amounts or amounts))
        if self.table is None or size <= 0:
            return max(fitted, floor)
        return max(fitted * self.factor(shape_class, size), floor)

    def factor(self, shape_class: str, size: float) -> float:
        """The correction factor at size, interpolated in log2(size), held at the edges."""
        table = self.table
        factors = table.classes.get(shape_class, table.factors)
        grid, x = table.grid, math.log2(size)
        if x <= grid[0]:
            return factors[0]
        if x >= grid[-1]:
            return factors[-1]
        i = bisect_right(grid, x) - 1
        return factors[i] + (factors[i + 1] - factors[i]) * ((x - grid[i]) / (grid[i + 1] - grid[i]))

    def _monotone_time(self, shape_class: str, size: float, work: Work, fitted: float, floor: float) -> float:
        table = self.table
        factors = table.classes.get(shape_class, table.factors)
        grid, x = table.grid, math.log2(size)
        if x < grid[0]:
            return max(fitted * factors[0], floor)
        monotone = self._monotone_grid(shape_class, factors, work)
        if x >= grid[-1]:
            return max(fitted * factors[-1], monotone[-1], floor)
        i = bisect_right(grid, x) - 1
        w = (x - grid[i]) / (grid[i + 1] - grid[i])
        return max(monotone[i] + (monotone[i + 1] - monotone[i]) * w, floor)

    def _monotone_grid(self, shape_class: str, factors, work: Work) -> list[float]:
        cached = self._monotone.get(shape_class)
        if cached is None:
            running, cached = 0.0, []
            for x, factor in zip(self.table.grid, factors):
                running = max(running, self.roofline.time(*work(2.0 ** x)) * factor)
                cached.append(running)
            self._monotone[shape_class] = cached
        return cached


@dataclass(frozen=True, slots=True)
class GroupedKernel:
    """How a fused MoE kernel's grouped GEMMs differ from the dense GEMM: shares of its compute and
    memory efficiencies, its own fixed cost (where below the dense GEMM's) and a cost per group
    (each touched expert's tiles start and drain apart)."""
    compute_share: float
    memory_share: float
    t0_s: float
    per_group_s: float


# vLLM's and SGLang's Triton fused_moe, fitted (calibration/grouped_gemm.py) to the fused_moe times
# vLLM PR #24700 published for Mixtral-8x7B (BF16, TP 2, H100, batch 1-1,536) and SGLang PR #11730
# for Qwen3-235B-A22B (per-tensor FP8, TP 8: 192 of each expert's columns a GPU, H200, batch 1-32):
# kvsim/measured 0.90-1.08 and 0.94-1.03 with them. Checked on rows the fit never sees
# (tests/test_moe_kernels.py): DeepSeek-R1's block-scaled FP8 experts on an H200 (PR #36554, batch
# 1-8) 0.96-1.04, and Qwen3-30B-A3B's 128 small per-tensor FP8 experts on an H100 (PR #24700) at
# batch 1-128 0.88-0.98 (0.85-1.09 with the 0.80/0.84 shares alone; these rows were labelled
# held-out after the model was chosen, on seeing the kernel change regime above 128 tokens), its
# larger batches still far too fast (a known gap), and Gemma 4's 128 BF16 experts on an H200 (PR
# #44818, batch 8-1,536, added 2026-12-06) 0.92-1.07. Until 2026-12-05 only the two shares were fitted,
# to Mixtral alone (0.80/0.88, then 0.80/0.84 under the read ceiling), and TP-8 expert slices at
# 32 tokens came out 0.74.
GROUPED = GroupedKernel(compute_share=0.80, memory_share=0.80, t0_s=7e-6, per_group_s=0.16e-6)


class CalibratedGemm:
    """GEMM time for (m, n, k, dtype): fp8 runs against the fp8 peak where the GPU has one, nvfp4
    against the fp4 peak (sim.run refuses nvfp4 on a GPU without one)."""

    def __init__(self, ops_by_dtype: dict[str, CalibratedOp], grouped: GroupedKernel = GROUPED):
        self.ops_by_dtype = ops_by_dtype
        self.grouped = grouped
        self._grouped_ops: dict[tuple[str, float], CalibratedOp] = {}  # by dtype and grouped fixed cost

    def _op(self, dtype: str) -> tuple[CalibratedOp, str]:
        """The calibrated op for a GEMM dtype and the dtype its operands are stored in."""
        return self.ops_by_dtype.get(dtype) or self.ops_by_dtype["default"], "fp8" if dtype == FP8_BLOCK else dtype

    def time(self, m: float, n: float, k: float, dtype: str) -> float:
        op, stored = self._op(dtype)
        return op.time(gemm_class(n, k, dtype), m, lambda size: gemm_work(size, n, k, stored))

    def grouped_time(self, m: float, groups: float, n: float, k: float, dtype: str) -> float:
        """One grouped-GEMM kernel of `groups` (m x k) @ (k x n) products (MoE experts): their
        summed work at the grouped kernel's shares of the dense GEMM's efficiencies, its own fixed
        cost, the correction at the per-group m (small groups run small, inefficient tiles) and a
        cost per group."""
        op, stored = self._op(dtype)
        flops, nbytes = gemm_work(m, n, k, stored)
        g = self.grouped
        grouped_op = self._grouped_ops.get((dtype, g.t0_s))
        if grouped_op is None:
            roof = op.roofline
            grouped_op = self._grouped_ops[dtype, g.t0_s] = CalibratedOp(
                replace(roof, t0_s=min(roof.t0_s, g.t0_s)), op.table, op.monotone)
        # Never below the roofline of its compute at the share and of its bytes at the read ceiling
        # (vLLM's fused_moe reads Mixtral's experts at 0.89 of the H100's datasheet bandwidth)
        amounts = (groups * flops / g.compute_share, groups * nbytes / g.memory_share)
        return (grouped_op.corrected(gemm_class(n, k, dtype), m, amounts, (amounts[0], groups * nbytes))
                + groups * g.per_group_s)


def calibrated_profile_op(eff, peak: float, bandwidth: float, monotone: bool = True) -> CalibratedOp:
    """A profile operator (sim.latency.profile.OperatorEfficiency) timed against peak and bandwidth."""
    roof = Roofline(peak, bandwidth, eff.compute_efficiency, eff.memory_efficiency, eff.t0_s, eff.per_seq_s,
                    eff.causal_efficiency)
    return CalibratedOp(roof, CorrectionTable.from_json(eff.correction), monotone)


def calibrated_gemm(profile) -> CalibratedGemm:
    """From a GpuProfile (sim.latency.profile): its gemm efficiencies and correction table."""
    ceiling, floor = profile.op("gemm_ceiling").memory_efficiency, profile.op("gemm_floor").t0_s

    def op(name, peak):
        eff = profile.op(name)
        roof = Roofline(peak, profile.hbm_bandwidth_bytes_per_s, eff.compute_efficiency,
                        eff.memory_efficiency, eff.t0_s, bandwidth_ceiling=ceiling, kernel_floor_s=floor)
        return CalibratedOp(roof, CorrectionTable.from_json(eff.correction))
    ops = {"default": op("gemm", profile.bf16_flops_per_s)}
    for dtype, (name, peak) in QUANTIZED_GEMMS.items():  # FP8, NVFP4 (W4A4): their own efficiencies and peak
        if getattr(profile, peak):
            ops[dtype] = op(name, getattr(profile, peak))
    if profile.fp8_flops_per_s:  # block-scaled FP8 (DeepSeek's checkpoints): at a share of its compute rate
        ops[FP8_BLOCK] = op("gemm_fp8", profile.fp8_flops_per_s * BLOCK_SCALED_FP8_SHARE)
    return CalibratedGemm(ops)


FP8_BLOCK = "fp8_block"
# FBGEMM PR #2546 on an H100 at 8192^3: blockwise FP8 with its scaling 594.84 TFLOP/s against
# row-wise FP8's GEMM alone 1125.51 TFLOP/s.
BLOCK_SCALED_FP8_SHARE = 594.84 / 1125.51
