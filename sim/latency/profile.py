"""GPU profiles: datasheet figures plus per-operator efficiencies, read from JSON only.

A profile named `<gpu>` is looked up first in `results/calibration/<gpu>/profile.json` under the
current directory (what `python -m calibration run` writes), then among the packaged profiles in
`calibration/profiles/`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from sim.errors import ConfigError, UnknownNameError

OPERATORS = ("gemm", "attention_prefill", "attention_decode", "allreduce", "cpu_step")
# Quantized GEMMs: dtype -> (the profile operator that times them, the GpuProfile peak they run
# against, where the GPU has the type's units); other dtypes run on `gemm` at the bf16 peak.
QUANTIZED_GEMMS = {"fp8": ("gemm_fp8", "fp8_flops_per_s"), "nvfp4": ("gemm_fp4", "fp4_flops_per_s")}


@dataclass(frozen=True, slots=True)
class OperatorEfficiency:
    compute_efficiency: float
    memory_efficiency: float
    t0_s: float
    source: str
    correction: dict | None = None  # fitted correction table (sim.latency.calibrated)
    per_seq_s: float = 0.0          # per sequence in the call (attention)
    causal_efficiency: float | None = None  # of causal FLOPs (prefill attention); None: compute's


@dataclass(frozen=True, slots=True)
class GpuProfile:
    name: str
    gpu_name: str
    source: str
    memory_bytes: float
    hbm_bandwidth_bytes_per_s: float
    bf16_flops_per_s: float
    fp8_flops_per_s: float | None
    link_bandwidth_bytes_per_s: float
    host_link_bytes_per_s: float
    host_link_latency_s: float
    step_overhead_s: float        # read only where a profile has no cpu_step operator
    operators: dict
    kernel_launch_s: float = 0.0  # host time to launch one kernel (eager steps)
    graph_launch_s: float = 0.0   # host time to replay one captured CUDA graph
    launch_source: str = "prior:none (a profile without launch costs: launches are free)"
    fp4_flops_per_s: float | None = None  # FP4 tensor cores (Blackwell): NVFP4 GEMMs

    def provenance(self) -> dict[str, str]:
        """Where each operator's parameters come from: measured, imported:<source> or prior:<how>."""
        derived = {"gemm_fp8_block": "prior:gemm_fp8 at 0.53 of its compute rate (FBGEMM PR #2546, H100: "
                                     "blockwise FP8 with scaling against row-wise FP8)"} if self.fp8_flops_per_s else {}
        # (imported here: sim.latency.calibrated imports this module)
        from sim.latency.calibrated import GROUPED
        shares = (f"MoE experts' grouped GEMMs at {GROUPED.compute_share:.2f} of the gemm's compute and "
                  f"{GROUPED.memory_share:.2f} of its memory efficiency, a fixed cost of at most "
                  f"{GROUPED.t0_s * 1e6:g} us and {GROUPED.per_group_s * 1e6:g} us per touched expert, fitted to "
                  f"vLLM PR #24700's and SGLang PR #11730's fused_moe times (Mixtral-8x7B BF16 TP 2 on H100, "
                  f"Qwen3-235B-A22B FP8 TP 8 on H200; calibration/grouped_gemm.py)")
        derived["gemm_grouped"] = (f"imported:{shares}" if self.name in ("h100", "h200")
                                   else f"prior:the Hopper fit: {shares}")
        return {**{name: op.source for name, op in self.operators.items()}, **derived, "launch": self.launch_source}

    def op(self, name: str) -> OperatorEfficiency:
        return self.operators[name]

    def peak_flops(self, dtype: str) -> float:
        """The tensor-core peak a GEMM of dtype runs against (16-bit where the GPU lacks the type's
        units; NVFP4 needs FP4 units, which sim.run checks before a run)."""
        _, peak = QUANTIZED_GEMMS.get(dtype, (None, None))
        return (getattr(self, peak) if peak else None) or self.bf16_flops_per_s


def _local_path(name: str) -> Path:
    return Path("results") / "calibration" / name / "profile.json"


