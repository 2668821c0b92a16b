"""kvsim's fused MoE kernels against vLLM's published fused_moe kernel times
(calibration/published/fused_moe_times.csv, its README; calibration/grouped_gemm.py).

vLLM's benchmarks/kernels/benchmark_moe.py times the routed experts' kernels (top-k, alignment,
the two grouped GEMMs, activation, weighted sum; for block-scaled FP8 also the two input
quantizations) in a CUDA graph with about uniform routing: MoeLayer.fused_time is that part of a
MoE layer (FusedMoeBench adds the quantizations, which kvsim counts with the elementwise kernels).
"""
import dataclasses
import statistics

import pytest

from calibration.grouped_gemm import FusedMoeBench, fit_grouped, published_rows
from sim.latency.calibrated import GROUPED, GroupedKernel
from sim.latency.profile import load_profile


def bench(role, model=None):
    return FusedMoeBench([r for r in published_rows(role) if model is None or r["model"] == model])


def ratio_by_batch(bench_rows: FusedMoeBench) -> dict[int, float]:
    """kvsim / measured of each row, by its batch size (the rows of one model, GPU and TP)."""
    return {int(r["batch_size"]): x for r, x in zip(bench_rows.rows, bench_rows.ratios(), strict=True)}


def test_the_shipped_grouped_kernel_is_the_fit_to_the_fit_rows():
    fitting = bench("fit")
    assert {r["model"] for r in fitting.rows} == {"mixtral_8x7b", "qwen3_235b_a22b"}
    fitted = fit_grouped(fitting)
    assert (fitted.compute_share, fitted.memory_share) == pytest.approx((GROUPED.compute_share, GROUPED.memory_share),
                                                                        abs=0.021)  # the grid's step is 0.02
    assert fitted.t0_s == pytest.approx(GROUPED.t0_s, abs=1.01e-6)  # steps of 1 us
    assert fitted.per_group_s == pytest.approx(GROUPED.per_group_s, abs=0.021e-6)  # steps of 0.02 us
    ratios = fitting.ratios()
    assert all(0.85 <= r <= 1.1 for r in ratios) and statistics.median(ratios) == pytest.approx(1.0, abs=0.03)
    # at the dense GEMM's efficiencies and fixed cost, with no cost per expert, TP-8 expert slices
    # at 32 tokens came out a quarter fast
    slices = bench("fit", "qwen3_235b_a22b")
    dense = GroupedKernel(1.0, 1.0, 1.0, 0.0)
    assert slices.ratios(dense)[-1] < 0.75 < slices.ratios()[-1]


def test_the_fit_recovers_known_parameters():
    fitting = bench("fit")
    known = GroupedKernel(0.7, 0.92, 4e-6, 0.3e-6)
    assert fit_grouped(fitting, fitting.predicted_us(known)) == pytest.approx(known, abs=1e-9)


def test_held_out_deepseek_block_fp8_qwen3_and_gemma4_small_experts_follow_the_fit():
    """Held out: DeepSeek-R1's block-scaled FP8 experts on an H200 at batch 1-8 (weight-bound),
    Qwen3-30B-A3B's 128 small per-tensor FP8 experts on an H100 at batch 1-128 (touching 8 to all
    of them), which the shares alone, at the dense GEMM's fixed cost, had at 0.86-0.89 from 16
    tokens up (0.82-0.85 before the read ceiling), and Gemma 4's 128 BF16 experts of 704 on an
    H200 at batch 8-1,536 (vLLM PR #44818's default config, 2026-06; added 2026-12-06, after the
    fit, and never fitted: 0.92-1.07; like Qwen3-30B's, its held-out batches were labelled after
    kvsim's ratios were seen)."""
    held_out = bench("held_out")
    assert {(r["model"], r["gpu"], r["dtype"]) for r in held_out.rows} == {
        ("deepseek_v3", "h200", "fp8_block"), ("qwen3_30b_a3b", "h100", "fp8"), ("gemma4_moe", "h200", "bf16")}
    ratios = held_out.ratios()
    assert all(0.8 <= r <= 1.15 for r in ratios), ratios
    assert statistics.median(ratios) == pytest.approx(1.0, abs=0.05)
    shares_only = dataclasses.replace(GROUPED, t0_s=1.0, per_group_s=0.0)  # the dense fixed cost, no cost per expert
    qwen = bench("held_out", "qwen3_30b_a3b")
    assert max(qwen.ratios(shares_only)[4:]) < 0.9 < min(qwen.ratios()[4:])
    with pytest.raises(ValueError, match="do not constrain the compute_share"):
        fit_grouped(bench("held_out", "deepseek_v3"))


def test_a_row_of_an_unknown_dtype_is_refused():
    row = {**published_rows("fit")[0], "dtype": "int8_w8a16"}
    with pytest.raises(ValueError, match="dtype 'int8_w8a16' is none of bf16, fp8, fp8_block"):
        FusedMoeBench([row])


def test_batch_one_pays_small_kernels_not_the_gemms_fixed_cost():
    """At one token a layer reads k experts' weights and runs a few small kernels: with the four
    routing kernels at the GEMM's 14 us fixed cost each it came out 1.2x (Mixtral) to 2x
    (Qwen3-30B-A3B) the measured time."""
    for model in ("mixtral_8x7b", "qwen3_30b_a3b", "qwen3_235b_a22b"):
        one = FusedMoeBench([r for r in published_rows() if r["model"] == model and r["batch_size"] == "1"])
        assert one.ratios()[0] == pytest.approx(1.0, abs=0.16), model
    assert load_profile("h100").op("elementwise").t0_s < load_profile("h100").op("gemm").t0_s / 3


