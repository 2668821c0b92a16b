"""Time-weighted KV fractions and the summary's definitions on hand-made tables."""
import numpy as np
import pandas as pd
import pytest

from sim.metrics import TIMELINE_COLUMNS, kv_fractions, summarize, weighted_percentiles


def timeline(rows):
    # rows: (replica, time, token_states, reserved, internal, external, cached, free)
    records = []
    for replica, time_s, *parts in rows:
        records.append((replica, time_s, sum(parts), *parts, 1, 1, 1, 0, 0, 0, 1))
    return pd.DataFrame.from_records(records, columns=TIMELINE_COLUMNS)


def test_each_sample_is_held_until_that_replicas_next_step():
    t = timeline([
        (0, 0.0, 0, 0, 0, 0, 0, 100),     # all free for 1 s
        (0, 1.0, 50, 10, 0, 0, 0, 40),    # then for 3 s
        (1, 0.0, 0, 0, 0, 0, 0, 100),     # replica 1 idle throughout
    ])
    kv = kv_fractions(t, 0.0, 4.0)
    assert kv["token_states_frac"] == pytest.approx(50 * 3 / (100 * 4 * 2))
    assert kv["reserved_frac"] == pytest.approx(10 * 3 / 800)
    assert sum(kv.values()) == pytest.approx(1.0)


def test_summary_definitions():
    requests = pd.DataFrame({
        "request_id": [0, 1, 2], "session_id": [0, 1, 2], "turn": [0, 0, 0], "replica": [0, 0, -1],
        "status": ["finished", "finished", "rejected"], "arrival_time_s": [1.0, 2.0, 3.0],
        "first_token_time_s": [1.5, 2.5, float("nan")], "finish_time_s": [3.5, 2.5, float("nan")],
        "prompt_tokens": [100, 50, 10_000], "output_tokens": [5, 1, 0],
        "total_output_tokens": [5, 1, 0], "num_samples": [1, 1, 1],
        "prefix_hit_tokens": [32, 0, 0], "num_preemptions": [1, 0, 0],
        "requested_output_tokens": [5, 1, 7]})
    requests["ttft_s"] = requests.first_token_time_s - requests.arrival_time_s
    requests["e2e_s"] = requests.finish_time_s - requests.arrival_time_s
    requests["tpot_s"] = [(2.5 - 0.5) / 4, float("nan"), float("nan")]
    t = timeline([(0, 1.0, 10, 0, 0, 0, 0, 90)])
    m = summarize(requests, t, wall_time_s=0.1, gpu="h100", profile_source="datasheet")
    assert m["sim_duration_s"] == 2.5                       # last finish 3.5 - first arrival 1.0
    assert m["num_rejected"] == 1 and m["num_finished"] == 2 and m["num_requests"] == 3
    assert m["throughput"]["output_tokens_per_s"] == pytest.approx(6 / 2.5)
    assert m["latency_s"]["tpot"]["mean"] == pytest.approx(0.5)   # only the 5-token request
    assert m["prefix_cache"] == {"hit_rate": 32 / 150, "hit_tokens": 32, "prompt_tokens": 150}
    assert m["kv"]["waste_frac"] == 0.0
    assert m["latency_profile"] == {"gpu": "h100", "source": "datasheet"}


def _requests(arrivals, finishes, outputs):
    n = len(arrivals)
    frame = pd.DataFrame({
        "request_id": range(n), "session_id": range(n), "turn": [0] * n, "replica": [0] * n,
        "status": ["finished"] * n, "arrival_time_s": arrivals,
        "first_token_time_s": [a + 0.5 for a in arrivals], "finish_time_s": finishes,
        "prompt_tokens": [100] * n, "output_tokens": outputs, "total_output_tokens": outputs,
        "num_samples": [1] * n, "prefix_hit_tokens": [0] * n, "num_preemptions": [0] * n,
        "requested_output_tokens": outputs})
    frame["ttft_s"] = frame.first_token_time_s - frame.arrival_time_s
    frame["e2e_s"] = frame.finish_time_s - frame.arrival_time_s
    frame["tpot_s"] = (frame.e2e_s - frame.ttft_s) / (frame.output_tokens - 1)
    return frame


