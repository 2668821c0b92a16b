"""Sweeps that survive: each job's status, the sweep's summary.parquet, and its report.

A sweep job that cannot run (a model that does not fit, an impossible config) leaves its folder
with `status.json` saying infeasible and why, and the sweep goes on; a job that ran says ok and
its loop's wall time. `summary.parquet` (written when the sweep ends, failed jobs or not, and by
`python -m sim report run_dir=SWEEP`) has one row per job and allocator: the job's overrides as
columns, status, reason, wall time and the headline metrics. The report draws each headline
metric against the first swept key, one line per allocator, one panel per value of the other
swept keys, and writes the figures and a self-contained HTML page (figures and table) into the
sweep folder.
"""
from __future__ import annotations

import base64
import html
import json
import math
import sys
from pathlib import Path

import pandas as pd

from sim.results import COMPARISON_FILE, _atomic, write_csv

STATUS_FILE = "status.json"
SUMMARY_FILE = "summary.parquet"
SWEEP_FILE = "sweep.json"  # the last sweep in the folder: its job count (later reports read it)
HEADLINE = [("throughput.output_tokens_per_s", "output tokens / s"),
            ("throughput.requests_per_s", "requests / s"),
            ("latency_s.ttft.p90", "TTFT p90 (s)"),
            ("latency_s.tpot.p90", "TPOT p90 (s)"),
            ("prefix_cache.hit_rate", "prefix hits / prompt tokens"),
            ("kv.waste_of_used", "waste / used"),
            ("slo.goodput_requests_per_s", "goodput (req/s)"),
            ("scheduler.num_preemptions", "preemptions")]
# What a named sweep may publish (`figures`): the headline metrics, every latency percentile and
# the load balance between replicas.
FIGURE_METRICS = dict(HEADLINE) | {f"latency_s.{name}.{stat}": f"{name.upper()} {stat} (s)"
                                   for name in ("ttft", "tpot", "itl", "e2e") for stat in ("mean", "p50", "p90", "p99")} | {
    "routing.busiest_over_mean_prefilled_tokens": "busiest replica / mean, prefilled tokens",
    "routing.busiest_over_mean_finished_requests": "busiest replica / mean, finished requests"}


def write_job_status(job_dir: Path, status: str, reason: str | None = None, wall_time_s: float | None = None,
                     overrides: list[str] | None = None) -> None:
    job_dir.mkdir(parents=True, exist_ok=True)
    data = {"status": status, **({"reason": reason} if reason else {}),
            **({"wall_time_s": wall_time_s} if wall_time_s is not None else {}),
            **({"overrides": overrides} if overrides is not None else {})}
    _atomic(job_dir / STATUS_FILE, lambda tmp: tmp.write_text(json.dumps(data)))


