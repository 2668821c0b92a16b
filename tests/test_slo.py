"""SLO attainment and goodput (sim/slo.py)."""
import math

import numpy as np
import pandas as pd
import pytest

from sim.errors import ConfigError
from sim.run import run_all
from sim.slo import SloSpec, slo_block, slo_spec
from tests.conftest import compose_config


def frame(ttft, tpot=None, e2e=None):
    n = len(ttft)
    return pd.DataFrame({"ttft_s": ttft, "tpot_s": tpot if tpot is not None else [0.01] * n,
                         "e2e_s": e2e if e2e is not None else [1.0] * n})


def test_attainment_goodput_and_the_percentile_against_the_target():
    measured = frame(np.arange(1, 11) / 10)                       # 0.1 .. 1.0 s
    block = slo_block(SloSpec(ttft_s=0.5, percentile=90), measured, 0, duration_s=10.0)
    assert block["ttft"]["p90_s"] == pytest.approx(np.percentile(measured.ttft_s, 90))
    assert block["ttft"]["met"] is False and block["all_met"] is False
    assert block["ttft"]["attained_share_of_measured_requests"] == 0.5
    assert block["goodput_requests_per_s"] == 0.5                 # 5 good requests in 10 s
    assert slo_block(SloSpec(ttft_s=0.95), measured, 0, 10.0)["ttft"]["met"] is True


def test_every_target_must_hold_for_a_request_to_count_as_good():
    measured = frame([0.1, 0.1, 0.9], tpot=[0.01, 0.5, 0.01])
    block = slo_block(SloSpec(ttft_s=0.5, tpot_s=0.1), measured, 0, 1.0)
    assert block["attained_all_share_of_measured_requests"] == pytest.approx(1 / 3)
    assert block["goodput_requests_per_s"] == 1.0


def test_unfinished_requests_miss_every_target_and_one_token_outputs_meet_tpot():
    measured = frame([0.1] * 9, tpot=[math.nan] * 9)
    block = slo_block(SloSpec(ttft_s=0.5, tpot_s=0.05, percentile=90), measured, 1, 1.0)
    assert block["tpot"]["attained_share_of_measured_requests"] == 0.9
    assert block["ttft"]["p90_s"] is None and block["ttft"]["met"] is False  # the 10th never came
    assert block["num_measured_requests"] == 10


def test_goodput_counts_the_good_requests_that_finished_in_the_window_never_above_throughput():
    measured, finished_in_window = frame([0.1, 0.1, 0.9]), frame([0.1, 0.9])
    block = slo_block(SloSpec(ttft_s=0.5), measured, 0, 1.0, finished_in_window)
    assert block["attained_all_share_of_measured_requests"] == pytest.approx(2 / 3)
    assert block["goodput_requests_per_s"] == 1.0
    for extra in ([], ["slo.ttft_s=2", "slo.tpot_s=0.1"]):
        m = run_all(compose_config("run", ["+experiment=golden", "allocators=[paged]", *extra]))[0].metrics
        assert m["slo"]["goodput_requests_per_s"] <= m["throughput"]["requests_per_s"]
        if not extra:
            assert m["slo"]["goodput_requests_per_s"] == m["throughput"]["requests_per_s"]


def test_no_targets_means_every_finished_request_is_good():
    block = slo_block(SloSpec(), frame([5.0, 9.0]), 0, 2.0)
    assert block["all_met"] is True and block["goodput_requests_per_s"] == 1.0


@pytest.mark.parametrize("values, key", [({"ttft_s": 0}, "slo.ttft_s"), ({"percentile": 0}, "slo.percentile"),
                                         ({"e2e_s": -1.0}, "slo.e2e_s")])
def test_impossible_slos_are_refused_naming_the_key(values, key):
    with pytest.raises(ConfigError, match=key):
        slo_spec(values)


def test_more_replicas_never_lower_goodput_on_the_same_arrivals():
    goodput = []
    for replicas in (1, 2, 3):
        cfg = compose_config("run", ["+experiment=golden", "allocators=[paged]", "slo.ttft_s=1.0",
                                     "slo.tpot_s=0.05", f"cluster.num_replicas={replicas}"])
        goodput.append(run_all(cfg)[0].metrics["slo"]["goodput_requests_per_s"])
    assert goodput[0] < goodput[-1]
    assert goodput == sorted(goodput)