def test_many_small_fp8_experts_at_large_batches_run_slower_than_kvsim_times_them():
    """The known gap (docs/validation.md, item 3): Qwen3-30B-A3B's 128 experts of 768 in
    per-tensor FP8 run at about 190 TFLOP/s at 4,096 tokens in vLLM's Triton kernel, where kvsim's
    grouped GEMMs (shares of dense-GEMM efficiencies at each expert's share of the tokens) take
    about a third of that time; the gap grows with the batch from 256 tokens (up to 128 the rows
    are held out and within 15%)."""
    gap = bench("known_gap", "qwen3_30b_a3b")
    ratio = ratio_by_batch(gap)
    assert ratio[4096] < 0.45 and ratio[256] < 0.85
    assert ratio[4096] < ratio[1024] < ratio[256]


def test_gemma4_bf16_experts_share_the_large_batch_gap_more_mildly_and_keep_a_floor_kvsim_lacks():
    """Gemma 4's BF16 experts (vLLM PR #44818, H200): from 2,048 tokens kvsim's time is about three
    quarters of the measured one (0.71-0.76), where for Qwen3-30B-A3B's FP8 experts at the same
    batches it is 0.36-0.44: the large-batch gap is not FP8's alone, but FP8's is the larger. At
    1-4 tokens the microbenchmark holds a floor of 185-189 us (8 experts touched at one token: 95
    MB of BF16 weights, 20 us of reads at the H200's bandwidth), which the PR leaves unexplained
    (it does not say whether it timed a CUDA graph) and the other sources' rows do not show
    (Qwen3-30B-A3B at one token: 44.5 us)."""
    gap = bench("known_gap", "gemma4_moe")
    ratio = ratio_by_batch(gap)
    qwen_ratio = ratio_by_batch(bench("known_gap", "qwen3_30b_a3b"))
    assert all(0.65 < ratio[b] < 0.85 for b in (2048, 3072, 4096))
    assert ratio[2048] > qwen_ratio[2048] + 0.2 and ratio[4096] > qwen_ratio[4096] + 0.2
    # the published floor itself (the data, not kvsim): 1, 2 and 4 tokens within 3% of each other
    measured = {int(r["batch_size"]): float(r["time_us"]) for r in gap.rows}
    assert max(measured[b] for b in (1, 2, 4)) / min(measured[b] for b in (1, 2, 4)) < 1.03
    assert ratio[1] < 0.3 < ratio[2] < ratio[4] < 0.7


def test_deepseek_experts_in_vllm_pr_13932_ran_two_to_five_times_slower_than_kvsim_times_them():
    """vLLM PR #13932's H100 table (2025-02-26): DeepSeek-V3's block-scaled FP8 experts at TP 1-8
    and 128-3,072 tokens take 2.5-5x kvsim's time in vLLM's Triton kernel of the day and 1.7-4.4x
    in DeepGEMM's grouped GEMM, nearly flat in the batch up to 1,536 tokens (every expert touched:
    the Triton kernel reads the weights at a fifth to under a third of the H100's bandwidth).
    Recorded, not fitted, and the cause is open (those kernels, the harness, the H100 variant):
    the same experts at TP 2 and 1-8 tokens in vLLM's kernel of 2026 (PR #36554, on an H200, held
    out) agree with kvsim, and so does SGLang 0.4.5's decode on 8 H200s (validation row R060,
    April 2025)."""
    gap = bench("known_gap", "deepseek_v3")
    assert {r["source"] for r in gap.rows} == {"https://github.com/vllm-project/vllm/pull/13932"}
    triton = [r for r in gap.rows if "Triton" in r["note"]]
    deepgemm = FusedMoeBench([r for r in gap.rows if "DeepGemm" in r["note"]])
    assert len(triton) == len(deepgemm.rows) == 25
    triton_ratios = FusedMoeBench(triton).ratios()
    assert max(triton_ratios) < 0.41 and min(triton_ratios) > 0.19
    assert max(deepgemm.ratios()) < 0.6 and min(deepgemm.ratios()) > 0.2
    tp8_rows = {int(r["batch_size"]): r for r in triton if r["tensor_parallel_size"] == "8"}
    tp8 = {batch: float(r["time_us"]) for batch, r in tp8_rows.items()}
    assert tp8[1536] / tp8[128] < 1.2  # the published times (not kvsim's): flat, weight reads set them
    # every routed expert's weights read once at 128-1,536 tokens, against the H100's datasheet
    # bandwidth: gate, up and down projections of each expert's TP-8 slice, one FP8 byte a weight
    row = tp8_rows[128]
    weights = (int(row["num_experts"]) * 3 * int(row["hidden_size"]) * int(row["expert_intermediate_size"])
               / int(row["tensor_parallel_size"]))
    h100 = load_profile("h100").hbm_bandwidth_bytes_per_s
    assert all(0.2 < weights / (tp8[b] * 1e-6) / h100 < 0.33 for b in (128, 256, 512, 1024, 1536))
