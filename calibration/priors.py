"""Datasheet profiles' priors: each GPU's figures from its own datasheet (REFERENCE.md section 3)
and from cited public measurements of that GPU; where none was found the prior says so.

    python -m calibration.priors      rewrites calibration/profiles/<gpu>.json for every GPU below
                                      (operators fitted on imported or measured data are kept)

Sources (read 2026-12-01; the quotes are in docs/validation.md):
- MAMF: stas00/ml-engineering, compute/accelerator/README.md, "maximum achievable matmul FLOPS"
  (mamf-finder.py, best shape, mean of 100 iterations): A100 SXM 271.2 of 312 bf16 TFLOP/s;
  H100 SXM 794.5 of 989 bf16 and 1402.6 of 1979 fp8 ("H200 is the same" for bf16); H200 fp8
  1453.4 of 1979; B200 1745.0 of 2250 bf16 and 3432.5 of 4500 fp8.
- B200 FP4: stas00/ml-engineering's TFLOPS comparison table (w/o sparsity) B200 SXM fp4 9000;
  DeepGEMM PR #348 (B200, CUDA 12.9): cuBLASLt block-scaled FP4 GEMM 8192^3 5239 TFLOP/s
  (docs/validation.md item 8 checks it against flashinfer PR #1979 and vLLM PR #20646).
- AMD ROCm blog "Measuring max-achievable FLOPs, part 2" (2025-02-28): MI300X 708 bf16 and
  1273 fp8 TFLOP/s (hipblaslt-bench).
- vLLM PR #49363: H100 bf16 GEMM, N=12288 K=5376, M=1 at 2.870 TFLOP/s, i.e. 132 MB of weights in
  46 us = 2.87 of 3.35 TB/s.
- REFERENCE.md section 3: H200 device copy 4.3 of 4.8 TB/s (measured with PyTorch).
- Azure/AI-benchmarking-guide (BabelStream, CUDA 12.6, the same VBIOS and host): Dot 3.18 of 3.35 TB/s
  on ND H100 v5, 4.48 of 4.8 TB/s on ND H200 v5: the read ceiling no GEMM is timed above.
- nccl-tests issue #149 and #175 (DGX A100, 8 GPUs): all-reduce busbw 230-232.5 GB/s of 300 per
  direction; nccl-tests issue #212 and NCCL issue #2140 (8x H100): 370 GB/s ring busbw of the
  450 GB/s line rate (480 with NVLS); stas00 all-reduce-8xH200.md: 367.6 GB/s ring, 482 NVLS;
  NCCL issue #2140: 8x B300 695 GB/s without NVLS (NVLink 5, 900 GB/s per direction); NCCL issue
  #1639: 8x RTX 5090 on PCIe, busbw 28 GB/s of 32 per direction (no L40S figure was found).
- NCCL src/graph/tuning.cc (2.20.3, NVIDIA/nccl b6475625): ring LL latency 6.6 us base + 0.6 us per
  NVLink step (2 (n - 1) steps): 15 us for 8 GPUs, PCIe 1.0 us per step; Ring/Simple 8.4 us + 3.4 us
  per NVLink step (5.7 PCIe); Ring/LL at a quarter of the ring's bandwidth; NVLS 23 us.
- stas00/ml-engineering network/benchmarks/README.md: 8x H200 nccl-tests all_reduce_perf (NCCL
  2.30.7) busbw from 32 KiB to 1 GiB; 8x B200 845.67 GB/s at 16 GiB.
- vLLM PR #24111: its custom all-reduce's one-shot and two-shot kernels on H100 at TP 4 and 6.
- tritonbench PR #1017 (GB200): cuLaunchKernel 3.0 us, Triton's launcher 4.7 us per kernel; ocannl
  issue #488: a CUDA-graph replay costs about 15 us fixed.
- Vidur's H100 GEMM timings (microsoft/vidur e26eb8f7, data/profiling/compute/h100/meta-llama/
  Llama-2-7b-hf/mlp.csv, TP 1 rows): the packaged h100 GEMM is fitted to them (import-vidur).
- Published B200 BF16 GEMM timings (vLLM PRs #18778, #19566, #20578; torchao PR #2427): the
  packaged b200 GEMM is fitted to them (calibration/published/b200_gemm_times.csv, its README);
  its FP8 and FP4 GEMMs below follow at the MAMF / cuBLASLt best-shape ratios.
- Vidur's cpu_overheads.csv (microsoft/vidur e2d00e9, Sarathi-Serve on an A100 host, CodeLlama-34B
  TP 2): schedule + prepare inputs + sampler 0.769 ms + 6.9 us per sequence, output processing
  0.093 ms + 29.4 us per sequence, per step (calibration/reports/a100_80g).
"""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from sim.latency.operators import NCCL_NVLINK_STEP_S, NCCL_RING_LL_BASE_S, ring_latency_split