def test_warmup_and_drain_are_left_out_of_latency_throughput_and_kv_but_not_of_counts():
    # Arrivals at 0, 10, 20, 30; the first request is slow (warm-up), the drain runs to 50.
    requests = _requests([0.0, 10.0, 20.0, 30.0], [8.0, 12.0, 22.0, 50.0], [5, 5, 5, 5])
    requests.loc[0, "first_token_time_s"] = 6.0
    requests["ttft_s"] = requests.first_token_time_s - requests.arrival_time_s
    t = pd.DataFrame.from_records([
        # replica, time, capacity, token_states, reserved, internal, external, cached, free, ...,
        # num_output_tokens: 3 tokens sampled at 5 s, 4 at 15 s, 6 at 25 s, 7 at 45 s
        (0, 0.0, 100, 0, 0, 0, 0, 0, 100, 0, 0, 0, 0, 0, 0, 0),
        (0, 5.0, 100, 80, 0, 0, 0, 0, 20, 1, 1, 1, 0, 0, 0, 3),
        (0, 15.0, 100, 20, 0, 0, 0, 0, 80, 1, 1, 1, 0, 0, 0, 4),
        (0, 25.0, 100, 40, 0, 0, 0, 0, 60, 1, 1, 1, 0, 0, 0, 6),
        (0, 45.0, 100, 0, 0, 0, 0, 0, 100, 1, 1, 1, 0, 0, 0, 7)], columns=TIMELINE_COLUMNS)
    m = summarize(requests, t, wall_time_s=0.0, gpu="h100", profile_source="datasheet",
                  warmup_s=10.0, exclude_drain=True)
    later = summarize(requests, t, wall_time_s=0.0, gpu="h100", profile_source="datasheet",
                      warmup_s=10.0, exclude_drain=True, last_session_arrival_s=20.0)
    assert later["measurement"]["window_s"] == [10.0, 20.0]       # the last new session's arrival
    assert m["measurement"]["window_s"] == [10.0, 30.0]           # first arrival + 10 .. last arrival
    assert m["measurement"]["excluded_warmup_s"] == [0.0, 10.0]
    assert m["measurement"]["excluded_drain_s"] == [30.0, 50.0]
    assert m["latency_s"]["ttft"]["mean"] == pytest.approx(0.5)   # the slow first request is out
    assert m["measurement"]["num_measured_requests"] == 3
    assert m["measurement"]["duration_s"] == 20.0
    assert m["sim_duration_s"] == 50.0                            # unchanged: last finish - first arrival
    assert m["vllm_bench"]["completed"] == 2                       # finished inside the window
    assert m["throughput"]["output_tokens_per_s"] == pytest.approx((4 + 6) / 20)
    assert m["throughput"]["requests_per_s"] == pytest.approx(2 / 20)   # finished at 12 and 22
    # KV over [10, 30]: 80 until 15, 20 until 25, 40 until 30 -> (5*80 + 10*20 + 5*40) / (20*100)
    assert m["kv"]["token_states_of_capacity"] == pytest.approx(800 / 2000)
    assert m["num_requests"] == m["num_finished"] == 4               # counts cover every request


def test_shares_name_their_denominator():
    t = timeline([(0, 0.0, 30, 10, 0, 0, 20, 40)])   # token states, reserved, cached idle, free
    m = summarize(_requests([0.0], [1.0], [2]), t, wall_time_s=0.0, gpu="h100", profile_source="x")
    kv = m["kv"]
    assert kv["token_states_of_capacity"] == kv["token_states_frac"] == pytest.approx(0.3)
    assert kv["waste_of_used"] == kv["waste_frac"] == pytest.approx(10 / 40)   # used = 100 - 40 - 20
    assert kv["token_states_of_used"] == pytest.approx(30 / 40)


def test_weighted_percentiles_equal_numpy_on_the_repeated_values():
    rng = np.random.default_rng(0)
    values, weights = rng.exponential(size=50), rng.integers(1, 20, size=50)
    got = weighted_percentiles(values, weights)
    repeated = np.repeat(values, weights)
    assert got["mean"] == pytest.approx(repeated.mean())
    for q in (50, 90, 99):
        assert got[f"p{q}"] == np.percentile(repeated, q, method="inverted_cdf")


def test_vllm_bench_block_is_the_seconds_keys_in_milliseconds():
    m = summarize(_requests([0.0, 1.0], [3.0, 4.0], [5, 3]), timeline([(0, 0.0, 0, 0, 0, 0, 0, 10)]),
                  wall_time_s=0.0, gpu="h100", profile_source="x")
    bench, latency = m["vllm_bench"], m["latency_s"]
    assert bench["mean_ttft_ms"] == pytest.approx(latency["ttft"]["mean"] * 1e3)
    assert bench["median_tpot_ms"] == pytest.approx(latency["tpot"]["p50"] * 1e3)
    assert bench["p99_e2el_ms"] == pytest.approx(latency["e2e"]["p99"] * 1e3)
    assert bench["output_throughput"] == m["throughput"]["output_tokens_per_s"] == pytest.approx(8 / 4)
    assert bench["total_token_throughput"] == pytest.approx((8 + 200) / 4)