def _scalar(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _job_dirs(sweep_dir: Path, num_jobs: int | None = None) -> list[Path]:
    """The job folders (all, or the first num_jobs: the sweep that just ran)."""
    jobs = [p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()]
    return sorted((p for p in jobs if num_jobs is None or int(p.name) < num_jobs), key=lambda p: int(p.name))


def record_sweep(sweep_dir: Path, num_jobs: int | None) -> None:
    if num_jobs is not None:
        _atomic(sweep_dir / SWEEP_FILE, lambda tmp: tmp.write_text(json.dumps({"num_jobs": num_jobs})))


def last_sweep_jobs(sweep_dir: Path) -> int | None:
    """The job count of the last sweep run into this folder (None: not recorded)."""
    path = sweep_dir / SWEEP_FILE
    return json.loads(path.read_text()).get("num_jobs") if path.is_file() else None


def stale_job_dirs(sweep_dir: Path, num_jobs: int | None) -> list[Path]:
    """Job folders past num_jobs: an earlier, larger sweep's in the same folder."""
    return [] if num_jobs is None else [p for p in _job_dirs(sweep_dir) if int(p.name) >= num_jobs]


def _overrides(job: Path) -> dict:
    path = job / ".hydra" / "overrides.yaml"
    values = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        key, _, value = line.removeprefix("- ").partition("=")
        if key and not key.startswith(("+", "hydra")):
            values[key] = _scalar(value)
    return values


def sweep_table(sweep_dir: Path, num_jobs: int | None = None) -> tuple[pd.DataFrame, list[str]]:
    """One row per (job, allocator), an infeasible job one row; and the swept keys (overrides
    whose values differ between jobs). Every column of each job's comparison.csv is kept."""
    frames = []
    for job in _job_dirs(sweep_dir, num_jobs):
        status = json.loads((job / STATUS_FILE).read_text()) if (job / STATUS_FILE).is_file() else {}
        if (job / COMPARISON_FILE).is_file():
            frame = pd.read_csv(job / COMPARISON_FILE)
            status.setdefault("status", "ok")
        else:
            frame = pd.DataFrame([{"allocator": None}])
            status.setdefault("status", "unfinished")
        head = {"job": job.name, **_overrides(job), "status": status["status"],
                "reason": status.get("reason", ""), "job_wall_time_s": status.get("wall_time_s", math.nan)}
        frames.append(pd.concat([pd.DataFrame([head] * len(frame)), frame.reset_index(drop=True)], axis=1))
    if not frames:
        return pd.DataFrame(columns=["job", "status", "reason", "job_wall_time_s", "allocator"]), []
    table = pd.concat(frames, ignore_index=True)
    override_keys = list(table.columns[1:table.columns.get_loc("status")])
    swept = [k for k in override_keys if table.groupby("job")[k].first().astype(str).nunique() > 1]
    return table, swept


def write_summary(sweep_dir: Path, num_jobs: int | None = None) -> Path:
    """summary.parquet: overrides, status, reason, wall time, allocator and headline metrics."""
    table, _ = sweep_table(sweep_dir, num_jobs)
    keep = list(table.columns[:table.columns.get_loc("allocator") + 1]) + [c for c, _ in HEADLINE if c in table]
    summary = table[keep].copy()
    for column in summary.columns:  # mixed types (a swept key of numbers and words) as text
        if summary[column].dtype == object:
            summary[column] = summary[column].map(lambda v: None if v is None or v != v else str(v))
    path = sweep_dir / SUMMARY_FILE
    _atomic(path, lambda tmp: summary.to_parquet(tmp, index=False))
    return path


def report_sweep(sweep_dir: Path, metrics: list[str] = (), num_jobs: int | None = None) -> list[Path]:
    """sweep_summary.csv (every column), summary.parquet, a figure per headline metric (and per
    metric of FIGURE_METRICS asked for) and index.html, all in the sweep folder."""
    from sim.report import _pyplot, _save
    table, swept = sweep_table(sweep_dir, num_jobs)
    written = [sweep_dir / "sweep_summary.csv", write_summary(sweep_dir, num_jobs)]
    write_csv(written[0], table)
    ran = table[table.status == "ok"]
    figures = []
    if swept and len(ran):
        plt = _pyplot()
        for column, label in [*HEADLINE, *((m, FIGURE_METRICS[m]) for m in metrics if m not in dict(HEADLINE))]:
            if column in ran and ran[column].notna().any():
                path = sweep_dir / f"sweep_{column.replace('.', '_')}.png"
                fig = _facets(plt, ran, swept, column, label)
                _save(fig, path)
                plt.close(fig)
                figures.append((label, path))
    written += [path for _, path in figures]
    written.append(sweep_dir / "index.html")
    _atomic(written[-1], lambda tmp: tmp.write_text(_page(sweep_dir, table, swept, figures)))
    return written


def publish_figures(sweep_dir: Path, figures_dir: Path, metrics: list[str], num_jobs: int | None = None) -> list[Path]:
    """A named sweep's figures (scenarios/sweep/): the sweep's report, then its PNGs of the
    given headline metrics (all when none are given) copied into figures_dir, replacing them."""
    import shutil
    drawn = {path.name: path for path in report_sweep(sweep_dir, metrics, num_jobs) if path.suffix == ".png"}
    wanted = [f"sweep_{m.replace('.', '_')}.png" for m in metrics or [name for name, _ in HEADLINE]]
    figures_dir.mkdir(parents=True, exist_ok=True)
    published = []
    for name in wanted:
        if name in drawn:
            target = figures_dir / name
            _atomic(target, lambda tmp, source=drawn[name]: shutil.copyfile(source, tmp))
            published.append(target)
        else:
            print(f"figure {name} not drawn (no job reported that metric), not published", file=sys.stderr)
    return published


def _facets(plt, ran: pd.DataFrame, swept: list[str], column: str, label: str):
    """The metric against swept[0], a line per allocator, a panel per value of the other keys."""
    x_key, others = swept[0], swept[1:]
    panels = list(ran.groupby(others, sort=True)) if others else [((), ran)]
    columns = min(len(panels), 4)
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.4 * rows), squeeze=False, sharey=True)
    numeric = pd.api.types.is_numeric_dtype(ran[x_key])
    # numbers ascending, joined by lines; words in the sweep's order, as points
    order = sorted(ran[x_key].unique()) if numeric else list(dict.fromkeys(ran[x_key]))
    for ax, (values, rows_of_panel) in zip(axes.flat, panels):
        for allocator, lines in rows_of_panel.groupby("allocator", sort=False):
            lines = lines.set_index(x_key)[column]
            xs = [v for v in order if v in lines.index]
            positions = xs if numeric else [order.index(v) for v in xs]
            ax.plot(positions, [lines[v] for v in xs], marker="o", linestyle="-" if numeric else "none",
                    label=str(allocator))
        if not numeric:
            ax.set_xticks(range(len(order)), [str(v) for v in order], rotation=30, fontsize=7)
        ax.set_xlabel(x_key)
        ax.set_ylabel(label)
        values = values if isinstance(values, tuple) else (values,)
        ax.set_title(", ".join(f"{k}={v}" for k, v in zip(others, values)), fontsize=8)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    title = _common_title(ran)
    if title:
        fig.suptitle(title, fontsize=7)
    fig.tight_layout()
    return fig


