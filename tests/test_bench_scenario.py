"""scenario=bench: the requests vllm bench serve and trtllm-bench send, and the client's cap."""
import math

import numpy as np
import pytest

from sim.errors import ConfigError
from sim.run import run_all
from sim.workload.bench import BenchSpec
from tests.conftest import compose_config


def bench_config(*overrides):
    return compose_config("run", ["scenario=bench", "model=llama31_8b", "gpu=h100",
                                  "tensor_parallel_size=1", "plots=false", *overrides])


def test_fixed_lengths_all_at_once_by_default():
    workload = BenchSpec(input_len=300, output_len=40, num_prompts=50).generate(0)
    turns = [s.turns[0] for s in workload.sessions]
    assert {t.prompt_len for t in turns} == {300} and {t.output_len for t in turns} == {40}
    assert {s.arrival_time_s for s in workload.sessions} == {0.0}
    assert len({t.prefix_ids[-1] for t in turns}) == 50  # no two prompts share a token


def test_range_ratio_spreads_lengths_inside_the_range_and_rate_gives_poisson_gaps():
    spec = BenchSpec(input_len=1000, output_len=100, num_prompts=4000, request_rate=5.0,
                     range_ratio=0.5)
    workload = spec.generate(3)
    prompts = np.array([s.turns[0].prompt_len for s in workload.sessions])
    outputs = np.array([s.turns[0].output_len for s in workload.sessions])
    assert prompts.min() >= 500 and prompts.max() <= 1500 and prompts.std() > 200
    assert outputs.min() >= 50 and outputs.max() <= 150
    arrivals = np.array([s.arrival_time_s for s in workload.sessions])
    assert arrivals[0] == 0.0
    gaps = np.diff(arrivals)
    assert gaps.mean() == pytest.approx(0.2, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)  # exponential: cv 1


@pytest.mark.parametrize("kwargs", [dict(request_rate=0), dict(request_rate="fast"),
                                    dict(max_concurrency=0), dict(range_ratio=1.0),
                                    dict(input_len=0)])
def test_impossible_settings_are_refused(kwargs):
    with pytest.raises(ConfigError, match="scenario"):
        BenchSpec(**{"input_len": 10, "output_len": 5, "num_prompts": 3, **kwargs})


def in_flight_at_arrivals(requests):
    arrivals, finishes = requests.arrival_time_s.to_numpy(), requests.finish_time_s.to_numpy()
    return [int(((arrivals <= t) & (finishes > t)).sum()) for t in arrivals]


def test_max_concurrency_one_sends_each_request_when_the_previous_finished():
    result = run_all(bench_config("scenario.num_prompts=6", "scenario.input_len=200",
                                  "scenario.output_len=20", "scenario.max_concurrency=1"))[0]
    requests = result.requests.sort_values("arrival_time_s")
    assert (requests.arrival_time_s.to_numpy()[1:] == requests.finish_time_s.to_numpy()[:-1]).all()
    assert max(in_flight_at_arrivals(requests)) == 1
    # Identical lone requests take identical times: the clock starts at sending, not at t = 0.
    assert np.ptp(requests.e2e_s.to_numpy()) < 1e-9
    client = result.metrics["client"]
    assert client["num_held_requests"] == 5 and client["mean_held_s_per_held_request"] > 0
    assert result.metrics["measurement"]["num_measured_requests"] == 6  # every request counts


def test_max_concurrency_caps_requests_in_flight_and_unlimited_does_not():
    capped = run_all(bench_config("scenario.num_prompts=40", "scenario.input_len=100",
                                  "scenario.output_len=30", "scenario.max_concurrency=8"))[0]
    assert max(in_flight_at_arrivals(capped.requests)) == 8
    assert capped.metrics["client"]["num_held_requests"] == 32
    free = run_all(bench_config("scenario.num_prompts=40", "scenario.input_len=100",
                                "scenario.output_len=30"))[0]
    assert "client" not in free.metrics
    assert free.metrics["latency_s"]["ttft"]["p50"] > capped.metrics["latency_s"]["ttft"]["p50"]
    assert math.isclose(free.metrics["vllm_bench"]["completed"], 40)
