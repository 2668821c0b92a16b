"""Output folders exist only for runs that succeed.

A single run writes into a hidden sibling of its run directory (`.NAME.partial-PID`, on the same
file system) and is renamed into place when the task returns; a failure removes it, and every
parent folder this run created, so nothing is left behind, not even Hydra's `.hydra/`. In a
sweep each failing job removes its own folder, and a sweep in which no job succeeded removes the
sweep folder. The run and sweep folders are resolved once, before Hydra starts, and handed to
Hydra explicitly, so `${now:...}` cannot resolve twice to different names.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from sim.errors import KvsimError

RUN_DIR_ENV = "KVSIM_RUN_DIR"        # the final folder of the single run in progress
SWEEP_JOBS_ENV = "KVSIM_SWEEP_JOBS"  # how many jobs the sweep in progress has
NO_OUTPUT_FLAGS = {"--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i", "--resolve",
                   "--shell-completion", "-sc", "--version"}


JOB_DONE_FILES = ("comparison.csv", "sharing.csv")  # written last by a job that succeeded


def _merge(source: Path, target: Path) -> None:
    """Move source's files into target, replacing files of the same name, keeping the rest."""
    target.mkdir(exist_ok=True)
    for entry in source.iterdir():
        destination = target / entry.name
        if entry.is_dir() and destination.is_dir():
            _merge(entry, destination)
        else:
            if destination.is_dir():
                shutil.rmtree(destination)
            os.replace(entry, destination)


def first_missing(path: Path) -> Path | None:
    """The topmost ancestor of path (path included) that does not exist yet."""
    missing = None
    for candidate in (path, *path.parents):
        if candidate.exists():
            break
        missing = candidate
    return missing


def _make_folder(folder: Path, key: str) -> None:
    """Create the folder a run writes into now, so that a path that cannot be one is a single
    line here rather than Hydra's traceback later."""
    if folder.exists() and not folder.is_dir():
        raise KvsimError(f"{folder} is a file, key {key}, name a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KvsimError(f"cannot create {folder} ({exc.strerror}), key {key}, "
                         f"name a folder you can write to") from None


def _quoted(path: Path) -> str:
    return "'" + str(path).replace("\\", "\\\\").replace("'", "\\'") + "'"


