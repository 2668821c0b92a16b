"""How much load each allocator sustains on the main job's cluster: the operating point of
`scenario=rag_agents` is stated against these figures (README, scenarios/scenario/rag_agents.yaml).

    python benchmarks/capacity.py                         # rates 0.2 .. 1.4 sessions/s
    python benchmarks/capacity.py --rates 0.3 0.35 0.4 --allocators contiguous paged

Each rate runs the rag_agents defaults (2 replicas of Llama-3.1-70B on TP-4 H100s, 30 simulated
minutes, the first 5 and the drain not measured) with the session rate changed. A rate is
sustained when the measured window's TTFT p90 stays under --ttft-p90-s (default 5 s): past
saturation the queue, and with it TTFT, grows for as long as the run lasts.
"""
from __future__ import annotations

import argparse
import time

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from sim.config import register_schemas
from sim.run import build_workload, prepare, simulate

DURATION_S = 1800  # the main job's simulated span


def config(rate: float):
    register_schemas()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="scenarios", version_base="1.3"):
        cfg = compose(config_name="run", overrides=[
            "scenario=rag_agents", f"scenario.session_rate_per_s={rate}",
            f"scenario.num_sessions={int(rate * DURATION_S)}"])
    GlobalHydra.instance().clear()
    return cfg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[0.2, 0.3, 0.35, 0.4, 0.5, 0.6, 0.7, 1.0, 1.4])
    parser.add_argument("--allocators", nargs="+", default=["contiguous", "paged", "prefix"])
    parser.add_argument("--ttft-p90-s", type=float, default=5.0)
    args = parser.parse_args()
    print(f"{'sessions/s':>10} {'allocator':<11} {'out tok/s':>9} {'ttft p50 s':>10} {'ttft p90 s':>10} "
          f"{'used/cap':>8} {'preempt':>7} {'wall s':>6}")
    sustained = {name: None for name in args.allocators}
    for rate in args.rates:
        cfg = config(rate)
        setup, workload = prepare(cfg), build_workload(cfg, cfg.seed)
        for allocator in args.allocators:
            started = time.perf_counter()
            m = simulate(setup, workload, allocator, cfg.router).metrics
            kv, ttft = m["kv"], m["latency_s"]["ttft"]
            used = 1 - kv["free_of_capacity"] - kv["cached_idle_of_capacity"]
            print(f"{rate:>10.2f} {allocator:<11} {m['throughput']['output_tokens_per_s']:>9.0f} "
                  f"{ttft['p50']:>10.2f} {ttft['p90']:>10.2f} {used:>8.2f} "
                  f"{m['scheduler']['num_preemptions']:>7} {time.perf_counter() - started:>6.1f}", flush=True)
            if ttft["p90"] < args.ttft_p90_s:
                sustained[allocator] = rate
    for allocator, rate in sustained.items():
        print(f"{allocator}: sustains {rate} sessions/s (highest rate tried with TTFT p90 < {args.ttft_p90_s} s)"
              if rate is not None else f"{allocator}: no rate tried is sustained")


if __name__ == "__main__":
    main()
