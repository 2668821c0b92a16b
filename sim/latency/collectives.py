"""The tensor-parallel all-reduce of an engine, per message size: which algorithm runs and its time.

Engines (vLLM's custom all-reduce, which SGLang reuses; TensorRT-LLM's AUTO strategy) reduce small
messages with their own kernels over NVLink peer memory and hand larger ones to NCCL:
- vLLM `CustomAllreduce` (vllm/distributed/device_communicators/custom_all_reduce.py): messages
  under max_size = 8 MiB, world sizes 2, 4, 6 and 8, two GPUs or a fully NVLink-connected group;
  csrc/custom_all_reduce.cuh runs the one-shot kernel (each GPU reads every peer's whole buffer)
  for 2 GPUs, for up to 4 GPUs under 512 KiB and for up to 8 under 256 KiB, else the two-shot one
  (reduce-scatter then all-gather over peer memory). TensorRT-LLM's AUTO table on H100 TP 8
  (customAllReduceUtils.h) draws the same lines: one-shot to 256 KiB, two-shot to 4 MiB, NCCL above.
- NCCL picks, per size, the algorithm its tuning model (src/graph/tuning.cc) predicts fastest:
  latency + bytes / bandwidth, a ring's latency a base plus one per step (2 (n - 1) steps). The LL
  protocol has the lowest latency (6.6 us + 0.6 us per NVLink step) and about half the bandwidth
  of Simple (8.4 us + 3.4 us per step); NVLS (NVLink SHARP, NVSwitch 3 systems: H100, H200, B200)
  reduces in the switch, with a fixed latency and an algorithm bandwidth that barely moves with
  the GPU count (NCCL issue #1455: 258 to 273 GB/s from 4 to 8 H100s).
Each algorithm is an operator of the GPU profile (allreduce: ring Simple; allreduce_ll,
allreduce_nvls, allreduce_oneshot, allreduce_twoshot), so its figures carry their provenance; a
profile without one of them (no NVSwitch, no peer-to-peer link) does not offer it.
"""
from __future__ import annotations

from dataclasses import dataclass

from sim.latency.calibrated import CalibratedOp, calibrated_profile_op
from sim.latency.operators import all_reduce_work, nvls_all_reduce_work, one_shot_all_reduce_work

CUSTOM_MAX_BYTES = 8 * 2**20          # vLLM CustomAllreduce max_size
CUSTOM_WORLD_SIZES = (2, 4, 6, 8)     # vLLM CustomAllreduce._SUPPORTED_WORLD_SIZES
# NCCL runs NVLS from 5 GPUs on 8 x H200 (stas00/ml-engineering network/README.md, GPU-count sweep
# at 8 GiB: 4 GPUs Ring 363 GB/s busbw, 5 GPUs NVLS 414); with fewer it keeps the ring.
NVLS_MIN_GPUS = 5
NCCL_ALGORITHMS = ("allreduce", "allreduce_ll", "allreduce_nvls")
CUSTOM_ALGORITHMS = ("allreduce_oneshot", "allreduce_twoshot")
ALGORITHMS = NCCL_ALGORITHMS + CUSTOM_ALGORITHMS


def one_shot_below(num_gpus: int) -> int:
    """The message size under which vLLM's custom all-reduce runs its one-shot kernel."""
    if num_gpus == 2:
        return CUSTOM_MAX_BYTES
    return 512 * 2**10 if num_gpus <= 4 else 256 * 2**10


def _work(algorithm: str, num_gpus: int):
    if algorithm == "allreduce_nvls":
        return nvls_all_reduce_work
    if algorithm == "allreduce_oneshot":
        return lambda size: one_shot_all_reduce_work(size, num_gpus)
    if algorithm == "allreduce_twoshot":
        return lambda size: all_reduce_work(size, num_gpus)[:2]  # two phases: latency is its t0
    return lambda size: all_reduce_work(size, num_gpus)


@dataclass
class AllReduce:
    """An all-reduce over num_gpus GPUs: ops maps the profile's algorithms to calibrated operators
    (those it lacks are absent)."""
    num_gpus: int
    ops: dict[str, CalibratedOp]

    def custom_applies(self, message_bytes: float) -> bool:
        return (self.num_gpus in CUSTOM_WORLD_SIZES and message_bytes < CUSTOM_MAX_BYTES
                and all(name in self.ops for name in CUSTOM_ALGORITHMS))

    def choice(self, message_bytes: float) -> tuple[str, float]:
        """(algorithm, seconds) for one message."""
        if self.custom_applies(message_bytes):
            name = "allreduce_oneshot" if message_bytes < one_shot_below(self.num_gpus) else "allreduce_twoshot"
            return name, self._time(name, message_bytes)
        offered = [name for name in NCCL_ALGORITHMS if name in self.ops
                   and (name != "allreduce_nvls" or self.num_gpus >= NVLS_MIN_GPUS)]
        return min(((name, self._time(name, message_bytes)) for name in offered), key=lambda pair: pair[1])

    def time(self, message_bytes: float) -> float:
        return self.choice(message_bytes)[1]

    def _time(self, name: str, message_bytes: float) -> float:
        return self.ops[name].time(f"{self.num_gpus}gpus", message_bytes, _work(name, self.num_gpus))


def all_reduce_for(profile, num_gpus: int) -> AllReduce:
    """The all-reduce of a GpuProfile over num_gpus GPUs, timed against one direction of its link."""
    link = profile.link_bandwidth_bytes_per_s / 2
    return AllReduce(num_gpus, {name: calibrated_profile_op(profile.op(name), 1.0, link)
                                for name in ALGORITHMS if name in profile.operators})