def packaged_profiles() -> list[str]:
    """Profiles shipped in calibration/profiles/ (datasheet and imported ones)."""
    return sorted(p.name[:-5] for p in (resources.files("calibration") / "profiles").iterdir()
                  if p.name.endswith(".json"))


def available_profiles() -> list[str]:
    names = set(packaged_profiles())
    local = Path("results") / "calibration"
    if local.is_dir():
        names |= {p.parent.name for p in local.glob("*/profile.json")}
    return sorted(names)


def load_profile(name: str, where: str = "key gpu") -> GpuProfile:
    local = _local_path(name)
    if local.is_file():
        text, where = local.read_text(), str(local)
    else:
        packaged = resources.files("calibration") / "profiles" / f"{name}.json"
        if not packaged.is_file():
            raise UnknownNameError("gpu profile", name, available_profiles(), where)
        text, where = packaged.read_text(), f"calibration/profiles/{name}.json"
    try:
        return profile_from_dict(json.loads(text))
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"malformed GPU profile ({exc}), {where}, "
                          f"rerun 'python -m calibration fit' or restore the file") from None


def _without_cpu_step(data: dict) -> dict:
    """A profile written before the CPU's step cost was an operator: its fixed step overhead."""
    return {"t0_s": data.get("step_overhead_s", 0.0), "per_seq_s": 0.0,
            "source": "prior:the profile's fixed step_overhead_s (no cpu_step operator)"}


def _without_cpu_output(data: dict) -> dict:
    return {"t0_s": 0.0, "per_seq_s": 0.0,
            "source": "prior:none (no cpu_output operator: output processing counted in cpu_step)"}


def _without_gemm_fp8(data: dict) -> dict:
    """FP8 GEMMs without a figure of their own: the 16-bit GEMM's efficiencies, against the FP8 peak."""
    gemm = data["operators"]["gemm"]
    return {**gemm, "source": "prior:the 16-bit GEMM's efficiencies and correction (no FP8 GEMM figure "
                              "for this GPU)"}


def _without_gemm_fp4(data: dict) -> dict:
    """NVFP4 GEMMs without a figure of their own: the FP8 GEMM's efficiencies, against the FP4 peak."""
    fp8 = data["operators"].get("gemm_fp8") or _without_gemm_fp8(data)
    return {**fp8, "source": "prior:the FP8 GEMM's efficiencies (no FP4 GEMM figure for this GPU)"}


def _without_kv_copy(data: dict) -> dict:
    gemm = data["operators"]["gemm"]
    return {"memory_efficiency": gemm["memory_efficiency"], "compute_efficiency": 1.0, "t0_s": gemm["t0_s"],
            "source": "prior:the GEMM's memory efficiency and fixed cost (no KV copy figure)"}


# A small elementwise kernel inside a CUDA graph runs 2-4 us at decode sizes: zdszero's decode profile
# of DeepSeek on H800 (zdszero.github.io/Computer/Artificial_Intelligence/deepseek_profile.html):
# rmsnorm 2 us, FusedAddRMSNorm 3-4 us, per_token_group_quant 2-5 us per kernel.
ELEMENTWISE_T0_S = 3e-6


def _without_elementwise(data: dict) -> dict:
    gemm = data["operators"]["gemm"]
    return {"memory_efficiency": gemm["memory_efficiency"], "compute_efficiency": 1.0, "t0_s": ELEMENTWISE_T0_S,
            "source": "prior:the GEMM's memory efficiency; 3 us per kernel (zdszero's H800 decode profile: "
                      "norm and quant kernels 2-5 us)"}


def _without_gemm_ceiling(data: dict) -> dict:
    return {"memory_efficiency": 1.0, "compute_efficiency": 1.0, "t0_s": 0.0,
            "source": "prior:none (the profile names no read ceiling: the datasheet bandwidth bounds a GEMM)"}


def _without_gemm_floor(data: dict) -> dict:
    return {"memory_efficiency": 1.0, "compute_efficiency": 1.0, "t0_s": 0.0,
            "source": "prior:none (no measured small GEMM kernels of this GPU: no GEMM has a least time)"}


