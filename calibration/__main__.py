"""`python -m calibration <verb> [key=value ...]`: run | fit | import-vidur | predict | show.

Like `python -m sim`: the verb is removed from sys.argv, the overrides are validated, then the
verb's Hydra app runs; bad input prints one line and exits with code 2. Only `run` imports torch
and triton (lazily).
"""
from __future__ import annotations

import sys

from calibration.config import register_schemas
from sim.cli import Command, dispatch

USAGE = "usage: python -m calibration {run|fit|import-vidur|predict|show} [key=value ...]"


def _run_task():
    from calibration.bench import run_task
    return run_task


def _commands():
    from calibration import commands
    return {"run": Command("calibration_run", _run_task,
                           "On a GPU: benchmark the Triton kernels, fit, write a profile (needs torch, triton).",
                           {"grid": "grid=NAME"}),
            "fit": Command("calibration_fit", lambda: commands.fit_task,
                           "Refit a profile from a raw CSV: raw=FILE name=GPU [base=PROFILE].", {}),
            "import-vidur": Command("calibration_import_vidur", lambda: commands.import_vidur_task,
                                    "Fit Vidur's public operator timings: path=DIR name=GPU [base=PROFILE].",
                                    {}),
            "predict": Command("calibration_predict", lambda: commands.predict_task,
                               "Predicted seconds per shape row: gpu=NAME shapes=FILE out=FILE.",
                               {"gpu": "gpu=NAME"}),
            "show": Command("calibration_show", lambda: commands.show_task,
                            "A profile's parameters, provenance and fit quality: gpu=NAME.",
                            {"gpu": "gpu=NAME"})}


def main(argv: list[str] | None = None) -> None:
    dispatch(sys.argv[1:] if argv is None else argv, _commands(), USAGE, register=register_schemas,
             program="python -m calibration")


if __name__ == "__main__":
    main()
