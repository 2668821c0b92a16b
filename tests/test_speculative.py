"""Speculative decoding (`speculative_config`, vLLM's --speculative-config): a one-layer draft
proposes k tokens, the model verifies 1 + k queries a sequence, and each verification yields the
measured acceptance length on average; the rejected drafts' slots are slack again."""
import json

import pandas as pd
import pytest

from sim.kvcache.block import BlockAllocator
from sim.latency import BatchShape, LatencyModel, load_profile
from sim.models import load_model
from sim.scheduler import Scheduler, SchedulerSpec, Sequence

from tests.helpers import request
from tests.test_cli import SMALL, assert_one_line_error, sim


def scheduler(k=3, accept=2.5, blocks=64, block_size=4):
    spec = SchedulerSpec(8, 64, True, 256, num_speculative_tokens=k, acceptance_length=accept)
    return Scheduler(spec, BlockAllocator(blocks, block_size))


def test_verifications_yield_the_acceptance_length_on_average_and_never_more_than_drafts_plus_one():
    s = scheduler(accept=2.5)
    seq = Sequence(request(1, [(1, 8)], 1000), 0.0, 2000)
    yields = []
    for _ in range(6):
        yields.append(s.accepted(seq, 3))
        seq.num_verifications += 1
    assert yields == [2, 3, 2, 3, 2, 3]
    assert scheduler(accept=4.0).accepted(seq, 2) == 3  # at most the drafts and the bonus token
    seq.num_output, seq.num_tokens = 999, 8 + 999
    assert s.accepted(seq, 3) == 1  # one token left to produce


