"""Command-line front end: subcommand word, then Hydra key=value overrides.

Overrides are composed once with Hydra's compose API before the real `@hydra.main` app runs, so
that an unknown group option, unknown key, malformed override or wrong type becomes one line
`error: <what>, <where>, <fix>` with exit code 2 instead of Hydra's multi-line report.
"""
from __future__ import annotations

import signal
import sys
import time
from importlib import resources
from typing import Callable, NamedTuple

import hydra
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from sim.config import register_schemas
from sim.errors import KvsimError
from sim.help import command_help, main_help
from sim.errors import ConfigError
from sim.staging import (Staging, completed_before, discard_failed_job, finish_sweep, mark_infeasible_job,
                         sweep_job_dir, sweep_job_overrides)

CONFIG_MODULE = "scenarios"
# Hydra flags that take a value, and those that do not; neither is an override.
FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--config-name", "-cn", "--config-dir",
                    "-cd", "--info", "-i", "--experimental-rerun"}
FLAGS = {"-m", "--multirun", "--resolve", "--help", "-h", "--hydra-help", "--version",
         "--run", "-r", "--shell-completion", "-sc"}


def fail(message: str) -> "NoReturn":  # noqa: F821
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr)
    raise SystemExit(2)


def split_flags(argv: list[str]) -> list[str]:
    overrides, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in FLAGS_WITH_VALUE:
            skip = True
        elif arg in FLAGS or arg.startswith("--info="):
            continue
        elif arg.startswith("-") and "=" not in arg:
            fail(f"unknown option '{arg}', command line, use key=value overrides "
                 f"(see --help)")
        else:
            overrides.append(arg)
    return overrides


def _first_line(exc: Exception) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    if lines[0].startswith("Error merging override") and exc.__cause__ is not None:
        return _first_line(exc.__cause__)  # the reason, e.g. a value that is not an integer
    return lines[0]


def _explain(exc: Exception, override: str | None) -> str:
    where = f"override '{override}'" if override else "command line"
    if isinstance(exc, MissingConfigException) and exc.options is not None:
        group = (exc.missing_cfg_file or "").split("/")[0] or "group"
        wanted = (exc.missing_cfg_file or "").split("/", 1)[-1]
        return (f"unknown {group} '{wanted}', {where}, use one of: "
                f"{', '.join(sorted(exc.options))}")
    if isinstance(exc, OverrideParseException):
        return f"malformed override ({_first_line(exc)}), {where}, write key=value (e.g. seed=7)"
    line = _first_line(exc)
    if "Could not override" in line or "not in struct" in line or "Key '" in line and "not" in line:
        return (f"{line.rstrip('.')}, {where}, check the key's spelling "
                f"(python -m sim <command> --cfg job lists them) or add a new key with +key=value")
    return f"{line.rstrip('.')}, {where}, fix the value"


def _sweep_variants(overrides: list[str]) -> list[tuple[list[str], str | None]]:
    """Plain override lists to compose: sweeps (a,b,c / range / choice) expanded one value at a time."""
    parser = OverridesParser.create()
    parsed = []
    for text in overrides:
        try:
            parsed.append(parser.parse_override(text))
        except HydraException as exc:
            fail(f"malformed override ({_first_line(exc)}), override '{text}', "
                 f"write key=value (e.g. seed=7)")
    base, variants = [], []
    for override in parsed:
        if override.is_sweep_override():
            values = list(override.sweep_string_iterator())
            key = override.get_key_element()
            base.append(f"{key}={values[0]}")
            variants.append((len(base) - 1, key, values[1:], override.input_line))
        else:
            base.append(override.input_line)
    combos = [(base, None)]
    for index, key, values, line in variants:
        for value in values:
            combo = list(base)
            combo[index] = f"{key}={value}"
            combos.append((combo, line))
    return combos


def validate(config_name: str, overrides: list[str], register=register_schemas):
    """Compose every sweep variant; return the first composition (with Hydra's own keys)."""
    register()
    first = None
    for combo, origin in _sweep_variants(overrides):
        GlobalHydra.instance().clear()
        try:
            with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
                cfg = compose(config_name=config_name, overrides=combo, return_hydra_config=True)
                first = cfg if first is None else first
        except (HydraException, OmegaConfBaseException, ValueError) as exc:
            fail(_explain(exc, origin or _guilty(config_name, combo)))
        finally:
            GlobalHydra.instance().clear()
    return first


def num_sweep_jobs(overrides: list[str], sweeper_params: dict | None = None) -> int:
    """Jobs of a basic sweep: the product of the swept values, from the config's
    hydra.sweeper.params and the command line (which wins for a key given in both)."""
    parser = OverridesParser.create()
    counts = {}
    for text in [f"{k}={v}" for k, v in (sweeper_params or {}).items()] + list(overrides):
        override = parser.parse_override(text)
        key = override.get_key_element()
        counts[key] = len(list(override.sweep_string_iterator())) if override.is_sweep_override() else 1
    jobs = 1
    for count in counts.values():
        jobs *= count
    return jobs


