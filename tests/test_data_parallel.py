"""Data-parallel attention with expert-parallel MoE (`data_parallel_size`, vLLM's DP + EP, SGLang's
--enable-dp-attention, TensorRT-LLM's enable_attention_dp): memory, conservation of the experts'
work, the busiest rank's share of a step, and the refusals."""
import dataclasses
import json

import numpy as np
import pytest

from sim.capacity import size_kv_pool
from sim.latency import BatchShape, LatencyModel, load_profile
from sim.latency.calibrated import calibrated_gemm
from sim.latency.moe import MoeLayer
from sim.models import load_model

from tests.test_cli import SMALL, assert_one_line_error, sim


def pool(tp, dp, model="deepseek_v3", gpu="h200"):
    return size_kv_pool(load_model(model), load_profile(gpu), tensor_parallel_size=tp, kv_dtype="bf16",
                        block_size=64, max_model_len=4096, gpu_memory_utilization=0.9,
                        activation_reserve_bytes=2 * 2**30, kv_cache_memory_bytes=None, data_parallel_size=dp)


def test_each_rank_keeps_all_but_the_routed_experts_and_mla_kv_is_not_replicated_across_ranks():
    model, profile = load_model("deepseek_v3"), load_profile("h200")
    routed = model.num_moe_layers * model.num_experts * model.expert_params * 1  # fp8: a byte a weight
    assert model.stored_weight_bytes(1) == model.weight_bytes
    assert model.stored_weight_bytes(8) == pytest.approx(8 * model.weight_bytes - 7 * routed)
    tp8, dp8 = pool(8, 1), pool(1, 8)
    gpus_memory = 0.9 * profile.memory_bytes * 8 - 8 * 2 * 2**30
    assert tp8.pool_bytes == int(gpus_memory - model.weight_bytes)
    assert dp8.pool_bytes == int(gpus_memory - model.stored_weight_bytes(8))
    # MLA's latent lives on every GPU of a TP group; across DP ranks each token is stored once
    assert tp8.bytes_per_token == 8 * dp8.bytes_per_token
    assert dp8.num_blocks > 5 * tp8.num_blocks


def moe(tp, dp, profile):
    model = dataclasses.replace(load_model("deepseek_v3"), weight_dtype="bf16")
    return MoeLayer(model, tp, calibrated_gemm(profile), "bf16", lambda nbytes: 0.0, True, dp)


def test_every_routed_token_is_run_once_over_the_ranks_experts():
    """DP 8 x TP 1 with 100 tokens a rank runs the same expert GEMMs and all-to-all messages per
    GPU as EP over a TP group of 8 with the 800 tokens."""
    profile = load_profile("h200")
    calls = {}
    for name, layer, tokens in (("dp", moe(1, 8, profile), 100), ("tp", moe(8, 1, profile), 800)):
        seen, gemm = [], layer.gemm
        layer.gemm = type("Recorder", (), {"time": gemm.time,
                                           "grouped_time": lambda self, *a, seen=seen, gemm=gemm:
                                           seen.append(a) or gemm.grouped_time(*a)})()
        layer.time(tokens)
        calls[name] = (seen, layer.all_to_all_bytes(tokens), layer.ep)
    assert calls["dp"][0] == calls["tp"][0]  # experts per GPU, tokens per expert, widths
    assert calls["dp"][1] == calls["tp"][1] and calls["dp"][2] == calls["tp"][2] == 8
    # unbalanced ranks: the tokens of all ranks, given, decide the experts' work
    layer = moe(1, 8, profile)
    assert layer.time(100, every=800) == layer.time(100) and layer.time(100, every=400) < layer.time(100)


def latency(dp=8, tp=1, graphs=()):
    return LatencyModel(load_model("deepseek_v3"), load_profile("h200"), tp, "bf16", graphs,
                        expert_parallel=True, data_parallel_size=dp)


