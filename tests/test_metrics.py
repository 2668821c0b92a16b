"""Time-weighted KV fractions and the summary's definitions on hand-made tables."""
import pandas as pd
import pytest

from sim.metrics import TIMELINE_COLUMNS, kv_fractions, summarize


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
