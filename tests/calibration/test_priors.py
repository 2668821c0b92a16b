"""Every packaged profile says where each operator's figures come from, and the priors are the
ones calibration/priors.py derives (the files cannot drift from the cited figures)."""
import json
from importlib import resources

import pytest

from calibration.priors import PRIORS, SAME_CHIP, same_chip, with_priors
from sim.latency import load_profile

PROFILES = resources.files("calibration") / "profiles"


def packaged(name):
    return json.loads((PROFILES / f"{name}.json").read_text())


@pytest.mark.parametrize("name", sorted(PRIORS))
def test_packaged_profiles_are_what_the_cited_priors_give(name):
    profile = packaged(name)
    if name in SAME_CHIP:
        profile = same_chip(profile, packaged(SAME_CHIP[name]))
    assert with_priors(profile) == packaged(name)


@pytest.mark.parametrize("name", sorted(PRIORS))
def test_every_operator_has_a_provenance_and_non_a100_priors_are_not_the_a100_fit(name):
    provenance = load_profile(name).provenance()
    assert set(provenance) >= {"gemm", "attention_decode", "attention_prefill", "allreduce", "cpu_step", "launch"}
    for op, source in provenance.items():
        assert source == "measured" or source.startswith(("imported:", "prior:")), (op, source)
    if not name.startswith("a100"):
        assert "A100" not in provenance["gemm"] and "a100" not in provenance["gemm"]


def test_fp8_gemms_have_their_own_efficiency_where_the_gpu_was_measured_in_fp8():
    h100 = load_profile("h100")
    assert h100.op("gemm_fp8").compute_efficiency < h100.op("gemm").compute_efficiency
    assert "fp8" in h100.op("gemm_fp8").source
    assert load_profile("a100_80g").fp8_flops_per_s is None  # no FP8 units: fp8 GEMMs run at bf16 peak


def test_run_output_and_metrics_show_each_operators_provenance(tmp_path):
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "sim", "run", "scenario=bench", "model=llama31_8b", "gpu=h100",
                          "tensor_parallel_size=1", "scenario.num_prompts=4", "plots=false",
                          f"hydra.run.dir={tmp_path}/run"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    line = next(line for line in out.stdout.splitlines() if line.startswith("step times:"))
    assert "imported: gemm, allreduce" in line and "cpu_step" in line.split("prior:")[1]
    assert "python -m calibration show gpu=h100" in line
    metrics = json.loads((tmp_path / "run" / "paged" / "metrics.json").read_text())
    assert metrics["latency_profile"]["operators"] == load_profile("h100").provenance()


def test_nccl_model_follows_the_measured_sizes_of_8_h200s():
    """NCCL's fastest of Ring/Simple, Ring/LL and NVLS against nccl-tests on 8 H200s (fitted on
    these sizes: this checks that the two-algorithm form holds across 32 KiB-1 GiB)."""
    from calibration.priors import H200_NCCL_TESTS_BUSBW
    from sim.latency.collectives import NCCL_ALGORITHMS, all_reduce_for
    for gpu in ("h100", "h200"):
        group = all_reduce_for(load_profile(gpu), 8)
        errors = [min(group._time(name, size) for name in NCCL_ALGORITHMS) / (size / (busbw * 8 / 14)) - 1
                  for size, busbw in H200_NCCL_TESTS_BUSBW.items()]
        assert max(abs(e) for e in errors) < 0.25 and sum(abs(e) for e in errors) / len(errors) < 0.1


def test_custom_all_reduce_fitted_at_tp4_predicts_vllm_tp6_timings():
    """Held out: vLLM PR #24111's TP 6 table (the fit saw only TP 4)."""
    from calibration.priors import VLLM_CUSTOM_TP6_MS
    from sim.latency.collectives import all_reduce_for
    group = all_reduce_for(load_profile("h100"), 6)
    for name, bound in (("allreduce_oneshot", 0.2), ("allreduce_twoshot", 0.35)):
        errors = [group._time(name, mb * 2**20) / (ms * 1e-3) - 1 for mb, ms in VLLM_CUSTOM_TP6_MS[name].items()]
        assert max(abs(e) for e in errors) < bound, (name, errors)


# vLLM PR #24111, H100 TP 4, the pynccl column of the table the custom kernels were fitted to (ms
# by MB): NCCL itself, which no H100 operator of the profile was fitted to.
VLLM_PYNCCL_TP4_MS = {0.5: 0.017, 1: 0.019, 1.5: 0.022, 2: 0.026, 3: 0.031, 4: 0.037}


def test_nccl_all_reduce_matches_vllm_pynccl_on_h100_and_beats_two_shot_where_vllm_measured_it():
    """Held out: kvsim's NCCL (the faster of ring Simple and LL) against PR #24111's pynccl at TP 4,
    and the order the PR measured at 4 MB (two-shot 43 us, NCCL 37 us) kept up to vLLM's 8 MiB
    hand-over, where the engine's all-reduce gets faster as the message grows."""
    from sim.latency.collectives import CUSTOM_MAX_BYTES, NCCL_ALGORITHMS, all_reduce_for
    group = all_reduce_for(load_profile("h100"), 4)

    def nccl(size):
        return min(group._time(name, size) for name in NCCL_ALGORITHMS if name != "allreduce_nvls")
    errors = [nccl(mb * 2**20) / (ms * 1e-3) - 1 for mb, ms in VLLM_PYNCCL_TP4_MS.items()]
    assert max(abs(e) for e in errors) < 0.2, errors
    for size in (4 * 2**20, CUSTOM_MAX_BYTES - 1):
        assert nccl(size) < group._time("allreduce_twoshot", size)
    assert group.time(CUSTOM_MAX_BYTES) < group.time(CUSTOM_MAX_BYTES - 1)


def test_all_reduce_latency_grows_with_the_ring_so_tp2_decode_beats_tp1():
    """Over PCIe (no custom all-reduce) a small message takes NCCL's Ring/LL, whose latency grows
    with the ring's 2 (n - 1) steps; and TP 2 still decodes faster than TP 1."""
    from sim.latency import BatchShape, LatencyModel
    from sim.latency.operators import NCCL_RING_LL_BASE_S
    from sim.models import load_model
    shape = BatchShape(num_decode_seqs=1, decode_context_tokens=1000, num_sampled=1)
    pcie = {tp: LatencyModel(load_model("llama31_8b"), load_profile("l40s"), tp, "bf16") for tp in (2, 8)}
    latency = {tp: model._allreduce(1024) for tp, model in pcie.items()}
    nccl = {n: NCCL_RING_LL_BASE_S + 2 * (n - 1) * 1.0e-6 for n in (2, 8)}  # tuning.cc's PCIe LL hop
    assert latency[8] / latency[2] == pytest.approx(nccl[8] / nccl[2], rel=0.02)
    steps = {tp: LatencyModel(load_model("llama31_8b"), load_profile("h100"), tp, "bf16") for tp in (1, 2)}
    assert steps[2].step_time(shape) < steps[1].step_time(shape)
