"""`python -m calibration <verb> [key=value ...]`: run | fit | import-vidur | predict | show.

Like `python -m sim`: the verb is removed from sys.argv, the overrides are validated, then the
verb's Hydra app runs; bad input prints one line and exits with code 2.
"""
from __future__ import annotations

import sys

import hydra

from calibration.config import register_schemas
from sim.cli import CONFIG_MODULE, fail, guarded, split_flags, validate

VERBS = ("run", "fit", "import-vidur", "predict", "show")
USAGE = "usage: python -m calibration {run|fit|import-vidur|predict|show} [key=value ...]"


def _task(verb: str):
    from calibration import commands
    if verb == "run":
        from calibration.bench import run_task
        return run_task
    return {"fit": commands.fit_task, "import-vidur": commands.import_vidur_task,
            "predict": commands.predict_task, "show": commands.show_task}[verb]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)
    verb = argv[0]
    if verb not in VERBS:
        fail(f"unknown command '{verb}', command line, use one of: {', '.join(VERBS)}")
    config_name = "calibration_" + verb.replace("-", "_")
    rest = argv[1:]
    validate(config_name, split_flags(rest), register=register_schemas)
    sys.argv = [f"{sys.argv[0]} {verb}", *rest]
    app = hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name=config_name,
                     version_base="1.3")(guarded(_task(verb)))
    app()


if __name__ == "__main__":
    main()