# All-reduce over 8 H200s (NVLink 4 switch), nccl-tests all_reduce_perf built against NCCL 2.30.7:
# stas00/ml-engineering network/benchmarks/README.md, busbw in GB/s by message size (time = size /
# algbw, algbw = busbw * n / (2 (n - 1))). NCCL reports Ring/LL up to 1 MiB and NVLS/Simple from
# 2 MiB (network/README.md, NCCL 2.27.7). The H100's HGX board has the same NVLink 4 switches
# (nccl-tests #212: the same 370 GB/s ring and 480 GB/s NVLS figures).
H200_NCCL_TESTS_BUSBW = {32 * 2**10: 3.20e9, 64 * 2**10: 6.26e9, 128 * 2**10: 12.40e9, 256 * 2**10: 24.63e9,
                         512 * 2**10: 48.30e9, 2**20: 72.45e9, 2 * 2**20: 91.48e9, 4 * 2**20: 139.97e9,
                         8 * 2**20: 182.03e9, 16 * 2**20: 242.45e9, 32 * 2**20: 298.44e9, 64 * 2**20: 369.82e9,
                         128 * 2**20: 411.21e9, 256 * 2**20: 442.27e9, 2**30: 464.00e9}
NCCL_TESTS_SOURCE = "stas00 ml-engineering 8xH200 nccl-tests all_reduce_perf (NCCL 2.30.7)"
LL_UP_TO = 2**20  # the sizes NCCL ran Ring/LL at; NVLS above
# NCCL 2.20.3 src/graph/tuning.cc (NVIDIA/nccl b6475625): ring latency = base + 2 (n - 1) hops, per
# protocol (LL, Simple); Ring/LL's bus bandwidth is a quarter of the ring's for all-reduce; NVLS's
# latency is one NVLink hop of 23 us. PCIe hops: LL 1.0, Simple 5.7 us.
NCCL_RING_SIMPLE_BASE_S = 8.4e-6
NCCL_SIMPLE_STEP_S = {"nvlink": 3.4e-6, "pcie": 5.7e-6}
NCCL_LL_BANDWIDTH_SHARE = 0.25
NCCL_NVLS_LATENCY_S = 23e-6
TUNING = "NCCL 2.20.3 tuning.cc"
NVLINK4_BYTES_PER_S = 450e9  # bytes/s, one direction of an H100/H200 NVLink 4 link (the fits' bandwidth share)
# vLLM PR #24111 (benchmarks/kernels/benchmark_device_communicators.py, CUDA graphs, bf16, H100),
# ms per all-reduce by size at TP 4: its custom all-reduce's one-shot (ca_1stage) and two-shot
# (ca_2stage) kernels. Fitted on TP 4; the TP 6 table of the same PR checks it (tests).
VLLM_CUSTOM_TP4_MS = {"allreduce_oneshot": {0.5: 0.010, 1: 0.015, 1.5: 0.019, 2: 0.022, 3: 0.030, 4: 0.038},
                      "allreduce_twoshot": {0.5: 0.017, 1: 0.018, 1.5: 0.027, 2: 0.027, 3: 0.035, 4: 0.043}}