def test_the_busiest_rank_holds_its_share_of_the_decodes_and_a_prefill_chunk_whole():
    dp8 = latency()
    whole = BatchShape(num_prefill_tokens=3 * 512, num_prefill_seqs=3, prefill_context_pairs=0,
                       prefill_causal_pairs=3 * 512 * 513 // 2, prefill_kv_tokens=3 * 512,
                       num_decode_seqs=16, decode_context_tokens=16 * 2000, num_sampled=16 + 3)
    rank = dp8.rank_shape(whole)
    assert (rank.num_prefill_tokens, rank.num_prefill_seqs, rank.num_decode_seqs, rank.num_sampled) == (512, 1, 2, 3)
    assert rank.decode_context_tokens == 4000
    times = dp8.breakdown(whole)
    assert times["attention_prefill"] == pytest.approx(
        dp8.attention_layers * dp8.attention_prefill_time(rank), rel=1e-12)
    assert times["mlp"] == pytest.approx(  # MoE layers run every rank's 16 + 1,536 tokens
        dp8.num_dense_layers * dp8._gemms(rank.num_tokens, dp8.dense_mlp_gemms)
        + dp8.model.num_moe_layers * dp8.moe.time(rank.num_tokens, whole.num_tokens), rel=1e-12)
    few = BatchShape(num_decode_seqs=3, decode_context_tokens=3000, num_sampled=3)
    assert dp8.rank_shape(few).num_decode_seqs == 1  # one sequence on each of 3 ranks


def test_data_parallel_attention_reads_each_ranks_kv_and_beats_tp_on_mla_decode():
    shape = BatchShape(num_decode_seqs=1024, decode_context_tokens=1024 * 2048, num_sampled=1024)
    dp8, tp8 = latency(), latency(dp=1, tp=8)
    assert dp8.breakdown(shape)["attention_decode"] < tp8.breakdown(shape)["attention_decode"] / 2
    assert dp8.breakdown(shape)["allreduce"] == 0.0 and dp8.breakdown(shape)["all_to_all"] > 0


@pytest.mark.parametrize("graphs", [(), (1, 2, 4, 8, 16, 32, 64, 128)])
def test_decode_stretch_times_equal_the_step_loop_with_data_parallel_ranks(graphs):
    model = latency(graphs=graphs)
    for n in (3, 100, 1000):
        contexts = np.arange(n * 700, n * 700 + n * 30, n)
        stepped = [model.step_time(BatchShape(num_decode_seqs=n, decode_context_tokens=int(c), num_sampled=n))
                   for c in contexts]
        assert model.decode_step_times(n, contexts).tolist() == stepped


def test_a_run_with_data_parallel_ranks_schedules_each_ranks_sequences_and_says_so(tmp_path):
    args = ["run", "scenario=bench", "model=deepseek_v3", "gpu=h200", "tensor_parallel_size=1",
            "enable_expert_parallel=true", "max_num_seqs=4", "scenario.input_len=256", "scenario.output_len=16",
            "scenario.num_prompts=32", "plots=false", "allocators=[paged]", "hydra.run.dir=out"]
    out = sim(tmp_path, *args, "data_parallel_size=8")
    assert out.returncode == 0, out.stderr
    assert "data_parallel_size=8" in out.stdout.splitlines()[0]
    metrics = json.loads((tmp_path / "out" / "paged" / "metrics.json").read_text())
    assert metrics["scheduler"]["mean_batch_size"] > 4  # max_num_seqs is per rank: 8 ranks hold up to 32


