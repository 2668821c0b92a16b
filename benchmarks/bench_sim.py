"""Simulator speed: simulated requests and tokens per wall-clock second, on one core.

    python benchmarks/bench_sim.py            # 10,000 and 100,000 requests, both workloads
    python benchmarks/bench_sim.py --sizes 10000

Workloads: `synthetic` (independent requests, no sharing) and `rag_agents` (shared preambles,
multi-turn sessions), each on 4 replicas of Llama-3-70B on TP-4 H100s through the paged and
prefix allocators. Arrival rates scale with the cluster so that it stays busy but stable.
"""
from __future__ import annotations

import argparse
import time

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from sim.config import register_schemas
from sim.run import build_workload, prepare, simulate

WORKLOADS = {
    # requests -> overrides
    "synthetic": lambda n: ["scenario=synthetic", f"scenario.num_requests={n}",
                            "scenario.request_rate_per_s=40"],
    # about 4 turns per session
    "rag_agents": lambda n: ["scenario=rag_agents", f"scenario.num_sessions={n // 4}",
                             "scenario.session_rate_per_s=2.5"],
}


def config(overrides):
    register_schemas()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="scenarios", version_base="1.3"):
        cfg = compose(config_name="run", overrides=["cluster.num_replicas=4", *overrides])
    GlobalHydra.instance().clear()
    return cfg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--allocators", nargs="+", default=["paged", "prefix"])
    args = parser.parse_args()
    print(f"{'workload':<11} {'allocator':<10} {'requests':>9} {'steps':>9} {'gen s':>7} "
          f"{'sim s':>8} {'req/s':>9} {'tokens/s':>11} {'steps/s':>9}")
    for size in args.sizes:
        for workload_name, overrides in WORKLOADS.items():
            cfg = config(overrides(size))
            started = time.perf_counter()
            workload = build_workload(cfg, cfg.seed)
            generated = time.perf_counter() - started
            setup = prepare(cfg)
            for allocator in args.allocators:
                started = time.perf_counter()
                result = simulate(setup, workload, allocator, cfg.router)
                wall = time.perf_counter() - started
                finished = result.requests[result.requests.status == "finished"]
                tokens = int(finished.prompt_tokens.sum() + finished.output_tokens.sum())
                steps = result.metrics["scheduler"]["num_steps"]
                print(f"{workload_name:<11} {allocator:<10} {len(finished):>9,} {steps:>9,} "
                      f"{generated:>7.1f} {wall:>8.1f} {len(finished) / wall:>9,.0f} "
                      f"{tokens / wall:>11,.0f} {steps / wall:>9,.0f}", flush=True)


if __name__ == "__main__":
    main()
