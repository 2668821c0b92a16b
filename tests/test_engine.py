"""Whole simulations on the tiny golden set-up: metamorphic and behavioural checks."""
import json

import pytest

from sim.latency.model import BatchShape
from tests.conftest import compose_config
from sim.metrics import flatten
from sim.run import build_workload, prepare, run_all, simulate


def by_allocator(results):
    return {r.allocator: r for r in results}


def test_every_request_finishes_and_kv_fractions_sum_to_one(run_config):
    results = by_allocator(run_all(run_config()))
    for result in results.values():
        m = result.metrics
        assert m["num_finished"] == m["num_requests"] - m["num_rejected"] > 0
        kv = m["kv"]
        parts = [kv[k] for k in ("token_states_frac", "reserved_frac", "internal_frag_frac",
                                 "external_frag_frac", "cached_idle_frac", "free_frac")]
        assert abs(sum(parts) - 1.0) < 1e-9 and min(parts) >= 0


def test_contiguous_wastes_far_more_than_paged_and_prefix_hits(run_config):
    results = by_allocator(run_all(run_config()))
    contiguous, paged, prefix = (results[n].metrics for n in ("contiguous", "paged", "prefix"))
    assert contiguous["kv"]["waste_frac"] > 5 * paged["kv"]["waste_frac"]
    used = 1 - paged["kv"]["free_frac"] - paged["kv"]["cached_idle_frac"]
    assert paged["kv"]["token_states_frac"] >= 0.9 * used
    assert paged["prefix_cache"]["hit_rate"] == 0.0
    assert prefix["prefix_cache"]["hit_rate"] > 0.2        # shared system prompts and documents
    assert contiguous["kv"]["cached_idle_frac"] == paged["kv"]["cached_idle_frac"] == 0.0


@pytest.mark.parametrize("allocator", ["paged", "prefix"])
def test_more_memory_never_gives_more_preemptions(run_config, allocator):
    preemptions = []
    for pool in (402653184, 805306368, 1610612736):
        cfg = run_config(f"kv_cache_memory_bytes={pool}", f"allocators=[{allocator}]")
        preemptions.append(run_all(cfg)[0].metrics["scheduler"]["num_preemptions"])
    assert preemptions[0] > 0
    assert preemptions == sorted(preemptions, reverse=True)


@pytest.mark.parametrize("allocators", ["[prefix]", "[radix,contiguous_pow2]"])
def test_same_seed_gives_identical_results_and_another_seed_differs(run_config, allocators):
    first = [flatten(r.metrics) for r in run_all(run_config(f"allocators={allocators}"))]
    second = [flatten(r.metrics) for r in run_all(run_config(f"allocators={allocators}"))]
    other = [flatten(r.metrics) for r in run_all(run_config(f"allocators={allocators}", "seed=1"))]
    for a, b in zip(first, second):
        a.pop("wall_time_s"), b.pop("wall_time_s")
        assert a == b
    assert first[0]["sim_duration_s"] != other[0]["sim_duration_s"]


def test_session_turns_arrive_after_the_previous_turn_finished_plus_think_time(run_config):
    cfg = run_config("allocators=[paged]")
    setup = prepare(cfg)
    workload = build_workload(cfg, 0)
    requests = simulate(setup, workload, "paged", cfg.router).requests.set_index("request_id")
    think = {t.request_id: t.think_time_s for s in workload.sessions for t in s.turns}
    checked = 0
    for session in workload.sessions:
        for before, after in zip(session.turns, session.turns[1:]):
            expected = requests.loc[before.request_id, "finish_time_s"] + think[after.request_id]
            assert requests.loc[after.request_id, "arrival_time_s"] == pytest.approx(expected)
            checked += 1
    assert checked > 10


def test_prompts_longer_than_max_model_len_are_rejected_and_counted(run_config):
    result = run_all(run_config("max_model_len=1200", "allocators=[paged]",
                                "max_num_batched_tokens=1200"))[0]
    requests = result.requests
    rejected = requests[requests.status == "rejected"]
    assert len(rejected) == result.metrics["num_rejected"] > 0
    assert (rejected.prompt_tokens > 1200).all()
    finished = requests[requests.status == "finished"]
    assert (finished.prompt_tokens + finished.output_tokens <= 1201).all()


def test_ttft_and_e2e_are_the_step_times_of_a_hand_scheduled_request(tmp_path):
    """Derived by hand, not with the recorder's formula: on an idle replica, a 1000-token prompt
    is one prefill step (budget 8192) whose end brings the first token; each further output token
    is one decode step of that sequence alone over its context so far."""
    trace = tmp_path / "two.jsonl"
    rows = [{"timestamp": 0, "input_length": 1000, "output_length": 3, "hash_ids": [1, 2]},
            {"timestamp": 100_000, "input_length": 500, "output_length": 1, "hash_ids": [3]}]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = compose_config("run", ["scenario=trace", f"trace.path={trace}", "allocators=[paged]",
                                 "cluster.num_replicas=1"])
    setup = prepare(cfg)
    result = run_all(cfg)[0]
    step = setup.latency.step_time

    def prefill(tokens):
        return step(BatchShape(num_prefill_tokens=tokens, num_prefill_seqs=1, prefill_causal_pairs=tokens * (tokens + 1) // 2,
                               prefill_kv_tokens=tokens, num_sampled=1))

    def decode(context):
        return step(BatchShape(num_decode_seqs=1, decode_context_tokens=context, num_sampled=1))

    overhead = cfg.serving_overhead_s  # API, tokenisation, detokenisation: before the engine
    assert overhead > 0
    r = result.requests.set_index("request_id")
    assert r.loc[0, "ttft_s"] == pytest.approx(overhead + prefill(1000), rel=1e-12)
    assert r.loc[0, "e2e_s"] == pytest.approx(overhead + prefill(1000) + decode(1001) + decode(1002), rel=1e-12)
    assert r.loc[0, "tpot_s"] == pytest.approx((decode(1001) + decode(1002)) / 2, rel=1e-12)
    assert r.loc[1, "ttft_s"] == pytest.approx(overhead + prefill(500), rel=1e-12) == r.loc[1, "e2e_s"]
    latency = result.metrics["latency_s"]
    assert latency["ttft"]["mean"] == pytest.approx(overhead + (prefill(1000) + prefill(500)) / 2, rel=1e-12)
    # ITL pools every gap between consecutive tokens: the two decode steps of request 0.
    assert latency["itl"]["mean"] == pytest.approx((decode(1001) + decode(1002)) / 2, rel=1e-12)


def test_round_robin_alternates_replicas(run_config):
    result = run_all(run_config("router=round_robin", "allocators=[paged]"))[0]
    r = result.requests[result.requests.status == "finished"]
    counts = r.replica.value_counts()
    assert set(counts.index) == {0, 1} and abs(counts[0] - counts[1]) <= 1