def _group_choices(overrides: list[str]) -> list[str]:
    """The overrides that choose a config group option (scenario=bench, +experiment=golden)."""
    groups = {p.name for p in resources.files(CONFIG_MODULE).iterdir() if p.is_dir()}
    return [o for o in overrides if o.split("=", 1)[0].lstrip("+~") in groups]


def _guilty(config_name: str, overrides: list[str]) -> str | None:
    """The first override that fails with the command line's group choices alone (a key of
    scenario=bench is only valid with it), to name it in the error line."""
    choices = _group_choices(overrides)
    # A group choice that fails on its own is to blame before any key that needs it.
    for override in [*choices, *(o for o in overrides if o not in choices)]:
        GlobalHydra.instance().clear()
        try:
            with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
                together = [override] if override in choices else [*choices, override]
                compose(config_name=config_name, overrides=together, return_hydra_config=True)
        except Exception:  # noqa: BLE001 - any failure names this override
            return override
        finally:
            GlobalHydra.instance().clear()
    return None


def guarded(task):
    """Wrap a Hydra task so that the project's typed errors print one line and exit 2."""
    def wrapper(cfg):
        job_dir = sweep_job_dir()
        try:
            if cfg.get("resume", False):
                if job_dir is None:
                    raise ConfigError("resume=true continues a sweep, key resume, run with -m and the "
                                      "sweep's hydra.sweep.dir (or drop resume)")
                if completed_before(job_dir):
                    print(f"job {job_dir.name}: complete, skipped (resume=true)", file=sys.stderr)
                    return None
            started = time.perf_counter()
            result = task(cfg)
            if job_dir is not None:
                from sim.sweep import write_job_status
                write_job_status(job_dir, "ok", wall_time_s=time.perf_counter() - started,
                                 overrides=sweep_job_overrides())
            return result
        except KvsimError as exc:
            if mark_infeasible_job(str(exc)):  # a sweep job: say so, and the sweep goes on
                return None
            discard_failed_job()
            fail(str(exc))
        except MissingMandatoryValue as exc:
            discard_failed_job()
            fail(f"{exc.full_key} has no value, command line, give {exc.full_key}=<value> "
                 f"(--help lists the keys)")
        except BaseException:
            discard_failed_job()
            raise
    wrapper.__name__ = task.__name__
    wrapper.__doc__ = task.__doc__
    return wrapper


class Command(NamedTuple):
    config_name: str            # its primary config in scenarios/
    load_task: Callable         # returns the Hydra task function (imported late)
    description: str            # one line for --help
    groups: dict                # config group -> how it is chosen, listed by --help
    shared_keys: tuple = ()     # (config, prefix): keys documented in another primary config


def dispatch(argv: list[str], commands: dict[str, Command], usage: str,
             register=register_schemas, program: str = "python -m sim") -> None:
    """Run `<command> [key=value ...]`."""
    if not argv or argv[0] in ("-h", "--help"):
        print(main_help(usage, {word: c.description for word, c in commands.items()}, program))
        raise SystemExit(0 if argv else 2)
    command = argv[0]
    if command not in commands:
        fail(f"unknown command '{command}', command line, use one of: {', '.join(commands)}")
    config_name, load_task, description, groups, shared_keys = commands[command]
    rest = argv[1:]
    if "--help" in rest or "-h" in rest:
        print(command_help(program, command, config_name, description, groups, shared_keys))
        raise SystemExit(0)
    overrides = split_flags(rest)
    flags = [a for a in rest if a in ("--cfg", "-c", "--info", "-i", "--shell-completion", "-sc")]
    if flags and ("-m" in rest or "--multirun" in rest):
        fail(f"-m runs a sweep and {flags[0]} only prints, command line, drop one of them")
    composed = validate(config_name, overrides, register=register)
    try:
        staging = Staging.plan(composed, rest, overrides)
    except KvsimError as exc:
        fail(str(exc))
    sys.argv = [f"{sys.argv[0]} {command}", *rest, *staging.overrides]  # not the command word
    app = hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name=config_name,
                     version_base="1.3")(guarded(load_task()))
    previous = signal.signal(signal.SIGTERM, _terminate)  # clean up as on any failure
    try:
        with staging:
            try:
                app()
            except SystemExit as exc:
                if exc.code not in (0, None) or staging.sweep_dir is None:
                    raise
            if staging.sweep_dir is not None:
                finish_sweep(staging.sweep_dir, staging.figures, staging.num_jobs)
    except KvsimError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        print("error: interrupted, command line, nothing was written", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def _terminate(signum, frame):
    raise SystemExit(128 + signum)
