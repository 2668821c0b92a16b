"""`python -m sim <command> [key=value ...]`: run | capacity | kv | trace-stats | report | validate.

The subcommand word is removed from sys.argv before Hydra sees it (Hydra would read `run` as a
malformed override), the overrides are validated, then that subcommand's Hydra app runs.
"""
from __future__ import annotations

import os
import sys

from sim.cli import Command, dispatch
from sim.commands import TRACE_SELECTED_ENV


def _commands():
    from sim import commands
    groups = {"scenario": "scenario=NAME", "model": "model=NAME", "gpu": "gpu=NAME, a profile",
              "allocator": "allocators=[NAME,...], one run each", "scheduler": "scheduler=NAME",
              "router": "router=NAME", "queue_order": "queue_order=NAME", "experiment": "+experiment=NAME",
              "sweep": "+sweep=NAME with -m (rebuilds docs/figures/NAME)"}
    return {
        "run": Command("run", lambda: commands.run_task,
                       "Simulate a scenario once per allocator; print the comparison, write results and plots.",
                       groups),
        "capacity": Command("run", lambda: commands.capacity_task,
                            "The highest arrival rate (or the fewest replicas: capacity.search=replicas) "
                            "meeting slo.*, per allocator; writes capacity.json, .csv and .png.", groups),
        "kv": Command("kv", lambda: commands.kv_task,
                      "KV bytes per token and the cache size of a model for tokens x batch.",
                      {"model": "model=NAME"}),
        "trace-stats": Command("trace_stats", lambda: commands.trace_stats_task,
                               "What a trace (trace.path=FILE) or a scenario asks of a KV cache.",
                               {"scenario": "scenario=NAME"}, (("run", "trace."),)),
        "report": Command("report", lambda: commands.report_task,
                          "Redraw a run's (or a sweep's) plots and summary CSVs: run_dir=DIR.", {}),
        "validate": Command("validate", lambda: commands.validate_task,
                            "Simulate every published engine result of validation/published.csv; "
                            "kvsim / published per row, table and plot.", {}),
    }


USAGE = "usage: python -m sim {run|capacity|kv|trace-stats|report|validate} [key=value ...] [-m] [--cfg job]"


def select_trace_scenario(argv: list[str]) -> list[str]:
    """`run trace.path=FILE` (or `capacity ...`) without a scenario means scenario=trace (said on
    stderr)."""
    if not argv or argv[0] not in ("run", "capacity"):
        return argv
    sets_trace = any(a.lstrip("+").startswith("trace.") and not a.startswith("trace.on_overlength")
                     for a in argv[1:])
    chooses = any(a.startswith(("scenario=", "+experiment=", "experiment=")) for a in argv[1:])
    if sets_trace and not chooses:
        os.environ[TRACE_SELECTED_ENV] = "1"  # said by the run once it has started
        return [*argv, "scenario=trace"]
    return argv


def expand_hf_model(argv: list[str]) -> list[str]:
    """`model=hf:PATH` is `model=hf model.hf_config=PATH` (scenarios/model/hf.yaml)."""
    out = []
    for arg in argv:
        if arg.startswith("model=hf:"):
            out += ["model=hf", f"model.hf_config={arg[len('model=hf:'):]}"]
        else:
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    dispatch(select_trace_scenario(expand_hf_model(argv)), _commands(), USAGE)


if __name__ == "__main__":
    main()
