"""MoE layers as vLLM's FusedMoE runs them and MLA's replicated and prefill projections."""
import dataclasses

import numpy as np
import pytest

from sim.latency import BatchShape, LatencyModel, load_profile
from sim.latency.calibrated import GROUPED
from sim.latency.model import mla_gemms
from sim.models import load_model

from tests.test_latency import bare


def test_mla_down_projections_are_replicated_and_the_rest_split_over_tp():
    model = load_model("deepseek_v3")
    for tp in (1, 8):
        gemms = mla_gemms(model, tp)
        replicated = gemms[0][0] * gemms[0][1]
        assert gemms[0] == (model.q_lora_rank + model.kv_lora_rank + model.qk_rope_head_dim, model.hidden_size)
        split = sum(n * k for n, k in gemms[1:])
        assert replicated + split * tp == pytest.approx(model.attention_params_per_layer)


def chunk(tokens, cached):
    return BatchShape(num_prefill_tokens=tokens, num_prefill_seqs=1, prefill_context_pairs=tokens * cached,
                      prefill_causal_pairs=tokens * (tokens + 1) // 2, prefill_kv_tokens=tokens + cached,
                      num_sampled=1)


def test_mla_chunked_prefill_decompresses_the_cached_prefix():
    latency = LatencyModel(load_model("deepseek_v3"), load_profile("h200"), 8, "bf16")
    assert "mla_up_projection" not in latency.breakdown(chunk(512, 0))
    small, large = (latency.breakdown(chunk(512, c))["mla_up_projection"] for c in (1024, 8192))
    assert 0 < small < large
    gqa = LatencyModel(load_model("llama31_70b"), load_profile("h200"), 8, "bf16")
    assert "mla_up_projection" not in gqa.breakdown(chunk(512, 8192))


def moe_time(model, tokens, profile=None):
    latency = LatencyModel(model, profile or load_profile("h200"), 8, "bf16")
    return latency.moe.time(tokens), latency


def test_a_token_touches_k_experts_and_many_tokens_touch_them_all():
    _, latency = moe_time(load_model("deepseek_v3"), 1)
    assert latency.moe.touched_experts(1) == pytest.approx(8)
    assert latency.moe.touched_experts(4096) == pytest.approx(256, rel=1e-6)


def test_moe_compute_bound_time_is_the_active_experts_flops_and_every_expert_runs_once():
    model = dataclasses.replace(load_model("deepseek_v3"), weight_dtype="bf16")
    profile = bare(load_profile("h200"))
    tokens = 65536
    time, latency = moe_time(model, tokens, profile)
    peak = profile.bf16_flops_per_s * profile.op("gemm").compute_efficiency
    routed = 2 * tokens * model.num_active_experts * model.expert_params / 8  # grouped, at its share of the peak
    shared = 2 * tokens * model.num_shared_experts * model.expert_params / 8  # dense GEMMs
    router = 2 * tokens * model.num_experts * model.hidden_size
    k, h, inter = model.num_active_experts, model.hidden_size, model.expert_intermediate_size / 8
    routing = tokens * (model.num_experts * 4 + k * 16 + k * 3 * inter * 2 + (k + 1) * h * 2)
    bandwidth = profile.hbm_bandwidth_bytes_per_s * profile.op("elementwise").memory_efficiency  # routing kernels
    per_expert = 2 * model.num_experts * GROUPED.per_group_s  # two grouped GEMMs, every expert touched
    assert time == pytest.approx(routed / (peak * GROUPED.compute_share) + (shared + router) / peak
                                 + routing / bandwidth + per_expert, rel=1e-6)


def test_a_small_moe_batch_reads_every_touched_expert_and_costs_more_per_token():
    model = load_model("deepseek_v3")
    one, latency = moe_time(model, 1)
    weights = (8 + 1) * model.expert_params / 8  # one byte per fp8 weight, TP 8
    assert one >= weights / load_profile("h200").hbm_bandwidth_bytes_per_s
    many, _ = moe_time(model, 256)
    assert many / 256 < one  # per token, batching amortises the expert weights


def moe_layers(tokens, profile, expert_tokens_cv=0.0):
    from sim.latency.calibrated import calibrated_gemm
    from sim.latency.moe import MoeLayer
    model = dataclasses.replace(load_model("deepseek_v3"), weight_dtype="bf16")
    gemm = calibrated_gemm(profile)
    return [MoeLayer(model, 8, gemm, "bf16", lambda nbytes: 0.0, ep, expert_tokens_cv=expert_tokens_cv)
            for ep in (False, True)]


