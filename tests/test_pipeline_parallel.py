"""Pipeline parallelism: rounds of micro-batches, every token's work done once, whole prefill
chunks crossing the stages, KV capacity over TP x PP GPUs, and Vidur's TP 2 x PP 2 setup."""
import dataclasses

import numpy as np
import pytest

from sim.capacity import size_kv_pool
from sim.config import vllm_capture_sizes
from sim.latency import BatchShape, LatencyModel, load_profile
from sim.models import load_model

from tests.test_latency import bare


def prefill(tokens, cached=0):
    return BatchShape(num_prefill_tokens=tokens, num_prefill_seqs=1, prefill_context_pairs=tokens * cached,
                      prefill_causal_pairs=tokens * (tokens + 1) // 2, prefill_kv_tokens=tokens + cached,
                      num_sampled=1)


def decode(n, context=1000):
    return BatchShape(num_decode_seqs=n, decode_context_tokens=n * context, num_sampled=n)


def latency(pp, profile=None, tp=2, model="llama2_70b", graphs=()):
    return LatencyModel(load_model(model), profile or load_profile("a100_80g"), tp, "bf16", graphs, pp)


def test_every_tokens_work_is_done_once_across_stages_and_micro_batches():
    profile = bare(load_profile("h100"))
    big = dataclasses.replace(prefill(4096), num_prefill_tokens=16384, num_prefill_seqs=4)  # compute-bound
    one, two = latency(1, profile).breakdown(big), latency(2, profile).breakdown(big)
    for op in ("qkv_o_proj", "mlp"):  # GPU-seconds over both stages = one TP group's over every layer
        assert 2 * two[op] == pytest.approx(one[op], rel=1e-9)
    one, two = latency(1, profile).breakdown(decode(64)), latency(2, profile).breakdown(decode(64))
    for op in ("qkv_o_proj", "mlp"):  # memory-bound: each stage reads its layers once per micro-batch
        assert two[op] == pytest.approx(one[op], rel=0.02)  # (activations, a few percent, halve)
        assert two[op] < one[op]
    assert latency(2, profile).breakdown(decode(64))["lm_head"] == pytest.approx(
        2 * latency(1, profile).breakdown(decode(32))["lm_head"], rel=1e-12)  # one LM head per micro-batch


def test_a_prefill_chunk_crosses_every_stage_whole():
    two = latency(2)
    shape = dataclasses.replace(prefill(512, cached=1000), num_decode_seqs=8, decode_context_tokens=8000,
                                num_sampled=9)
    times = two.breakdown(shape)
    chunk_alone = sum(v for k, v in latency(1).breakdown(prefill(512, cached=1000)).items()
                      if k not in ("launch", "cpu", "cpu_output"))
    gpu = sum(v for k, v in times.items() if k not in ("launch", "cpu", "cpu_output"))
    assert times["pipeline_bubble"] > 0
    assert gpu == pytest.approx(chunk_alone + two.send_recv_time(512), rel=1e-9)
    assert "pipeline_bubble" not in two.breakdown(decode(8))  # decode rounds are balanced


@pytest.mark.parametrize("graphs", [(), vllm_capture_sizes(128)])
def test_decode_stretch_times_equal_the_step_loop_with_pipeline_stages(graphs):
    model = latency(2, graphs=graphs)
    for n in (5, 100):
        contexts = np.arange(n * 700, n * 700 + n * 30, n)
        stepped = [model.step_time(BatchShape(num_decode_seqs=n, decode_context_tokens=int(c), num_sampled=n))
                   for c in contexts]
        assert model.decode_step_times(n, contexts).tolist() == stepped


def pool(tp, pp, model="llama2_70b"):
    return size_kv_pool(load_model(model), load_profile("a100_80g"), tensor_parallel_size=tp, kv_dtype="fp16",
                        block_size=16, max_model_len=4096, gpu_memory_utilization=0.9,
                        activation_reserve_bytes=2 * 2**30, kv_cache_memory_bytes=None, pipeline_parallel_size=pp)


def test_pipeline_stages_add_their_memory_and_the_most_loaded_stage_bounds_the_blocks():
    tp4, tp2pp2 = pool(4, 1), pool(2, 2)
    assert tp2pp2.pool_bytes == tp4.pool_bytes and tp2pp2.num_blocks == tp4.num_blocks  # 80 layers split evenly
    assert pool(2, 2).num_blocks > 2 * pool(2, 1).num_blocks
    model = load_model("llama2_70b")
    uneven = size_kv_pool(dataclasses.replace(model, num_layers=81), load_profile("a100_80g"),
                          tensor_parallel_size=2, kv_dtype="fp16", block_size=16, max_model_len=4096,
                          gpu_memory_utilization=0.9, activation_reserve_bytes=2 * 2**30,
                          kv_cache_memory_bytes=None, pipeline_parallel_size=2)
    assert uneven.bytes_per_token == pytest.approx(tp2pp2.bytes_per_token / 80 * 82)  # 41 layers on a stage


def test_vidur_matched_at_tp2_pp2_lands_within_25_percent_of_vidurs_ttft_and_tpot(run_config):
    from tests.conftest import compose_config
    from sim.run import run_all
    metrics = run_all(compose_config("run", ["+experiment=vidur_matched"]))[0].metrics
    assert metrics["num_finished"] >= 9900
    # Vidur (Agrawal et al., MLSys 2024) on this setup: TTFT p50 0.50 s, TPOT p50 84.7 ms (issue 10).
    assert metrics["latency_s"]["ttft"]["p50"] == pytest.approx(0.50, rel=0.25)
    assert metrics["latency_s"]["tpot"]["p50"] == pytest.approx(0.0847, rel=0.25)


def test_a_batch_smaller_than_the_pipeline_runs_one_micro_batch_per_sequence():
    one_stage, four_stages = latency(1, tp=1, model="llama31_8b"), latency(4, tp=1, model="llama31_8b")
    lone, alone = four_stages.breakdown(decode(1)), one_stage.breakdown(decode(1))
    assert lone["cpu"] == alone["cpu"] and lone["lm_head"] == alone["lm_head"]  # one CPU step, one LM head
    assert lone["send_recv"] == 3 * four_stages.send_recv_time(1)  # its activations cross 3 boundaries
    assert four_stages.breakdown(decode(2))["cpu"] == pytest.approx(2 * one_stage.cpu_time(1))