def test_a_decoding_sequence_verifies_k_drafts_and_its_slots_do_not_drift():
    s = scheduler(k=3, accept=2.5)
    seq = Sequence(request(1, [(1, 8)], 40), 0.0, 256)
    s.add(seq)
    now, shapes = 0.0, []
    while seq.finish_time_s != seq.finish_time_s:
        plan = s.schedule()
        shapes.append(plan.shape)
        now += 1.0
        s.commit(plan, now)
        if seq.finish_time_s != seq.finish_time_s:
            record = s.allocator.seqs[seq.seq_id]
            assert record.num_tokens == seq.num_computed  # the rejected drafts' slots are slack
            assert len(record.table) <= -(-(seq.num_computed + 4) // 4)
    assert seq.num_output == 40
    verify = shapes[1]
    assert (verify.num_decode_seqs, verify.decode_queries, verify.num_sampled) == (1, 4, 4)
    assert verify.num_tokens == 4
    # 40 tokens: the prefill's first, then 39 from verifications yielding 2, 3, 2, 3, ...
    assert len(shapes) == 1 + 16


def latency(k=3):
    return LatencyModel(load_model("deepseek_v3"), load_profile("h200"), 8, "bf16", (1, 2, 4, 8, 16, 32),
                        expert_parallel=True, num_speculative_tokens=k)


def test_a_verification_step_reads_each_sequences_kv_once_for_its_queries_and_runs_k_draft_passes():
    model = latency()
    plain = BatchShape(num_decode_seqs=4, decode_context_tokens=4 * 2000, num_sampled=4)
    verify = BatchShape(num_decode_seqs=4, decode_context_tokens=4 * 2000, num_sampled=16, decode_queries=16)
    p, v = model.breakdown(plain), model.breakdown(verify)
    assert "speculative_draft" not in p and v["speculative_draft"] > 0
    assert p["attention_decode"] < v["attention_decode"] < 4 * p["attention_decode"]
    assert model.graph_size(verify) == 16  # captured by tokens, as vLLM does
    one_layer = sum(model.token_ops(4)) / model.model.num_layers
    assert v["speculative_draft"] == pytest.approx(
        3 * (one_layer + model.attention_decode_time(plain) + model.lm_head_time(4)), rel=1e-12)


def test_a_run_with_mtp_drafts_emits_every_token_in_fewer_steps_and_says_so(tmp_path):
    args = ["run", "scenario=bench", "model=deepseek_v3", "gpu=h200", "tensor_parallel_size=8",
            "scenario.input_len=256", "scenario.output_len=64", "scenario.num_prompts=4",
            "scenario.max_concurrency=1", "plots=false", "allocators=[paged]"]
    out = sim(tmp_path, *args, "hydra.run.dir=spec", "speculative_config.method=mtp",
              "speculative_config.num_speculative_tokens=3", "speculative_config.acceptance_length=2.8")
    assert out.returncode == 0, out.stderr
    assert "speculative_config.num_speculative_tokens=3" in out.stdout.splitlines()[0]
    base = sim(tmp_path, *args, "hydra.run.dir=base")
    assert base.returncode == 0, base.stderr
    spec, plain = (json.loads((tmp_path / run / "paged" / "metrics.json").read_text()) for run in ("spec", "base"))
    tokens = [pd.read_parquet(tmp_path / run / "paged" / "requests.parquet").output_tokens.tolist()
              for run in ("spec", "base")]
    assert tokens == [[64] * 4, [64] * 4]
    # 63 tokens after the first from verifications of 2.8 on average: 23 steps a request, not 63
    assert spec["scheduler"]["num_steps"] == 4 * (1 + 23) and plain["scheduler"]["num_steps"] == 4 * 64
    assert spec["vllm_bench"]["mean_tpot_ms"] < plain["vllm_bench"]["mean_tpot_ms"] / 2
    facts = spec["speculative_decoding"]
    assert facts["num_verifications"] == 4 * 23 and "speculative_decoding" not in plain
    assert facts["tokens_per_verification"] == pytest.approx(63 / 23)  # 2.74: the last one capped
    assert facts["accepted_share_of_draft_tokens"] == pytest.approx(4 * (63 - 23) / facts["num_draft_tokens"])
    assert "one-layer draft" in out.stderr


def test_the_draft_layer_takes_its_weights_and_kv_from_the_pool_and_drafts_run_per_micro_batch():
    from sim.capacity import size_kv_pool
    model, profile = load_model("llama31_8b"), load_profile("h100")

    def pool(draft_layers):
        return size_kv_pool(model, profile, tensor_parallel_size=1, kv_dtype="bf16", block_size=16,
                            max_model_len=8192, gpu_memory_utilization=0.9, activation_reserve_bytes=2 * 2**30,
                            kv_cache_memory_bytes=None, draft_layers=draft_layers)
    plain, drafted = pool(0), pool(1)
    assert plain.pool_bytes - drafted.pool_bytes == pytest.approx(model.weight_bytes / model.num_layers, abs=2)
    assert drafted.bytes_per_token == pytest.approx(plain.bytes_per_token * (model.num_layers + 1) / model.num_layers)
    verify = BatchShape(num_decode_seqs=64, decode_context_tokens=64 * 1000, num_sampled=256, decode_queries=256)
    one, two = (LatencyModel(load_model("llama31_70b"), load_profile("h100"), 2, "bf16", pipeline_parallel_size=pp,
                             num_speculative_tokens=3) for pp in (1, 2))
    micro = verify.micro_batch(2)
    assert two.breakdown(verify)["speculative_draft"] == pytest.approx(2 * two.draft_time(micro), rel=1e-12)
    assert one.breakdown(verify)["speculative_draft"] == pytest.approx(one.draft_time(verify), rel=1e-12)


@pytest.mark.parametrize("keys, fragments", [
    (["speculative_config.method=mtp", "speculative_config.num_speculative_tokens=3"],
     ["speculative_config.acceptance_length=None", "between 1 and 4"]),
    (["speculative_config.method=mtp", "speculative_config.num_speculative_tokens=2",
      "speculative_config.acceptance_length=3.5"], ["between 1 and 3"]),
    (["speculative_config.num_speculative_tokens=2"], ["give a method and 1 or more tokens"]),
    (["speculative_config.acceptance_length=2"], ["acceptance_length=2.0 without speculative decoding"]),
    (["speculative_config.method=mtp", "speculative_config.num_speculative_tokens=2",
      "speculative_config.acceptance_length=2", "allocators=[paged]", "enable_prefix_caching=true"],
     ["enable_prefix_caching=false"]),
    (["speculative_config.method=medusa", "speculative_config.num_speculative_tokens=2"],
     ["unknown speculative_config.method 'medusa'"]),
    (["speculative_config.method=mtp", "speculative_config.num_speculative_tokens=2",
      "speculative_config.acceptance_length=2", "allocators=[prefix]"], ["paged allocator only", "key allocators"]),
    (["speculative_config.method=mtp", "speculative_config.num_speculative_tokens=2",
      "speculative_config.acceptance_length=2", "disaggregation.enabled=true"], ["with disaggregation"]),
    (["speculative_config.method=eagle", "speculative_config.num_speculative_tokens=2",
      "speculative_config.acceptance_length=2", "model=gemma3_27b", "tensor_parallel_size=2"],
     ["gemma3_27b's layer groups", "key speculative_config.method"]),
])
def test_speculative_decoding_it_cannot_model_is_one_line(tmp_path, keys, fragments):
    assert_one_line_error(sim(tmp_path, "run", *SMALL, *keys), *fragments)


def test_the_draft_and_verification_cost_against_tensorrt_llms_deepseek_r1_mtp_measurements():
    """TensorRT-LLM tech blog 1 (DeepSeek-R1-FP4, 8 B200s, batch 1, 1k/2k): no MTP 111 TPS/user;
    MTP 1, 2, 3: acceptance 1.92, 2.58, 2.82 at 198, 250, 253 TPS/user. A step with k drafts then
    costs acceptance x 111 / TPS of a plain step: 1.08, 1.15, 1.24 (PR #4762: 1.08, 1.21, 1.34)."""
    import dataclasses
    model = dataclasses.replace(load_model("deepseek_v3"), weight_dtype="nvfp4")
    published = {1: 1.92 * 111 / 198, 2: 2.58 * 111 / 250, 3: 2.82 * 111 / 253}
    plain = BatchShape(num_decode_seqs=1, decode_context_tokens=2048, num_sampled=1)
    for k, cost in published.items():
        lat = LatencyModel(model, load_profile("b200"), 8, "bf16", (1, 2, 4, 8), expert_parallel=True,
                           async_scheduling=True, num_speculative_tokens=k)
        verify = BatchShape(num_decode_seqs=1, decode_context_tokens=2048, num_sampled=k + 1, decode_queries=k + 1)
        ratio = lat.step_time(verify) / lat.step_time(plain)
        assert ratio == pytest.approx(cost, rel=0.10)  # kvsim 1.07, 1.19, 1.21 (1.05, 1.13, 1.15 before 2026-12-06)