VLLM_CUSTOM_TP6_MS = {"allreduce_oneshot": {0.5: 0.013, 1: 0.021, 1.5: 0.030, 2: 0.038, 3: 0.053, 4: 0.070},
                      "allreduce_twoshot": {0.5: 0.015, 1: 0.017, 1.5: 0.020, 2: 0.026, 3: 0.029, 4: 0.037}}
CUSTOM_SOURCE = "vLLM PR #24111 H100 TP 4 custom all-reduce (CUDA graphs)"
# NVLS where the system has NVSwitch 3 or later (H100, H200, B200 HGX): 8 x B200 all-reduce busbw
# 845.67 GB/s at 16 GiB, NVLS from 6 GPUs (stas00 network/benchmarks, NCCL 2.30.7).
B200_NVLS_BUSBW = 845.67e9
KERNEL_LAUNCH_S, GRAPH_LAUNCH_S = 4.7e-6, 15e-6
LAUNCH_SOURCE = ("prior:tritonbench PR #1017 (Triton launcher 4.7 us per kernel) and ocannl issue "
                 "#488 (a CUDA-graph replay about 15 us)")
def _sarathi(t0_s: float, per_seq_s: float, what: str) -> dict:
    return {"compute_efficiency": 1.0, "memory_efficiency": 1.0, "t0_s": t0_s, "per_seq_s": per_seq_s,
            "source": f"prior:Vidur's Sarathi-Serve cpu_overheads on an A100 host (CodeLlama-34B TP 2), {what} "
                      f"{t0_s * 1e3:.3f} ms + {per_seq_s * 1e6:.1f} us per sequence; this GPU's host not measured"}


CPU_STEP = _sarathi(0.769e-3, 6.9e-6, "schedule + prepare inputs + sampler:")
CPU_OUTPUT = _sarathi(0.093e-3, 29.4e-6, "output processing:")
ATTENTION_T0_S = 4e-6
NCCL_STEP_S = {"nvlink": NCCL_NVLINK_STEP_S, "pcie": 1.0e-6}


@dataclass(frozen=True)
class Figure:
    value: float
    source: str


# B200 FP4: 9,000 dense TFLOP/s (stas00 ml-engineering compute/accelerator "TFLOPS comparison
# table", w/o sparsity: B200 SXM fp8 4500, fp4 9000; NVIDIA's HGX B200 sheet gives 18 PFLOPS with
# sparsity). Achieved: DeepGEMM PR #348 (B200, CUDA 12.9), cuBLASLt block-scaled FP4 (MXFP4) at
# 8192^3 5,239 TFLOP/s, the same kind of best-shape figure as the MAMF ones above. It checks
# against NVFP4 at a medium shape, flashinfer PR #1979 (B200, m=1024 n=7168 k=4608): 3,441
# (CUTLASS) to 3,841 TFLOP/s, where this prior's roofline gives 4,000 (docs/validation.md).
# The B200's small GEMM kernels (validation/SOURCES.md, "Kernel times that check the model").
B200_SMALL_GEMMS = ("b200_small_gemm_kernels.csv",
                    "TensorRT-LLM rc6.post2 nsys trace of DeepSeek-R1-0528-NVFP4-v2 decode on 8 B200s "
                    "(7 GEMM kernels of 3.7-10.0 us, means of 10 layers) + torchao PR #2427 (1024^3, 5.08 us)")
B200_FP4_PEAK = 9000e12
B200_FP4_GEMM = Figure(round(5239 / 9000, 4), "prior:DeepGEMM PR #348 B200 cuBLASLt block-scaled FP4 GEMM "
                                               "8192^3 5239 of 9000 TFLOP/s (stas00 table: B200 fp4 9000 dense)")


