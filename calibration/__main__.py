"""`python -m calibration <verb> [key=value ...]`: run | fit | import-vidur | predict | show.

Like `python -m sim`: the verb is removed from sys.argv, the overrides are validated, then the
verb's Hydra app runs; bad input prints one line and exits with code 2. Only `run` imports torch
and triton (lazily).
"""
from __future__ import annotations

import sys

from calibration.config import register_schemas
from sim.cli import dispatch

USAGE = "usage: python -m calibration {run|fit|import-vidur|predict|show} [key=value ...]"


def _run_task():
    from calibration.bench import run_task
    return run_task


def _commands():
    from calibration import commands
    return {"run": ("calibration_run", _run_task),
            "fit": ("calibration_fit", lambda: commands.fit_task),
            "import-vidur": ("calibration_import_vidur", lambda: commands.import_vidur_task),
            "predict": ("calibration_predict", lambda: commands.predict_task),
            "show": ("calibration_show", lambda: commands.show_task)}


def main(argv: list[str] | None = None) -> None:
    dispatch(sys.argv[1:] if argv is None else argv, _commands(), USAGE, register=register_schemas)


if __name__ == "__main__":
    main()
