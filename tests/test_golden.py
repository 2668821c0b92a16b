"""The golden scenario's metrics are committed; any drift must be deliberate."""
import json

import pytest

from tests.regenerate_golden import GOLDEN, golden_metrics


def test_golden_scenario_reproduces_committed_metrics():
    expected = json.loads(GOLDEN.read_text())
    actual = golden_metrics()
    assert sorted(actual) == sorted(expected) == ["contiguous", "paged", "prefix"]
    for allocator, values in expected.items():
        for key, value in values.items():
            got = actual[allocator][key]
            if isinstance(value, float):
                assert got == pytest.approx(value, rel=1e-9, abs=1e-12), f"{allocator} {key}"
            else:
                assert got == value, f"{allocator} {key}"