@dataclass(frozen=True)
class Priors:
    gemm: Figure             # 16-bit GEMM compute efficiency
    gemm_fp8: Figure | None  # FP8 GEMM compute efficiency (None: no FP8 units)
    memory: Figure           # share of HBM bandwidth a streaming kernel reaches
    link: Figure             # all-reduce bus bandwidth over the per-direction link bandwidth
    fabric: str              # nvlink or pcie (NCCL's per-step latency; peer-to-peer custom all-reduce on nvlink)
    nvls: Figure | None = None  # NVLS algorithm bandwidth over the per-direction link (None: no NVSwitch 3)
    fp4: tuple[float, Figure] | None = None  # FP4 tensor cores: (dense peak FLOP/s, NVFP4 GEMM efficiency)
    read_ceiling: Figure | None = None  # the best share of HBM bandwidth a measured read kernel reaches:
    # no GEMM is timed faster (gemm_ceiling; None: the datasheet bounds, as for the A100s, whose 36,516
    # fitted GEMM timings span the shapes the simulator runs)
    small_gemms: tuple[str, str] | None = None  # (file in calibration/published, what it holds): measured
    # small GEMM kernels; no GEMM kernel is timed under their geometric mean (gemm_floor; None: no floor)


def _mamf(tflops: float, peak: float, what: str) -> Figure:
    return Figure(round(tflops / peak, 4), f"prior:stas00 MAMF {what} {tflops} of {peak:g} TFLOP/s")


H100_GEMM, H100_FP8 = _mamf(794.5, 989, "H100 SXM bf16"), _mamf(1402.6, 1979, "H100 SXM fp8")
A100_GEMM = _mamf(271.2, 312, "A100 SXM bf16")
# The best read bandwidth measured on the GPU: Azure/AI-benchmarking-guide, BabelStream's Dot (a read-only
# reduction, like a GEMM's weight stream; CUDA 12.6, the same VBIOS and host on both): ND H100 v5 3.18 of
# 3.35 TB/s ("Azure Results/ND_H100_v5_results.md" at f350e7e), ND H200 v5 4.48 of 4.8 TB/s
# (Azure_Results/ND_H200_v5_results.md at 7f20e5f). vLLM's fused_moe reads Mixtral's experts at 0.89
# of the H100's datasheet (PR #24700, batch 16-128: calibration/published/fused_moe_times.csv), under it.
H100_READ = Figure(round(3.18 / 3.35, 4), "prior:Azure BabelStream Dot on ND H100 v5, 3.18 of 3.35 TB/s")
H200_READ = Figure(round(4.48 / 4.8, 4), "prior:Azure BabelStream Dot on ND H200 v5, 4.48 of 4.8 TB/s")
BORROWED_READ = Figure(H200_READ.value, f"prior:no public read-bandwidth figure found for this GPU; the H200's "
                                        f"({H200_READ.source[len('prior:'):]})")