@pytest.mark.parametrize("keys, fragments", [
    (["model=llama31_8b", "data_parallel_size=2", "tensor_parallel_size=1"],
     ["data_parallel_size=2 with llama31_8b, which has no experts", "cluster.num_replicas"]),
    (["model=deepseek_v3", "data_parallel_size=8", "tensor_parallel_size=1"],
     ["without expert parallelism", "key enable_expert_parallel"]),
    (["model=deepseek_v3", "data_parallel_size=2", "tensor_parallel_size=4", "enable_expert_parallel=true",
      "pipeline_parallel_size=2"], ["key pipeline_parallel_size"]),
    (["data_parallel_size=0"], ["data_parallel_size=0 is below 1"]),
])
def test_data_parallel_size_it_cannot_model_is_one_line(tmp_path, keys, fragments):
    assert_one_line_error(sim(tmp_path, "run", *SMALL, "gpu=h200", *keys), *fragments)


def test_a_sequences_chunk_is_at_most_one_ranks_token_budget():
    from sim.kvcache.block import BlockAllocator
    from sim.scheduler import Scheduler, SchedulerSpec, Sequence
    from tests.helpers import request
    per_rank, ranks = 8, 4
    spec = SchedulerSpec(4 * ranks, per_rank * ranks, True, 64, max_chunk_tokens=per_rank)
    scheduler = Scheduler(spec, BlockAllocator(64, 4))
    long, short = (Sequence(request(i, [(i, n)], 2), 0.0, 64) for i, n in ((1, 30), (2, 5)))
    scheduler.add(long), scheduler.add(short)
    plan = scheduler.schedule()
    assert [(s.seq_id, n) for s, n in plan.scheduled] == [(1, 8), (2, 5)]  # not 30: its rank's 8
    assert plan.shape.largest_chunk == (8, 0, 36, 8)


def test_a_rank_holding_a_large_chunk_is_not_sped_up_by_a_small_one_beside_it():
    dp8 = latency()

    def chunks(*sizes):
        return BatchShape(num_prefill_tokens=sum(sizes), num_prefill_seqs=len(sizes), prefill_context_pairs=0,
                          prefill_causal_pairs=sum(n * (n + 1) // 2 for n in sizes), prefill_kv_tokens=sum(sizes),
                          num_sampled=len(sizes), largest_chunk=(max(sizes), 0, max(sizes) * (max(sizes) + 1) // 2,
                                                                 max(sizes)))
    alone, beside = dp8.step_time(chunks(8000)), dp8.step_time(chunks(8000, 100))
    assert beside >= alone
    assert dp8.rank_shape(chunks(8000, 100)).num_prefill_tokens == 8000
    assert dp8.rank_shape(chunks(*[512] * 16)).num_prefill_tokens == 1024  # two on each of 8 ranks


@pytest.mark.parametrize("keys, fragments", [
    (["disaggregation.enabled=true"], ["with disaggregation is not modelled", "key data_parallel_size"]),
    (["gpu_memory_utilization=0.72", "max_model_len=163840"], ["data_parallel_size=8 ranks of tensor_parallel_size=1", "a rank",
                                       "key max_model_len"]),
])
def test_data_parallel_ranks_it_cannot_place_are_one_line(tmp_path, keys, fragments):
    assert_one_line_error(sim(tmp_path, "run", *SMALL, "gpu=h200", "model=deepseek_v3", "tensor_parallel_size=1",
                              "data_parallel_size=8", "enable_expert_parallel=true", *keys), *fragments)


def test_a_data_parallel_run_says_what_kvsim_simplifies_and_when_it_leaves_one_node(tmp_path):
    base = ["run", "scenario=bench", "model=deepseek_v3", "gpu=h200", "tensor_parallel_size=1",
            "enable_expert_parallel=true", "scenario.input_len=64", "scenario.output_len=4",
            "scenario.num_prompts=16", "plots=false", "allocators=[paged]"]
    within = sim(tmp_path, *base, "data_parallel_size=8")
    assert within.returncode == 0, within.stderr
    assert "share one scheduler and one KV pool" in within.stderr and "NVLink node" not in within.stderr
    across = sim(tmp_path, *base, "data_parallel_size=16")
    assert across.returncode == 0, across.stderr
    assert "spreads the experts over 16 GPUs, more than one 8-GPU NVLink node" in across.stderr