def _without_host_copy(data: dict) -> dict:
    return {"memory_efficiency": 1.0, "compute_efficiency": 1.0, "t0_s": data.get("host_link_latency_s", 0.0),
            "source": "prior:the profile's host link bandwidth and latency (no host copy figure)"}


def _borrowed(operator: str, figures: str, missing: str):
    """An operator without figures of its own takes another operator's, without its correction
    table (send/recv and all-to-all the all-reduce's link, MLA decode the GQA/MHA decode's)."""
    def fallback(data: dict) -> dict:
        return {**data["operators"][operator], "correction": None, "source": f"prior:{figures} (no {missing})"}
    return fallback


LINK_FIGURES = "the all-reduce's link efficiency and latency"
FALLBACKS = {"cpu_step": _without_cpu_step, "cpu_output": _without_cpu_output,
             "gemm_fp8": _without_gemm_fp8,
             "send_recv": _borrowed("allreduce", LINK_FIGURES, "send/recv figure"),
             "kv_copy": _without_kv_copy, "host_copy": _without_host_copy, "elementwise": _without_elementwise,
             "gemm_ceiling": _without_gemm_ceiling, "gemm_floor": _without_gemm_floor,
             "all_to_all": _borrowed("allreduce", LINK_FIGURES, "all-to-all figure"),
             "attention_decode_mla": _borrowed("attention_decode", "the attention_decode operator's figures",
                                               "MLA decode timings")}


# Operators of units a GPU may lack: read (or derived) only where the profile gives the unit's peak.
GPU_UNIT_FALLBACKS = {"gemm_fp4": _without_gemm_fp4}
EVERY_FALLBACK = {**FALLBACKS, **GPU_UNIT_FALLBACKS}

# All-reduce algorithms a system may lack (no NVSwitch, no peer-to-peer link): offered only where
# the profile gives them (sim.latency.collectives).
OPTIONAL = ("allreduce_ll", "allreduce_nvls", "allreduce_oneshot", "allreduce_twoshot")


def profile_from_dict(data: dict) -> GpuProfile:
    ops = {}
    optional = tuple(op for op in OPTIONAL if op in data["operators"])
    if data.get("fp4_flops_per_s"):  # only a GPU with FP4 units times NVFP4 GEMMs
        optional += ("gemm_fp4",)
    for op in OPERATORS + tuple(op for op in FALLBACKS if op not in OPERATORS) + optional:
        raw = data["operators"][op] if op in data["operators"] else EVERY_FALLBACK[op](data)
        ops[op] = OperatorEfficiency(
            compute_efficiency=float(raw.get("compute_efficiency", raw.get("link_efficiency", 1.0))),
            memory_efficiency=float(raw.get("memory_efficiency", raw.get("link_efficiency", 1.0))),
            t0_s=float(raw["t0_s"]),
            source=str(raw.get("source", data["source"])),
            correction=raw.get("correction"),
            per_seq_s=float(raw.get("per_seq_s") or 0.0),
            causal_efficiency=float(raw["causal_efficiency"]) if raw.get("causal_efficiency") else None,
        )
    return GpuProfile(
        name=data["name"], gpu_name=data["gpu_name"], source=data["source"],
        memory_bytes=float(data["memory_bytes"]),
        hbm_bandwidth_bytes_per_s=float(data["hbm_bandwidth_bytes_per_s"]),
        bf16_flops_per_s=float(data["bf16_flops_per_s"]),
        fp8_flops_per_s=float(data["fp8_flops_per_s"]) if data.get("fp8_flops_per_s") else None,
        fp4_flops_per_s=float(data["fp4_flops_per_s"]) if data.get("fp4_flops_per_s") else None,
        link_bandwidth_bytes_per_s=float(data["link_bandwidth_bytes_per_s"]),
        host_link_bytes_per_s=float(data["host_link_bytes_per_s"]),
        host_link_latency_s=float(data.get("host_link_latency_s", 0.0)),
        step_overhead_s=float(data["step_overhead_s"]),
        operators=ops,
        kernel_launch_s=float(data.get("kernel_launch_s", 0.0)),
        graph_launch_s=float(data.get("graph_launch_s", 0.0)),
        **({"launch_source": str(data["launch_source"])} if "launch_source" in data else {}),
    )