NO_MEMORY_FIGURE = "no public streaming-bandwidth figure found for this GPU; the H200's measured share"
PRIORS = {
    "a100_80g": Priors(A100_GEMM, None, Figure(0.78, "prior:the A100 GEMM fit's memory efficiency"),
                       Figure(0.767, "prior:nccl-tests #149/#175 DGX A100 busbw 230 of 300 GB/s"), "nvlink"),
    "a100_40g": Priors(A100_GEMM, None, Figure(0.78, "prior:the A100 GEMM fit's memory efficiency (same chip)"),
                       Figure(0.767, "prior:nccl-tests #149/#175 DGX A100 busbw 230 of 300 GB/s"), "nvlink"),
    "h100": Priors(H100_GEMM, H100_FP8, Figure(0.857, "prior:vLLM PR #49363 H100 bf16 GEMV 2.87 of 3.35 TB/s"),
                   Figure(0.822, "prior:nccl-tests #212 / NCCL #2140 8x H100 ring busbw 370 of 450 GB/s"), "nvlink",
                   read_ceiling=H100_READ),
    "h200": Priors(Figure(H100_GEMM.value, H100_GEMM.source + " (stas00: H200 is the same)"),
                   _mamf(1453.4, 1979, "H200 SXM fp8"),
                   Figure(0.896, "prior:REFERENCE.md section 3 H200 device copy 4.3 of 4.8 TB/s"),
                   Figure(0.817, "prior:stas00 all-reduce-8xH200 ring busbw 367.6 of 450 GB/s"), "nvlink",
                   read_ceiling=H200_READ),
    "b200": Priors(_mamf(1745.0, 2250, "B200 SXM bf16"), _mamf(3432.5, 4500, "B200 SXM fp8"),
                   Figure(0.896, f"prior:{NO_MEMORY_FIGURE} (4.3 of 4.8 TB/s)"),
                   Figure(0.772, "prior:NCCL #2140 8x B300 (NVLink 5) busbw 695 of 900 GB/s without NVLS; "
                                 "no B200 ring figure found"), "nvlink",
                   Figure(round(B200_NVLS_BUSBW * 8 / 14 / 900e9, 4),
                          "prior:stas00 8x B200 all-reduce busbw 845.67 GB/s at 16 GiB (NVLS), as algbw of 900 GB/s"),
                   (B200_FP4_PEAK, B200_FP4_GEMM), read_ceiling=BORROWED_READ,
                   small_gemms=B200_SMALL_GEMMS),
    "l40s": Priors(Figure(H100_GEMM.value, "prior:no public L40S matmul figure found; the H100's MAMF share"),
                   Figure(H100_FP8.value, "prior:no public L40S fp8 matmul figure found; the H100's MAMF share"),
                   Figure(0.896, f"prior:{NO_MEMORY_FIGURE} (4.3 of 4.8 TB/s)"),
                   Figure(0.875, "prior:NCCL #1639 8x RTX 5090 on PCIe busbw 28 of 32 GB/s; no L40S figure found"),
                   "pcie", read_ceiling=BORROWED_READ),
    "mi300x": Priors(Figure(round(708 / 1307, 4), "prior:AMD ROCm blog MAF MI300X bf16 708 of 1307 TFLOP/s"),
                     Figure(round(1273 / 2615, 4), "prior:AMD ROCm blog MAF MI300X fp8 1273 of 2615 TFLOP/s"),
                     Figure(0.896, f"prior:{NO_MEMORY_FIGURE} (4.3 of 4.8 TB/s)"),
                     Figure(0.7, "prior:no public single-node RCCL figure found; 0.7 assumed"), "nvlink",
                     read_ceiling=BORROWED_READ),
}
GEMM_T0 = Figure(4e-6, "prior:4 us kernel fixed cost (no per-GPU figure)")


def _kept(op: dict | None) -> bool:
    """Operators fitted on data (imported or measured) are not replaced by priors."""
    return bool(op) and str(op.get("source", "")).startswith(("imported", "measured"))