def test_expert_parallelism_runs_the_same_expert_work_per_gpu_in_wider_gemms():
    """With the experts' load even (expert_tokens_cv=0) every GPU runs the mean: the same FLOPs,
    over 32 whole experts instead of slices of all 256 (fewer groups, each paying its own start)."""
    profile = bare(load_profile("h200"))
    tp, ep = moe_layers(65536, profile)  # compute-bound: time is FLOPs, plus a start per touched expert
    starts = 2 * GROUPED.per_group_s  # two grouped GEMMs a layer
    assert ep.time(65536) - 32 * starts == pytest.approx(tp.time(65536) - 256 * starts, rel=1e-9)
    assert ep.expert_gemms[0][0] == 8 * tp.expert_gemms[0][0]  # whole experts, not 1/8 slices
    assert ep.all_to_all_bytes(800) == 800 / 8 * 8 * 7168 * 2  # its 1/8 of the tokens, k = 8 copies


def test_an_expert_parallel_layer_waits_for_its_busiest_gpu():
    """With the default spread a compute-bound layer takes the busiest GPU's share of the copies
    over the mean's (about 1.35x over 8 GPUs of 32 experts), its all-to-all carries that GPU's
    copies, and the tensor-parallel layer (a slice of every expert on each GPU) is unchanged."""
    from sim.latency.expert_load import EXPERT_TOKENS_CV, busiest_gpu
    profile = bare(load_profile("h200"))
    even_tp, even_ep = moe_layers(65536, profile)
    tp, ep = moe_layers(65536, profile, EXPERT_TOKENS_CV)
    assert tp.time(65536) == even_tp.time(65536)
    _, busiest = busiest_gpu(65536, 8, 256, 256, 8, EXPERT_TOKENS_CV)
    assert 1.3 < busiest / (65536 * 8 / 8) < 1.4
    grouped, even = ep._parts(65536, None)[1], even_ep._parts(65536, None)[1]  # the routed experts' GEMMs
    assert grouped == pytest.approx(even * busiest / 65536, rel=0.01)
    assert ep.all_to_all_bytes(65536) == pytest.approx(busiest * 7168 * 2, rel=1e-12)
    # one token: its 8 experts land on about 2.4 of the 8 GPUs' 32 at most, where the mean is 1
    touched, copies = ep.busiest_gpu(1)
    assert 2.0 < touched < 3.0 and copies >= touched
    assert ep.time(1) > 1.5 * even_ep.time(1)  # weight-bound: the busiest GPU reads 2.4 experts' weights


def test_expert_parallelism_moves_routed_tokens_by_all_to_all_and_keeps_stretches_exact():
    model, profile = load_model("deepseek_v3"), load_profile("h200")
    tp = LatencyModel(model, profile, 8, "bf16")
    ep = LatencyModel(model, profile, 8, "bf16", expert_parallel=True)
    shape = BatchShape(num_decode_seqs=64, decode_context_tokens=64 * 900, num_sampled=64)
    assert "all_to_all" not in tp.breakdown(shape) and ep.breakdown(shape)["all_to_all"] > 0
    assert ep.breakdown(shape)["allreduce"] < tp.breakdown(shape)["allreduce"]  # MoE layers: no all-reduce
    dense = LatencyModel(load_model("llama31_70b"), profile, 8, "bf16", expert_parallel=True)
    assert "all_to_all" not in dense.breakdown(shape)
    contexts = np.arange(64 * 900, 64 * 900 + 64 * 20, 64)
    stepped = [ep.step_time(BatchShape(num_decode_seqs=64, decode_context_tokens=int(c), num_sampled=64))
               for c in contexts]
    assert ep.decode_step_times(64, contexts).tolist() == stepped


def test_block_scaled_fp8_gemms_run_at_fbgemms_measured_share_of_row_wise_fp8():
    from sim.latency.calibrated import BLOCK_SCALED_FP8_SHARE, FP8_BLOCK, calibrated_gemm
    gemm = calibrated_gemm(bare(load_profile("h200")))
    compute_bound = (65536, 7168, 7168)
    assert gemm.time(*compute_bound, FP8_BLOCK) == pytest.approx(
        gemm.time(*compute_bound, "fp8") / BLOCK_SCALED_FP8_SHARE, rel=1e-9)
    assert LatencyModel(load_model("deepseek_v3"), load_profile("h200"), 8, "bf16").gemm_dtype == FP8_BLOCK
    assert "gemm_fp8_block" in load_profile("h200").provenance()


def test_mla_decode_is_timed_by_its_own_operator_when_a_profile_has_one():
    from sim.latency.profile import OperatorEfficiency
    profile = load_profile("h200")
    assert profile.op("attention_decode_mla").source.startswith("prior:the attention_decode")
    slower = dataclasses.replace(profile, operators={**profile.operators, "attention_decode_mla": OperatorEfficiency(
        compute_efficiency=0.5, memory_efficiency=0.2, t0_s=4e-6, source="measured")})
    shape = BatchShape(num_decode_seqs=32, decode_context_tokens=32 * 4000, num_sampled=32)
    mla = [LatencyModel(load_model("deepseek_v3"), p, 8, "bf16").breakdown(shape)["attention_decode"]
           for p in (profile, slower)]
    gqa = [LatencyModel(load_model("llama31_70b"), p, 8, "bf16").breakdown(shape)["attention_decode"]
           for p in (profile, slower)]
    assert mla[1] > 2 * mla[0] and gqa[1] == gqa[0]
