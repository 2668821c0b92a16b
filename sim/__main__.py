"""`python -m sim <command> [key=value ...]`: run | kv | trace-stats | report.

The subcommand word is removed from sys.argv before Hydra sees it (Hydra would read `run` as a
malformed override), the overrides are validated, then that subcommand's Hydra app runs.
"""
from __future__ import annotations

import sys

import hydra

from sim.cli import CONFIG_MODULE, fail, guarded, split_flags, validate
from sim.commands import kv_task, report_task, run_task, trace_stats_task

COMMANDS = {"run": ("run", run_task), "kv": ("kv", kv_task), "report": ("report", report_task),
            "trace-stats": ("trace_stats", trace_stats_task)}
USAGE = "usage: python -m sim {run|kv|trace-stats|report} [key=value ...] [-m] [--cfg job]"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)
    command = argv[0]
    if command not in COMMANDS:
        fail(f"unknown command '{command}', command line, use one of: {', '.join(COMMANDS)}")
    config_name, task = COMMANDS[command]
    rest = argv[1:]
    validate(config_name, split_flags(rest))
    sys.argv = [f"{sys.argv[0]} {command}", *rest]
    app = hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name=config_name,
                     version_base="1.3")(guarded(task))
    app()


if __name__ == "__main__":
    main()
