"""`python -m sim capacity` (sim/capacity_search.py): the search itself on made-up SLO outcomes,
and the command as a user runs it."""
import json

import pandas as pd
import pytest

from sim.capacity_search import CapacitySpec, offered_rate_rps, scale_arrivals, search_rate, search_replicas
from sim.errors import ConfigError
from sim.run import build_workload, prepare
from tests.conftest import compose_config
from tests.test_cli import assert_one_line_error, sim


def golden_setup():
    cfg = compose_config("run", ["+experiment=golden", "allocators=[paged]", "slo.ttft_s=1"])
    return prepare(cfg), build_workload(cfg, 0)


def outcome(met: bool, p90_s: float | None = None) -> dict:
    return {"slo": {"all_met": met, "percentile": 90.0, "goodput_requests_per_s": 0.0, "num_measured_requests": 500,
                    "attained_all_share_of_measured_requests": 1.0 if met else 0.0,
                    "ttft": {"p90_s": p90_s or (0.5 if met else 3.0), "target_s": 1.0}}}


def test_scaling_compresses_session_arrivals_and_keeps_think_times():
    _, workload = golden_setup()
    faster = scale_arrivals(workload, 4.0)
    first = min(s.arrival_time_s for s in workload.sessions)
    for before, after in zip(workload.sessions, faster.sessions):
        assert after.arrival_time_s - first == pytest.approx((before.arrival_time_s - first) / 4)
        assert after.turns == before.turns                       # lengths and think times unchanged
    assert offered_rate_rps(faster) == pytest.approx(4 * offered_rate_rps(workload))


@pytest.mark.parametrize("limit", [0.3, 1.0, 2.7, 40.0])
def test_rate_search_brackets_the_limit_within_the_tolerance(limit):
    setup, workload = golden_setup()
    base = offered_rate_rps(workload)
    spec = CapacitySpec(tolerance=0.05, max_steps=30)
    result, rows = search_rate(setup, workload, "paged", spec,
                               lambda scaled, _: outcome(offered_rate_rps(scaled) <= limit * base,
                                                         3.0 * offered_rate_rps(scaled) / base), lambda _: None)
    assert result["bracketed"] and result["num_steps"] == len(rows)
    assert limit / 1.05 <= result["max_rate_scale"] <= limit < result["first_missed_rate_rps"] / base
    assert result["max_rate_rps"] == pytest.approx(result["max_rate_scale"] * base)
    assert all(row["met"] == (row["scale"] <= limit) for row in rows)


def test_the_warmup_is_compressed_with_the_arrivals():
    import dataclasses
    setup, workload = golden_setup()
    setup = dataclasses.replace(setup, spec=dataclasses.replace(setup.spec, warmup_s=30.0))
    seen = []

    def run(scaled, sized):
        seen.append((offered_rate_rps(scaled) / offered_rate_rps(workload), sized.spec.warmup_s))
        return outcome(len(seen) < 3)
    search_rate(setup, workload, "paged", CapacitySpec(max_steps=4), run, lambda _: None)
    assert all(warmup == pytest.approx(30.0 / scale) for scale, warmup in seen) and len(seen) == 4


def test_the_rate_search_stops_halving_once_lower_rates_no_longer_help():
    setup, workload = golden_setup()
    result, rows = search_rate(setup, workload, "paged", CapacitySpec(max_steps=16),
                               lambda scaled, _: outcome(False), lambda _: None)  # TTFT p90 3 s at any rate
    assert len(rows) == 2 and result["unreachable"] and result["max_rate_rps"] == 0.0


def test_replica_search_finds_the_fewest_that_meet():
    setup, workload = golden_setup()
    result, rows = search_replicas(setup, workload, "paged", CapacitySpec(search="replicas"),
                                   lambda _, sized: outcome(sized.spec.num_replicas >= 5), lambda _: None)
    assert result["min_replicas"] == 5 and result["min_gpus"] == 5 * setup.spec.tensor_parallel_size
    assert sorted(row["num_replicas"] for row in rows) == [1, 2, 4, 5, 6, 8]


def test_bad_search_settings_are_refused():
    with pytest.raises(ConfigError, match="capacity.search"):
        CapacitySpec(search="gpus")


def test_capacity_command_writes_the_max_rate_and_its_steps(tmp_path):
    out = sim(tmp_path, "capacity", "+experiment=golden", "allocators=[paged]", "slo.ttft_s=1",
              "capacity.max_steps=5", "plots=true", "hydra.run.dir=cap")
    assert out.returncode == 0, out.stderr
    summary = json.loads((tmp_path / "cap" / "capacity.json").read_text())
    steps = pd.read_csv(tmp_path / "cap" / "capacity.csv")
    assert len(steps) == summary["num_steps"] <= 5
    met = steps[steps.met]
    assert summary["max_rate_rps"] == pytest.approx(met.rate_rps.max())
    assert (steps[~steps.met].rate_rps > summary["max_rate_rps"]).all()
    assert json.loads((tmp_path / "cap" / "paged" / "capacity.json").read_text())["max_rate_rps"] == summary["max_rate_rps"]
    assert "kv pool per replica" in out.stderr and "paged: max_rate_rps" in out.stdout
    assert (tmp_path / "cap" / "capacity.png").stat().st_size > 0


def test_capacity_without_a_target_and_run_with_capacity_keys_are_refused(tmp_path):
    assert_one_line_error(sim(tmp_path, "capacity", "+experiment=golden", "hydra.run.dir=x"), "slo.ttft_s")
    assert_one_line_error(sim(tmp_path, "run", "+experiment=golden", "capacity.search=replicas"),
                          "python -m sim capacity")
    assert_one_line_error(sim(tmp_path, "capacity", "+experiment=golden", "slo.ttft_s=1", "capacity.max_replicas=4",
                              "hydra.run.dir=y"), "capacity.max_replicas is not read", "capacity.search=rate")
    assert_one_line_error(sim(tmp_path, "capacity", "+experiment=golden", "slo.ttft_s=1", "capacity.search=replicas",
                              "capacity.tolerance=0.2", "hydra.run.dir=z"), "capacity.tolerance is not read")
    assert list(tmp_path.iterdir()) == []


def test_all_at_once_arrivals_search_replicas_with_any_router_but_no_rate(tmp_path):
    """A bench sending every request at once has no rate to scale: a rate search is one line (it
    crashed plotting a log axis of infinite rates); a replica search runs with the router given
    (the one replica of the bench config is not what it tries) and records the rate as Infinity."""
    bench = ["scenario=bench", "model=llama31_8b", "tensor_parallel_size=1", "scenario.num_prompts=10",
             "scenario.input_len=64", "scenario.output_len=8", "slo.ttft_s=2", "allocators=[paged]"]
    assert_one_line_error(sim(tmp_path, "capacity", *bench, "hydra.run.dir=rate"),
                          "capacity.search=rate scales the arrival rate", "capacity.search=replicas")
    assert not (tmp_path / "rate").exists()
    out = sim(tmp_path, "capacity", *bench, "capacity.search=replicas", "router=least_loaded", "hydra.run.dir=n")
    assert out.returncode == 0, out.stderr
    summary = json.loads((tmp_path / "n" / "capacity.json").read_text())
    assert summary["min_replicas"] >= 1 and summary["rate_rps"] == float("inf")
