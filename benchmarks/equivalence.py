"""Fingerprints of simulation results over every scenario and allocator, to show that an engine
change leaves results identical (issue 9: seams and speed must not move a number).

    python benchmarks/equivalence.py capture before.json [KEY=VALUE ...]
    python benchmarks/equivalence.py compare before.json [KEY=VALUE ...]

Each case is one small run; its fingerprint is every metric (wall time and the engine block, which
loop ran and its events, dropped) and a digest of
the request and timeline tables. `compare` prints each case that differs and exits 1 if any does.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests package, from a clone

from sim.metrics import flatten  # noqa: E402
from sim.run import run_all  # noqa: E402
from tests.conftest import compose_config  # noqa: E402
from tests.helpers import differing  # noqa: E402

ALLOCATORS = "[contiguous,contiguous_pow2,contiguous_oracle,paged,prefix,radix]"
SMALL = {
    "rag_agents": ["scenario.num_sessions=60", "scenario.session_rate_per_s=1.0",
                   "measure.warmup_s=10", "cluster.num_replicas=2"],
    "chat": ["scenario.num_sessions=80"],
    "code_completion": ["scenario.num_requests=300"],
    "doc_qa": ["scenario.num_requests=150"],
    "sharegpt": ["scenario.max_requests=300"],
    "synthetic": ["scenario.num_requests=300"],
}
CASES = {
    **{name: [f"scenario={name}", f"allocators={ALLOCATORS}", *extra] for name, extra in SMALL.items()},
    "golden": ["+experiment=golden", f"allocators={ALLOCATORS}"],
    "swap": ["+experiment=golden", "preemption_mode=swap", "allocators=[paged,contiguous]"],
    "sharing_n4": ["scenario=synthetic", "scenario.num_requests=200", "scenario.n=4",
                   "allocators=[paged,prefix,contiguous_oracle]"],
    "vidur_matched_small": ["+experiment=vidur_matched", "trace.max_requests=400"],
    "no_chunking": ["+experiment=golden", "enable_chunked_prefill=false", "max_num_batched_tokens=2048",
                    "allocators=[paged,prefix,radix,contiguous]"],
    "watermark": ["+experiment=golden", "watermark=0.05", "allocators=[paged,prefix]"],
}


def digest(frame: pd.DataFrame) -> str:
    return hashlib.sha256(pd.util.hash_pandas_object(frame, index=False).to_numpy().tobytes()).hexdigest()[:16]


def fingerprints(extra: list[str]) -> dict:
    out = {}
    for case, overrides in CASES.items():
        try:
            cfg = compose_config("run", ["plots=false", "progress=false", *overrides, *extra])
        except Exception as error:  # a scenario without a key this case sets
            out[case] = {"skipped": str(error).splitlines()[0]}
            continue
        for result in run_all(cfg):
            metrics = flatten(result.metrics)
            metrics.pop("wall_time_s")
            for key in [k for k in metrics if k.startswith("engine.")]:  # which loop ran, and its events
                metrics.pop(key)
            metrics["requests_digest"] = digest(result.requests)
            metrics["timeline_digest"] = digest(result.timeline)
            out[f"{case}/{result.allocator}"] = metrics
        print(case, file=sys.stderr)
    return out


def main(argv: list[str]) -> int:
    command, path, extra = argv[0], argv[1], argv[2:]
    current = fingerprints(extra)
    if command == "capture":
        with open(path, "w") as handle:
            json.dump(current, handle, indent=1, sort_keys=True)
        return 0
    with open(path) as handle:
        before = json.load(handle)
    different = 0
    for case in sorted(set(before) | set(current)):
        old, new = before.get(case, {}), current.get(case, {})
        moved = differing(old, new)  # a statistic of nothing (NaN) equals another
        if moved:
            different += 1
            print(f"{case}: {len(moved)} differ: " + ", ".join(
                f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in moved[:6]))
    print(f"{len(current)} cases, {different} differ")
    return 1 if different else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
