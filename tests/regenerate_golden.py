"""Rewrite tests/golden/metrics.json from the golden experiment. Run only on purpose, after a
change that is meant to move the golden numbers, and say why in the commit message:
    python -m tests.regenerate_golden   (prints each key that moved, and by how much)"""
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


def moved_keys(old: dict, new: dict) -> list[str]:
    """One line per key whose value changed, appeared or went, with the change."""
    lines = []
    for allocator in sorted(set(old) | set(new)):
        before, after = old.get(allocator, {}), new.get(allocator, {})
        for key in sorted(set(before) | set(after)):
            a, b = before.get(key), after.get(key)
            if a == b or (isinstance(a, float) and isinstance(b, float)
                          and abs(b - a) <= 1e-9 * abs(a) + 1e-12):  # test_golden's tolerance
                continue
            if key not in before or key not in after:
                lines.append(f"{allocator} {key}: {'added' if key not in before else 'removed'}")
            elif isinstance(a, (int, float)) and isinstance(b, (int, float)) and a:
                lines.append(f"{allocator} {key}: {a:.6g} -> {b:.6g} ({(b - a) / abs(a):+.1%})")
            else:
                lines.append(f"{allocator} {key}: {a!r} -> {b!r}")
    return lines


if __name__ == "__main__":
    previous = json.loads(GOLDEN.read_text()) if GOLDEN.is_file() else {}
    current = golden_metrics()
    changes = moved_keys(previous, current)
    GOLDEN.write_text(json.dumps(current, indent=2, sort_keys=True) + "\n")
    print("\n".join(changes) if changes else "no key moved")
    print(f"wrote {GOLDEN}: {len(changes)} keys moved (say which and why in the commit message)")
