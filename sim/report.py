"""Plots and comparison tables from a run directory (or from results in memory)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from sim.errors import KvsimError
from sim.results import COMPARISON_FILE, _atomic, write_csv

BREAKDOWN = [("token_states", "token states", "#4C72B0"), ("reserved", "reserved", "#DD8452"),
             ("internal_frag", "internal frag.", "#C44E52"),
             ("external_frag", "external frag.", "#8172B3"),
             ("cached_idle", "cached idle", "#55A868"), ("free", "free", "#D9D9D9")]
TABLE_COLUMNS = {
    "allocator": "allocator",
    "kv.waste_frac": "waste",
    "kv.token_states_frac": "token_states",
    "prefix_cache.hit_rate": "hit_rate",
    "throughput.output_tokens_per_s": "out_tok/s",
    "throughput.requests_per_s": "req/s",
    "latency_s.ttft.p50": "ttft_p50_s",
    "latency_s.tpot.p50": "tpot_p50_s",
    "latency_s.e2e.p90": "e2e_p90_s",
    "scheduler.num_preemptions": "preempt",
    "scheduler.mean_batch_size": "batch",
    "num_finished": "finished",
    "num_rejected": "rejected",
}


def format_table(comparison: pd.DataFrame) -> str:
    table = comparison[list(TABLE_COLUMNS)].rename(columns=TABLE_COLUMNS)
    return table.to_string(index=False, float_format=lambda v: f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}")


def _pyplot():
    import logging

    import matplotlib
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: Path) -> None:
    _atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))


def plot_comparison(comparison: pd.DataFrame, path: Path) -> None:
    """Stacked KV memory breakdown and output throughput per allocator."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = comparison.allocator.tolist()
    bottom = [0.0] * len(names)
    for key, label, color in BREAKDOWN:
        values = comparison[f"kv.{key}_frac"].tolist()
        left.bar(names, values, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    left.set_ylabel("share of KV capacity (time-weighted)")
    left.set_title("KV memory breakdown")
    left.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    right.bar(names, comparison["throughput.output_tokens_per_s"], color="#4C72B0")
    right.set_ylabel("output tokens / s")
    right.set_title("Throughput")
    for ax in (left, right):
        ax.tick_params(axis="x", labelrotation=30)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def plot_kv_usage(timelines: dict[str, pd.DataFrame], path: Path) -> None:
    """Share of KV capacity holding token states or allocated, over time, per allocator."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    for name, timeline in timelines.items():
        # Replicas step at different times; carry each replica's last sample forward.
        wide = timeline.pivot_table(index="time_s", columns="replica",
                                    values=["capacity", "free", "cached_idle"], aggfunc="last").ffill()
        used = (wide["capacity"] - wide["free"] - wide["cached_idle"]).sum(axis=1) / wide["capacity"].sum(axis=1)
        ax.step(used.index, used.values, where="post", label=name, linewidth=1)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("allocated share of KV capacity")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


SWEEP_METRICS = [("kv.internal_frag_frac", "internal fragmentation"),
                 ("prefix_cache.hit_rate", "prefix hit rate"), ("kv.waste_frac", "waste"),
                 ("throughput.output_tokens_per_s", "output tokens / s")]


def _scalar(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def sweep_summary(sweep_dir: Path) -> tuple[pd.DataFrame, list[str]]:
    """One row per (job, allocator): the job's overrides, then its comparison row; and the keys
    whose values differ between jobs (the swept ones)."""
    frames = []
    for job in sorted((p for p in sweep_dir.iterdir() if (p / COMPARISON_FILE).is_file()),
                      key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name)):
        frame = pd.read_csv(job / COMPARISON_FILE)
        overrides_file = job / ".hydra" / "overrides.yaml"
        lines = overrides_file.read_text().splitlines() if overrides_file.is_file() else []
        for line in reversed(lines):
            key, _, value = line.removeprefix("- ").partition("=")
            if key and not key.startswith(("+", "hydra")):
                frame.insert(0, key, _scalar(value))
        frame.insert(0, "job", job.name)
        frames.append(frame)
    summary = pd.concat(frames, ignore_index=True)
    override_keys = list(summary.columns[1:summary.columns.get_loc("allocator")])
    swept = [k for k in override_keys if summary.groupby("job")[k].first().nunique() > 1]
    return summary, swept


def plot_sweep(summary: pd.DataFrame, key: str, path: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(SWEEP_METRICS), figsize=(4 * len(SWEEP_METRICS), 3.6))
    for ax, (column, label) in zip(axes, SWEEP_METRICS):
        for name, rows in summary.groupby("allocator", sort=False):
            rows = rows.sort_values(key)
            ax.plot(rows[key], rows[column], marker="o", label=name)
        ax.set_xlabel(key)
        ax.set_title(label)
        if summary[key].min() > 0 and summary[key].max() / summary[key].min() > 16:
            ax.set_xscale("log", base=2)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def report_sweep(sweep_dir: Path) -> list[Path]:
    summary, swept = sweep_summary(sweep_dir)
    written = [sweep_dir / "sweep_summary.csv"]
    write_csv(written[0], summary)
    if len(swept) == 1 and pd.api.types.is_numeric_dtype(summary[swept[0]]):
        written.append(sweep_dir / "sweep.png")
        plot_sweep(summary, swept[0], written[-1])
    return written


def report(run_dir: Path) -> list[Path]:
    """Redraw a run directory's plots and write its memory breakdown as CSV; for a sweep
    directory, write sweep_summary.csv (and sweep.png when one numeric key was swept)."""
    comparison_path = run_dir / COMPARISON_FILE
    if not comparison_path.is_file():
        if run_dir.is_dir() and any((p / COMPARISON_FILE).is_file() for p in run_dir.iterdir()):
            return report_sweep(run_dir)
        raise KvsimError(f"no {COMPARISON_FILE} in '{run_dir}', key run_dir, "
                         f"pass a directory written by 'python -m sim run' or a sweep directory")
    comparison = pd.read_csv(comparison_path)
    plot_comparison(comparison, run_dir / "memory_breakdown.png")
    timelines = {}
    for name in comparison.allocator:
        path = run_dir / name / "timeline.parquet"
        if path.is_file():
            timelines[name] = pd.read_parquet(path)
    if timelines:
        plot_kv_usage(timelines, run_dir / "kv_usage.png")
    columns = ["allocator"] + [f"kv.{key}_frac" for key, _, _ in BREAKDOWN] + ["kv.waste_frac"]
    write_csv(run_dir / "memory_breakdown.csv", comparison[columns])
    written = [run_dir / "memory_breakdown.png", run_dir / "memory_breakdown.csv"]
    return written + ([run_dir / "kv_usage.png"] if timelines else [])