class Staging:
    def __init__(self, overrides=(), final: Path | None = None, staging: Path | None = None,
                 sweep_dir: Path | None = None, created_root: Path | None = None, figures=None,
                 num_jobs: int | None = None):
        self.overrides = list(overrides)
        self.final, self.staging, self.sweep_dir = final, staging, sweep_dir
        self.created_root = created_root
        self.figures = figures  # a named sweep's (figures_dir, metrics) for finish_sweep
        self.num_jobs = num_jobs  # a sweep's: its jobs are folders 0 .. num_jobs - 1
        # What a sweep folder already held: never touched when cleaning up after a failure.
        self.preexisting = set(sweep_dir.iterdir()) if sweep_dir is not None and sweep_dir.is_dir() else set()

    @classmethod
    def plan(cls, composed, argv: list[str], overrides: list[str]) -> "Staging":
        hydra_cfg = composed.get("hydra") if composed is not None else None
        if hydra_cfg is None or hydra_cfg.output_subdir is None or NO_OUTPUT_FLAGS & set(argv):
            return cls()  # a verb that writes where it is told (calibration), or prints only
        multirun = "-m" in argv or "--multirun" in argv
        figures = sweep_figures(composed, multirun, overrides)
        if multirun:
            from sim.cli import num_sweep_jobs
            sweep = Path(hydra_cfg.sweep.dir).absolute()
            created_root = first_missing(sweep)
            params = hydra_cfg.get("sweeper", {}).get("params") or {}
            jobs = num_sweep_jobs(overrides, dict(params))
            planned = cls([f"hydra.sweep.dir={_quoted(sweep)}"], sweep_dir=sweep, created_root=created_root,
                          figures=figures, num_jobs=jobs)
            _make_folder(sweep, "hydra.sweep.dir")
            os.environ[SWEEP_JOBS_ENV] = str(jobs)
            return planned
        final = Path(hydra_cfg.run.dir).absolute()
        if final.exists() and not final.is_dir():
            raise KvsimError(f"{final} is a file, key hydra.run.dir, name a folder")
        staging = final.parent / f".{final.name}.partial-{os.getpid()}"
        created_root = first_missing(final)
        _make_folder(staging, "hydra.run.dir")
        os.environ[RUN_DIR_ENV] = str(final)
        return cls([f"hydra.run.dir={_quoted(staging)}"], final=final, staging=staging,
                   created_root=created_root)

    def __enter__(self) -> "Staging":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        os.environ.pop(RUN_DIR_ENV, None)
        os.environ.pop(SWEEP_JOBS_ENV, None)
        if exc_type is None or (exc_type is SystemExit and exc.code in (0, None)):
            self._commit()
        else:
            self._discard()
        return False

    def _commit(self) -> None:
        if self.staging is None or not self.staging.is_dir():
            return
        if self.final.is_dir() and not any(self.final.iterdir()):
            self.final.rmdir()
        if not self.final.exists():
            os.replace(self.staging, self.final)
            return
        _merge(self.staging, self.final)  # an existing folder the user named: add to it
        shutil.rmtree(self.staging, ignore_errors=True)

    def _discard(self) -> None:
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
            self._remove_empty_parents(self.staging.parent)
        elif self.sweep_dir is not None and self.sweep_dir.is_dir():
            for job in set(self.sweep_dir.iterdir()) - self.preexisting:  # stopped half-way
                if job.is_dir() and not any((job / name).is_file() for name in JOB_DONE_FILES):
                    shutil.rmtree(job, ignore_errors=True)
            added = set(self.sweep_dir.iterdir()) - self.preexisting
            if not any(p.is_dir() for p in added):  # no job succeeded: what the sweep added goes
                for path in added:
                    path.unlink(missing_ok=True)
                if self.created_root is not None:
                    shutil.rmtree(self.sweep_dir, ignore_errors=True)
                    self._remove_empty_parents(self.sweep_dir.parent)

    def _remove_empty_parents(self, folder: Path) -> None:
        """Remove empty folders from `folder` up to the topmost one this run created."""
        root = self.created_root
        if root is None:
            return
        while (folder == root or root in folder.parents) and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
            folder = folder.parent


def discard_failed_job() -> None:
    """In a sweep, a failing job removes its own folder (single runs are staged instead)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN or hydra_cfg.output_subdir is None:
        return
    job_dir = Path(hydra_cfg.runtime.output_dir)
    if job_dir.parent == Path(hydra_cfg.sweep.dir).absolute():
        shutil.rmtree(job_dir, ignore_errors=True)


def final_dir(out_dir: Path) -> Path:
    """Where the run's files will be once it succeeds."""
    final = os.environ.get(RUN_DIR_ENV)
    return Path(final) if final and out_dir.name.startswith(f".{Path(final).name}.partial-") else out_dir


def sweep_progress(out_dir: Path) -> str | None:
    """'sweep: K of N jobs done' for a sweep job, from the job folders written so far."""
    total = os.environ.get(SWEEP_JOBS_ENV)
    if not total:
        return None
    done = sum(1 for p in out_dir.parent.iterdir()
               if any((p / name).is_file() for name in JOB_DONE_FILES))
    return f"sweep: {done} of {total} jobs done"


