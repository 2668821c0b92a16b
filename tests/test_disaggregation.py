"""Prefill/decode disaggregation (sim/engine/disaggregated.py, sim/disaggregation.py)."""
import pytest

from sim.engine.disaggregated import LinkSpec
from sim.errors import ConfigError
from sim.run import build_workload, run_all
from tests.conftest import compose_config

SYNTHETIC = ["model=llama31_8b", "tensor_parallel_size=1", "gpu=h100", "allocators=[paged]", "plots=false",
             "scenario=synthetic", "scenario.num_requests=300", "scenario.request_rate_per_s=6",
             "scenario.input_tokens_mean=3000", "scenario.output_tokens_mean=300"]


def golden(*overrides):
    return compose_config("run", ["+experiment=golden", "disaggregation.enabled=true", *overrides])


def test_the_link_moves_each_prefill_ranks_shard_in_parallel():
    link = LinkSpec(bandwidth_bytes_per_s=50e9, latency_s=1e-4, kv_bytes_per_token=131072, ranks=2)
    assert link.transfer_s(1000) == pytest.approx(1e-4 + 1000 * 131072 / 100e9)


def test_every_request_is_served_and_its_prompt_kv_crosses_once():
    cfg = golden("allocators=[paged,prefix]")
    prompts = sum(r.prompt_len - 1 for s in build_workload(cfg, 0).sessions for r in s.turns)
    for result in run_all(cfg):
        m, facts = result.metrics, result.metrics["disaggregation"]
        assert m["num_finished"] == m["num_requests"] > 0
        assert facts["transferred_bytes"] == pytest.approx(prompts * 131072)  # Llama-3-8B: 128 KiB a token
        last = result.timeline.groupby("replica").tail(1)
        assert sorted(last.replica) == [0, 1] and (last.token_states == 0).all()  # both pools empty at the end
        assert result.requests.replica.eq(1).all()                               # served by the decode pool
        routing = m["routing"]                  # the prefill replica computed the prompts, less hits
        hits = int(result.requests.prefix_hit_tokens.sum())
        assert routing["prefilled_tokens_per_replica"] == [prompts + m["num_finished"] - hits, m["num_finished"]]
        assert routing["finished_requests_per_replica"] == [0, m["num_finished"]]


def test_ttfts_parts_add_up_and_the_decode_pool_pushes_back_when_full():
    waits = []
    for pool in ("402653184", "1610612736"):  # the decode pool's KV, per GPU
        m = run_all(golden("allocators=[paged]", f"kv_cache_memory_bytes={pool}"))[0].metrics
        split = m["disaggregation"]["ttft_split"]
        parts = sum(split[k]["mean"] for k in ("queueing_s", "prefill_s", "transfer_s", "decode_wait_s"))
        assert parts == pytest.approx(split["ttft_s"]["mean"]) == pytest.approx(m["latency_s"]["ttft"]["mean"])
        assert split["ttft_s"]["p90"] == pytest.approx(m["latency_s"]["ttft"]["p90"])
        waits.append(split["decode_wait_s"]["mean"])
    assert waits[0] > 5 * waits[1]                 # a small decode pool holds requests back


def test_the_ttft_split_covers_the_measured_requests_as_latency_does():
    m = run_all(compose_config("run", [*SYNTHETIC, "disaggregation.enabled=true", "measure.warmup_s=30"]))[0].metrics
    split, ttft = m["disaggregation"]["ttft_split"]["ttft_s"], m["latency_s"]["ttft"]
    assert m["measurement"]["num_measured_requests"] < m["num_finished"]
    assert (split["mean"], split["p90"]) == (pytest.approx(ttft["mean"]), pytest.approx(ttft["p90"]))


def test_disaggregation_removes_prefill_interference_from_decode_at_equal_gpus():
    """DistServe (Zhong et al., OSDI 2024): a decode instance that never runs prefill chunks keeps
    its token times flat; colocated replicas interleave prefills with decodes. Two H100s each way."""
    colocated = run_all(compose_config("run", [*SYNTHETIC, "cluster.num_replicas=2"]))[0].metrics["latency_s"]
    split = run_all(compose_config("run", [*SYNTHETIC, "disaggregation.enabled=true"]))[0].metrics["latency_s"]
    assert split["itl"]["p99"] < 0.5 * colocated["itl"]["p99"]
    assert split["ttft"]["p50"] > colocated["ttft"]["p50"]   # one prefill GPU instead of two


@pytest.mark.parametrize("overrides, key", [
    (["allocators=[contiguous]"], "allocators"),
    (["allocators=[paged]", "kv_offload.cpu_gib=4"], "kv_offload"),
    (["allocators=[paged]", "disaggregation.decode_replicas=0"], "disaggregation.decode_replicas"),
])
def test_what_disaggregation_does_not_take_is_refused(overrides, key):
    with pytest.raises(ConfigError, match=key):
        run_all(golden(*overrides))
