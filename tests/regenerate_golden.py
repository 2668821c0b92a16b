"""Rewrite tests/golden/metrics.json from the golden experiment. Run only on purpose, after a
change that is meant to move the golden numbers, and say why in the commit message."""
import json
from pathlib import Path

from sim.metrics import flatten
from sim.run import run_all
from tests.conftest import compose_config

GOLDEN = Path(__file__).parent / "golden" / "metrics.json"


def golden_metrics() -> dict:
    results = run_all(compose_config("run", ["+experiment=golden"]))
    metrics = {}
    for result in results:
        flat = flatten(result.metrics)
        flat.pop("wall_time_s")
        metrics[result.allocator] = flat
    return metrics


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps(golden_metrics(), indent=2, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
