"""The simulator's named speed benchmarks (issue 9): wall time, peak memory, simulated requests
and tokens per wall second, steps and events per second, and which loop ran (the compiled one,
sim/engine/compiled, where it covers the run; else the Python engine on SimPy).

    python benchmarks/bench_suite.py                       # every benchmark, full size
    python benchmarks/bench_suite.py vidur_matched million # some of them
    python benchmarks/bench_suite.py --quick               # small sizes: checks they work
    python benchmarks/bench_suite.py rag_agents_100k --repeat 5  # medians of five, interleaved

Benchmarks:
- vidur_matched: `+experiment=vidur_matched`, Vidur's reference set-up (Llama-2-70B on A100s,
  Azure conversation lengths clipped to 4,096 tokens, Poisson 1 request/s, 10,000 requests,
  512-token chunks, at most 128 sequences, paged) on Vidur's TP 2 x PP 2.
- million: 1,000,000 ShareGPT-like requests (length statistics) over 16 replicas at 3.2
  requests/s each (near saturation: one replica serves at most about 3.8), paged and prefix.
- rag_agents_100k: `scenario=rag_agents scenario.num_sessions=25000
  scenario.session_rate_per_s=5 cluster.num_replicas=8`, prefix and paged (about 100,000 requests).
- scaling: the million workload at 10k, 100k and 1M requests, paged.

Each measurement runs in its own process, so that its peak memory (ru_maxrss) is its own; only
the simulation loop is timed (metrics.json's wall_time_s), not generation or start-up.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

SHAREGPT_ROWS = 4000  # rows of the shipped sample; bigger workloads replay it (trace.repeat)


def sharegpt(num_requests: int, replicas: int = 16) -> list[str]:
    """Exactly num_requests: the sample's first num_requests / repeat rows, repeat times."""
    repeat = max(1, -(-num_requests // SHAREGPT_ROWS))
    while num_requests % repeat:
        repeat += 1
    return ["scenario=sharegpt", f"scenario.max_requests={num_requests // repeat}",
            f"+scenario.repeat={repeat}", f"scenario.arrival_rate_rps={3.2 * replicas}",
            f"cluster.num_replicas={replicas}"]


def rag_agents(num_sessions: int) -> list[str]:
    return ["scenario=rag_agents", f"scenario.num_sessions={num_sessions}",
            "scenario.session_rate_per_s=5", "cluster.num_replicas=8"]


# name -> (full-size runs, quick runs); a run is (label, allocator, overrides)
BENCHMARKS = {
    "vidur_matched": ([("10k", "paged", ["+experiment=vidur_matched"])],
                      [("1k", "paged", ["+experiment=vidur_matched", "trace.max_requests=1000"])]),
    "million": ([("1M", a, sharegpt(1_000_000)) for a in ("paged", "prefix")],
                [("2k", a, sharegpt(2000, replicas=2)) for a in ("paged", "prefix")]),
    "rag_agents_100k": ([("100k", a, rag_agents(25_000)) for a in ("prefix", "paged")],
                        [("400", a, rag_agents(100) + ["measure.warmup_s=0"]) for a in ("prefix", "paged")]),
    "scaling": ([(f"{n // 1000}k", "paged", sharegpt(n)) for n in (10_000, 100_000, 1_000_000)],
                [(f"{n}", "paged", sharegpt(n, replicas=2)) for n in (500, 1000, 2000)]),
}


def measure(allocator: str, overrides: list[str]) -> dict:
    """One simulation in this process: its loop's time, steps, events and peak memory."""
    import simpy
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from sim.config import register_schemas
    from sim.run import build_workload, prepare, simulate

    register_schemas()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="scenarios", version_base="1.3"):
        cfg = compose(config_name="run", overrides=[*overrides, f"allocators=[{allocator}]"])
    setup = prepare(cfg)
    workload = build_workload(cfg, cfg.seed)
    events = [0]
    step = simpy.Environment.step

    def counted(env):  # count every event SimPy processes
        events[0] += 1
        return step(env)

    simpy.Environment.step = counted
    started = time.perf_counter()
    result = simulate(setup, workload, allocator, cfg.router)
    elapsed = time.perf_counter() - started
    simpy.Environment.step = step
    done = result.requests[result.requests.status == "finished"]
    metrics = result.metrics
    return {"wall_s": metrics["wall_time_s"], "elapsed_s": elapsed,
            "parallelism": f"TP {cfg.tensor_parallel_size}" + (
                f" x PP {cfg.pipeline_parallel_size}" if "pipeline_parallel_size" in cfg else ""),
            "requests": int(len(done)), "tokens": int(done.prompt_tokens.sum() + done.output_tokens.sum()),
            "steps": metrics["scheduler"]["num_steps"], "loop": metrics["engine"]["loop"],
            # the compiled loop's own events (step ends, wake-ups, requests reaching the engine)
            "events": metrics["engine"].get("num_events", events[0]),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_one(name: str, label: str, allocator: str, overrides: list[str]) -> dict:
    code = ("import json, sys; sys.path.insert(0, 'benchmarks'); from bench_suite import measure; "
            f"print(json.dumps(measure({allocator!r}, {overrides!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"error: benchmark {name} {label} {allocator} failed: "
                         f"{(out.stderr.strip().splitlines() or ['?'])[-1]}")
    return {"benchmark": name, "size": label, "allocator": allocator, **json.loads(out.stdout.splitlines()[-1])}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", choices=[[], *BENCHMARKS], default=[])
    parser.add_argument("--quick", action="store_true", help="small sizes, to check that each works")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds of each benchmark's runs (interleaved, each in a fresh process); "
                             "the prefix/paged line gives the medians")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: give at least 1")
    rows = []
    print(f"{'benchmark':<16} {'size':>5} {'allocator':<9} {'loop s':>8} {'peak MB':>8} {'req/s':>9} "
          f"{'tokens/s':>11} {'steps/s':>9} {'events/s':>9} loop")
    for name in args.names or list(BENCHMARKS):
        runs = BENCHMARKS[name][1 if args.quick else 0]
        for _ in range(args.repeat):
            for label, allocator, overrides in runs:
                row = run_one(name, label, allocator, overrides)
                wall = max(row["wall_s"], 1e-9)
                print(f"{name:<16} {label:>5} {allocator:<9} {row['wall_s']:>8.2f} {row['peak_rss_mb']:>8.0f} "
                      f"{row['requests'] / wall:>9,.0f} {row['tokens'] / wall:>11,.0f} "
                      f"{row['steps'] / wall:>9,.0f} {row['events'] / wall:>9,.0f} {row['loop']}", flush=True)
                rows.append(row)
        if name == "vidur_matched":
            print(f"  vidur_matched ran on {rows[-1]['parallelism']}")
        for line in prefix_over_paged([r for r in rows if r["benchmark"] == name]):
            print(line)
    return rows


def prefix_over_paged(rows: list[dict]) -> list[str]:
    """For each size run with both allocators: the median loop times and their ratio (issue 9's
    target: the prefix allocator at most 1.5x the paged one's time)."""
    lines = []
    for size in dict.fromkeys(r["size"] for r in rows):
        walls = {a: [r["wall_s"] for r in rows if r["size"] == size and r["allocator"] == a] for a in ("prefix", "paged")}
        if walls["prefix"] and walls["paged"]:
            prefix, paged = statistics.median(walls["prefix"]), statistics.median(walls["paged"])
            lines.append(f"  {rows[0]['benchmark']} {size}: prefix/paged = {prefix:.2f} s / {paged:.2f} s = "
                         f"{prefix / max(paged, 1e-9):.2f}x (medians of {len(walls['prefix'])} and "
                         f"{len(walls['paged'])} runs; target at most 1.5x)")
    return lines


if __name__ == "__main__":
    main()