def sweep_job_dir() -> Path | None:
    """This sweep job's folder, or None outside a sweep."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN or hydra_cfg.output_subdir is None:
        return None
    job_dir = Path(hydra_cfg.runtime.output_dir)
    return job_dir if job_dir.parent == Path(hydra_cfg.sweep.dir).absolute() else None


def mark_infeasible_job(reason: str) -> bool:
    """In a sweep, a job that cannot run keeps only Hydra's record and a status.json saying
    why; False outside a sweep."""
    from sim.sweep import write_job_status
    job_dir = sweep_job_dir()
    if job_dir is None:
        return False
    for entry in job_dir.iterdir() if job_dir.is_dir() else ():
        if entry.name != ".hydra":
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    write_job_status(job_dir, "infeasible", reason)
    print(f"job {job_dir.name} infeasible: {reason}", file=sys.stderr)
    return True


# Overrides that leave a named sweep's results as they are.
KEEPS_RESULTS = ("+sweep", "sweep", "resume", "figures", "quiet", "progress", "plots")


def sweep_figures(composed, multirun: bool, overrides=()) -> tuple[Path | None, list[str]] | None:
    """figures_dir and figures (a named sweep's, scenarios/sweep/), checked before any job runs.
    A named sweep whose results the command line changes keeps its figures in its sweep folder
    (folder None; said), unless the command line names figures_dir itself."""
    from sim.sweep import FIGURE_METRICS
    folder, metrics = composed.get("figures_dir"), list(composed.get("figures") or [])
    if folder is None:
        return None
    if not multirun:
        raise KvsimError(f"figures_dir={folder} publishes a sweep's figures, key figures_dir, "
                         f"run with -m (or drop figures_dir)")
    unknown = [m for m in metrics if m not in FIGURE_METRICS]
    if unknown:
        raise KvsimError(f"unknown figure metric '{unknown[0]}', key figures, use some of: "
                         f"{', '.join(FIGURE_METRICS)}")
    keys = [o.split("=", 1)[0] for o in overrides]
    changed = [o for o, k in zip(overrides, keys) if not k.startswith(KEEPS_RESULTS + ("hydra.",))]
    if changed and "figures_dir" not in keys:
        print(f"note: the command line changes the named sweep ({', '.join(changed)}), so its figures stay in "
              f"its sweep folder and {folder} is left as it is (add figures_dir=DIR to publish them there)",
              file=sys.stderr)
        return None, metrics
    target = Path(folder).absolute()
    if target.exists() and not target.is_dir():
        raise KvsimError(f"{target} is a file, key figures_dir, name a folder")
    return target, metrics


def finish_sweep(sweep_dir: Path, figures: tuple[Path, list[str]] | None = None, num_jobs: int | None = None) -> None:
    """Write the sweep's summary.parquet (and, for a named sweep, its report and figures into
    figures_dir); a sweep in which no job ran is an error. Job folders beyond this sweep's
    (left by an earlier, larger sweep in the same folder) are left out, and said."""
    from sim.sweep import publish_figures, record_sweep, report_sweep, stale_job_dirs, sweep_table, write_summary
    stale = stale_job_dirs(sweep_dir, num_jobs)
    if stale:
        print(f"note: job folders {', '.join(p.name for p in stale)} in {sweep_dir} are from an earlier sweep "
              f"(this one has {num_jobs} jobs): left out of summary.parquet", file=sys.stderr)
    table, _ = sweep_table(sweep_dir, num_jobs)
    statuses = table.groupby("job").status.first()
    if not (statuses == "ok").any():
        reasons = table[table.status == "infeasible"].reason
        first = reasons.iloc[0] if len(reasons) else "no job finished"
        raise KvsimError(f"no job of the sweep ran ({len(statuses)} infeasible or unfinished; the first: "
                         f"{first.removeprefix('error: ')}), hydra.sweep.dir {sweep_dir}, fix the swept values")
    write_summary(sweep_dir, num_jobs)
    record_sweep(sweep_dir, num_jobs)
    infeasible = int((statuses == "infeasible").sum())
    print(f"sweep: {int((statuses == 'ok').sum())} jobs ran, {infeasible} infeasible; "
          f"summary: {sweep_dir / 'summary.parquet'}", file=sys.stderr)
    if figures is not None and figures[0] is None:  # a named sweep changed on the command line
        report_sweep(sweep_dir, figures[1], num_jobs)
        print(f"report: {sweep_dir / 'index.html'}", file=sys.stderr)
    elif figures is not None:
        published = publish_figures(sweep_dir, *figures, num_jobs)
        print(f"figures: {len(published)} in {figures[0]}", file=sys.stderr)


def sweep_job_overrides() -> list[str]:
    """The job's overrides that decide its results (resume=... does not)."""
    from hydra.core.hydra_config import HydraConfig
    return [o for o in HydraConfig.get().overrides.task if o.split("=", 1)[0].lstrip("+~") != "resume"]


def completed_before(job_dir: Path) -> bool:
    """Whether a resumed sweep's job already ran with the same overrides (status.json says so)."""
    from sim.sweep import STATUS_FILE
    path = job_dir / STATUS_FILE
    if not path.is_file():
        return False
    status = json.loads(path.read_text())
    return status.get("status") == "ok" and status.get("overrides") == sweep_job_overrides()
