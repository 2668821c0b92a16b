"""kvsim's fused MoE kernels against vLLM's published fused_moe kernel times
(calibration/published/fused_moe_times.csv, its README; calibration/grouped_gemm.py).

vLLM's benchmarks/kernels/benchmark_moe.py times the routed experts' kernels (top-k, alignment,
the two grouped GEMMs, activation, weighted sum; for block-scaled FP8 also the two input
quantizations) in a CUDA graph with about uniform routing: MoeLayer.fused_time is that part of a
MoE layer (FusedMoeBench adds the quantizations, which kvsim counts with the elementwise kernels).
"""
import statistics

import pytest

from calibration.grouped_gemm import FusedMoeBench, fit_shares, published_rows
from sim.latency.calibrated import GROUPED_GEMM_COMPUTE_SHARE, GROUPED_GEMM_MEMORY_SHARE
from sim.latency.profile import load_profile

SHARES = (GROUPED_GEMM_COMPUTE_SHARE, GROUPED_GEMM_MEMORY_SHARE)


def bench(role, model=None):
    return FusedMoeBench([r for r in published_rows(role) if model is None or r["model"] == model])


def test_the_shipped_grouped_gemm_shares_are_the_fit_to_the_fit_rows():
    fitting = bench("fit")
    assert {r["model"] for r in fitting.rows} == {"mixtral_8x7b"}
    assert fit_shares(fitting) == pytest.approx(SHARES, abs=0.021)  # the grid's step is 0.02
    ratios = fitting.ratios()
    assert all(0.8 <= r <= 1.1 for r in ratios) and statistics.median(ratios) == pytest.approx(1.0, abs=0.03)
    # at the dense GEMM's efficiencies the same rows were a tenth fast, 7% since the read ceiling
    # (gemm_ceiling) bounds every GEMM's bandwidth
    assert statistics.median(fitting.ratios((1.0, 1.0))) < 0.95


def test_the_fit_recovers_known_shares():
    fitting = bench("fit")
    known = (0.7, 0.92)
    assert fit_shares(fitting, fitting.predicted_us(known)) == pytest.approx(known, abs=1e-9)


def test_held_out_deepseek_block_fp8_experts_on_h200_follow_the_fitted_memory_share():
    """Batch 1-8 of DeepSeek-R1's experts read weights: they check the memory share only (the
    compute share rests on the fit rows' largest batches, 1,024 and 1,536 tokens)."""
    held_out = bench("held_out")
    assert {(r["model"], r["gpu"], r["dtype"]) for r in held_out.rows} == {("deepseek_v3", "h200", "fp8_block")}
    ratios = held_out.ratios()
    assert all(0.85 <= r <= 1.15 for r in ratios), ratios
    assert statistics.median(ratios) == pytest.approx(1.0, abs=0.05)
    with pytest.raises(ValueError, match="do not constrain the compute share"):
        fit_shares(held_out)


def test_a_row_of_an_unknown_dtype_is_refused():
    row = {**published_rows("fit")[0], "dtype": "int8_w8a16"}
    with pytest.raises(ValueError, match="dtype 'int8_w8a16' is none of bf16, fp8, fp8_block"):
        FusedMoeBench([row])


def test_batch_one_pays_small_kernels_not_the_gemms_fixed_cost():
    """At one token a layer reads k experts' weights and runs a few small kernels: with the four
    routing kernels at the GEMM's 14 us fixed cost each it came out 1.2x (Mixtral) to 2x
    (Qwen3-30B-A3B) the measured time."""
    for model in ("mixtral_8x7b", "qwen3_30b_a3b"):
        one = FusedMoeBench([r for r in published_rows() if r["model"] == model and r["batch_size"] == "1"])
        assert one.ratios()[0] == pytest.approx(1.0, abs=0.15), model
    assert load_profile("h100").op("elementwise").t0_s < load_profile("h100").op("gemm").t0_s / 3


def test_many_small_fp8_experts_at_large_batches_run_slower_than_kvsim_times_them():
    """The known gap (docs/validation.md, item 3): Qwen3-30B-A3B's 128 experts of 768 in
    per-tensor FP8 run at about 190 TFLOP/s at 4,096 tokens in vLLM's Triton kernel, where kvsim's
    grouped GEMMs (shares of dense-GEMM efficiencies at each expert's share of the tokens) take
    about a third of that time; the gap grows with the batch."""
    gap = bench("known_gap", "qwen3_30b_a3b")
    ratio = {int(r["batch_size"]): x for r, x in zip(gap.rows, gap.ratios())}
    assert ratio[4096] < 0.45 and ratio[256] < 0.8
    assert ratio[4096] < ratio[256] < ratio[16]


def test_tp8_expert_slices_on_h200_cost_more_per_touched_expert_than_kvsim_times():
    """The known gap at TP-8 expert slices (N=192 a GPU), the shape DeepSeek's and Qwen3-235B's
    TP-8 decode steps run: SGLang's default-config fused MoE on an H200 (PR #11730, per-tensor FP8,
    batch 1-32) takes about 0.9 us more per expert touched, where kvsim starts too slow at one
    token (its fixed costs) and ends a quarter too fast at 32 tokens (about 111 of 128 experts)."""
    gap = bench("known_gap", "qwen3_235b_a22b")
    ratio = {int(r["batch_size"]): x for r, x in zip(gap.rows, gap.ratios())}
    assert ratio[1] > 1.15 and ratio[32] < 0.8
    assert ratio[1] > ratio[8] > ratio[32]