def with_priors(profile: dict) -> dict:
    """The profile with every operator not fitted on data set from its GPU's priors."""
    priors = PRIORS[profile["name"]]
    ops = dict(profile["operators"])
    gemm = {"compute_efficiency": priors.gemm.value, "memory_efficiency": priors.memory.value,
            "t0_s": GEMM_T0.value, "source": f"{priors.gemm.source}; {priors.memory.source}; {GEMM_T0.source}"}
    attention = {"compute_efficiency": 0.5, "memory_efficiency": priors.memory.value, "t0_s": ATTENTION_T0_S,
                 "source": f"prior:compute 0.5 assumed (no attention timings of this GPU); {priors.memory.source}"}
    allreduce = {"link_efficiency": priors.link.value, "t0_s": NCCL_RING_SIMPLE_BASE_S,
                 "per_seq_s": NCCL_SIMPLE_STEP_S[priors.fabric],
                 "source": f"{priors.link.source}; {TUNING} Ring/Simple latency (base + per step)"}
    ring_ll = {"link_efficiency": round(priors.link.value * NCCL_LL_BANDWIDTH_SHARE, 6), "t0_s": NCCL_RING_LL_BASE_S,
               "per_seq_s": NCCL_STEP_S[priors.fabric],
               "source": f"{priors.link.source} x {TUNING}'s Ring/LL bandwidth share 1/4; its Ring/LL latency"}
    algorithms = {"allreduce_ll": ring_ll}
    if priors.nvls:
        algorithms["allreduce_nvls"] = {"link_efficiency": priors.nvls.value, "t0_s": NCCL_NVLS_LATENCY_S,
                                        "source": f"{priors.nvls.source}; {TUNING} NVLS latency (one NVLink hop)"}
    if priors.fabric == "nvlink":  # vLLM's custom all-reduce over peer memory (sim.latency.collectives)
        for name, fitted in custom_all_reduce().items():
            algorithms[name] = {**fitted, "source": f"prior:the {CUSTOM_SOURCE} fit "
                                                    "(the same share of this GPU's link, the same fixed cost)"}
    send_recv = {"link_efficiency": priors.link.value,
                 "t0_s": round(NCCL_RING_LL_BASE_S + NCCL_STEP_S[priors.fabric], 9),
                 "source": f"{priors.link.source}; NCCL tuning.cc LL latency of one step"}
    replacements = {"gemm": gemm, "attention_prefill": attention, "attention_decode": attention,
                    "allreduce": allreduce, **algorithms, "send_recv": send_recv, "cpu_step": CPU_STEP,
                    "cpu_output": CPU_OUTPUT}
    if priors.read_ceiling:  # a GEMM reads its weights no faster than this GPU's best measured read kernel
        replacements["gemm_ceiling"] = {
            "compute_efficiency": 1.0, "memory_efficiency": priors.read_ceiling.value, "t0_s": 0.0,
            "source": f"{priors.read_ceiling.source}: no GEMM is timed at a larger share of the bandwidth"}
    if priors.small_gemms:
        replacements["gemm_floor"] = kernel_floor(*priors.small_gemms)
    if priors.gemm_fp8:
        replacements["gemm_fp8"] = _quantized_gemm(ops, gemm, priors, priors.gemm_fp8, "FP8")
    if priors.fp4:
        replacements["gemm_fp4"] = _quantized_gemm(ops, gemm, priors, priors.fp4[1], "FP4")
        profile = {**profile, "fp4_flops_per_s": priors.fp4[0]}
    for name, values in replacements.items():
        if not _kept(ops.get(name)):
            ops[name] = dict(values)
    if "gemm_fp8" in ops and not _kept(ops["gemm_fp8"]) and not priors.gemm_fp8:
        del ops["gemm_fp8"]
    source = "imported" if any(_kept(op) for op in ops.values()) else "datasheet"
    notes = ("Figures from this GPU's datasheet (REFERENCE.md section 3) and cited public measurements "
             "of it (calibration/priors.py); each operator's source says which, fitted ones first.")
    return {**profile, "source": source, "operators": ops, "kernel_launch_s": KERNEL_LAUNCH_S,
            "graph_launch_s": GRAPH_LAUNCH_S, "launch_source": LAUNCH_SOURCE, "notes": notes}


def kernel_floor(name: str, what: str) -> dict:
    """A GPU's gemm_floor: the geometric mean of its small GEMM kernels' measured times
    (calibration/published/<name>, its README): kvsim times no GEMM kernel shorter."""
    with (resources.files("calibration") / "published" / name).open() as f:
        times = [float(row["time_s"]) for row in csv.DictReader(f)]
    floor = round(float(np.exp(np.mean(np.log(times)))), 9)
    return {"compute_efficiency": 1.0, "memory_efficiency": 1.0, "t0_s": floor,
            "source": (f"imported:{what}: no GEMM kernel is timed shorter than their geometric mean, "
                       f"{floor * 1e6:.2f} us"),
            "origin": f"calibration/published/{name}"}


def _quantized_gemm(ops: dict, gemm: dict, priors: Priors, efficiency: Figure, kind: str) -> dict:
    """An FP8 or FP4 GEMM's prior: a fitted 16-bit GEMM at the priors' ratio of the type's
    efficiency to bf16's, else the 16-bit GEMM's prior at the type's efficiency."""
    if _kept(ops.get("gemm")):
        fitted, ratio = ops["gemm"], efficiency.value / priors.gemm.value
        return {**fitted, "compute_efficiency": round(fitted["compute_efficiency"] * ratio, 6),
                "source": f"prior:the fitted 16-bit GEMM ({fitted['source']}) x the {kind}/BF16 "
                          f"ratio of {efficiency.source[len('prior:'):]} and of {priors.gemm.source[len('prior:'):]}"}
    return {**gemm, "compute_efficiency": efficiency.value,
            "source": f"{efficiency.source}; {priors.memory.source}; {GEMM_T0.source}"}