def _common_title(ran: pd.DataFrame) -> str:
    """What every job shares: the words of the run titles (model, GPU, scenario, ...; the job
    part after ' | ' left out) that every job's title has, in the first title's order."""
    if "run_title" not in ran or ran.run_title.isna().all():
        return ""
    titles = [str(t).split(" | ")[0].split() for t in ran.run_title.dropna()]
    shared = set(titles[0]).intersection(*titles[1:])
    return " ".join(w for w in titles[0] if w in shared)


def _page(sweep_dir: Path, table: pd.DataFrame, swept: list[str], figures) -> str:
    images = "".join(f'<h3>{html.escape(label)}</h3><img src="data:image/png;base64,'
                     f'{base64.b64encode(path.read_bytes()).decode()}" style="max-width:100%">'
                     for label, path in figures)
    counts = table.groupby("job").status.first().value_counts().to_dict()
    shown = [c for c in table.columns[:table.columns.get_loc("allocator") + 1]] + [c for c, _ in HEADLINE if c in table]
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>sweep {html.escape(sweep_dir.name)}</title>"
            f"<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse;font-size:12px}}"
            f"td,th{{border:1px solid #ccc;padding:2px 6px}}</style></head><body>"
            f"<h1>Sweep {html.escape(str(sweep_dir))}</h1>"
            f"<p>jobs: {html.escape(', '.join(f'{n} {s}' for s, n in counts.items()))}; swept: "
            f"{html.escape(', '.join(swept) or 'nothing')}</p>{images}<h2>Jobs</h2>"
            f"{table[shown].to_html(index=False, na_rep='', float_format=lambda v: f'{v:.4g}')}</body></html>")