# Fitted operators measured on the other memory variant of the same chip (GA100; GH100, whose
# bf16 matmul stas00's MAMF table finds "the same" on the H200).
SAME_CHIP = {"a100_40g": "a100_80g", "h200": "h100"}


def same_chip(profile: dict, sibling: dict) -> dict:
    """Fitted operators of the same chip's other variant, said so (bandwidth stays this GPU's)."""
    ops = dict(profile["operators"])
    for name, op in sibling["operators"].items():
        own = ops.get(name)
        if _kept(own) and "(same chip)" not in own["source"]:
            continue  # fitted on this GPU's own data
        if _kept(op) and not name.startswith("cpu_") and "(same chip)" not in op["source"]:
            ops[name] = {**op, "source": f"{op['source']} on the {sibling['gpu_name']} (same chip)"}
    return {**profile, "operators": ops}


def _line(x: np.ndarray, t: np.ndarray) -> tuple[float, float]:
    """t = a + x / bandwidth, least squares in relative error: (a, bandwidth)."""
    a, slope = np.linalg.lstsq(np.stack([1 / t, x / t], axis=1), np.ones_like(t), rcond=None)[0]
    return float(a), float(1 / slope)


def nvlink4_nccl() -> dict:
    """NCCL's Ring/LL and NVLS fitted to the 8 x H200 nccl-tests sizes each ran at (t0, link share)."""
    sizes = np.array(list(H200_NCCL_TESTS_BUSBW), dtype=float)
    times = sizes / (np.array(list(H200_NCCL_TESTS_BUSBW.values())) * 8 / 14)
    ll, line = sizes <= LL_UP_TO, NVLINK4_BYTES_PER_S
    latency, bus = _line(sizes[ll] * 14 / 8, times[ll])
    base, per_step = ring_latency_split(latency, 8)
    t0, algbw = _line(sizes[~ll], times[~ll])
    source = f"imported:{NCCL_TESTS_SOURCE}"
    return {"allreduce_ll": {"link_efficiency": round(bus / line, 6), "t0_s": round(base, 9), "per_seq_s": round(per_step, 9),
                             "source": f"{source}, {int(ll.sum())} Ring/LL sizes to 1 MiB; latency split per "
                                       f"ring step as {TUNING}"},
            "allreduce_nvls": {"link_efficiency": round(algbw / line, 6), "t0_s": round(t0, 9),
                               "source": f"{source}, {int((~ll).sum())} NVLS sizes from 2 MiB (H100 HGX: the same "
                                         "NVLink 4 switches)"}}


def custom_all_reduce() -> dict:
    """vLLM's one-shot and two-shot custom all-reduce fitted to its H100 TP 4 timings (t0, link share)."""
    fitted = {}
    for name, table in VLLM_CUSTOM_TP4_MS.items():
        sizes = np.array(list(table)) * 2**20
        moved = 3 * sizes if name == "allreduce_oneshot" else 1.5 * sizes  # (n - 1) S; 2 (n - 1) / n S
        t0, bandwidth = _line(moved, np.array(list(table.values())) * 1e-3)
        fitted[name] = {"link_efficiency": round(bandwidth / NVLINK4_BYTES_PER_S, 6), "t0_s": round(t0, 9),
                        "source": f"imported:{CUSTOM_SOURCE}, {len(table)} sizes"}
    return fitted


def main() -> None:
    folder = Path(str(resources.files("calibration") / "profiles"))
    for name in PRIORS:
        path = folder / f"{name}.json"
        profile = json.loads(path.read_text())
        if name in ("h100", "h200"):  # the ring is NCCL's Ring/Simple prior; LL and NVLS measured
            profile["operators"].pop("allreduce", None)
            profile["operators"].update(nvlink4_nccl())
        if name == "h100":
            profile["operators"].update(custom_all_reduce())
        if name in SAME_CHIP:
            profile = same_chip(profile, json.loads((folder / f"{SAME_CHIP[name]}.json").read_text()))
        path.write_text(json.dumps(with_priors(profile), indent=2) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
