"""Plots and comparison tables from a run directory (or from results in memory)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from hydra.types import RunMode

from sim.errors import KvsimError
from sim.latency.expert_load import EXPERT_TOKENS_CV
from sim.results import COMPARISON_FILE, _atomic, write_csv

BREAKDOWN = [("token_states", "token states", "#4C72B0"), ("reserved", "reserved", "#DD8452"),
             ("internal_frag", "internal frag.", "#C44E52"),
             ("external_frag", "external frag.", "#8172B3"),
             ("cached_idle", "cached idle", "#55A868"), ("free", "free", "#D9D9D9")]
TABLE_COLUMNS = {
    "allocator": "allocator",
    "kv.waste_of_used": "waste/used",
    "kv.token_states_of_used": "tokens/used",
    "kv.token_states_of_capacity": "tokens/capacity",
    "prefix_cache.hit_rate": "hits/prompt",
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
# Shown only when some allocator has any: the other ways a request is not served as asked.
UNSERVED_COLUMNS = {
    "unserved.truncated_prompt": "trunc_prompt",
    "unserved.truncated_output": "trunc_output",
    "unserved.skipped_malformed_records": "skipped",
    "unserved.failed_in_trace": "failed",
    "unserved.unfinished": "unfinished",
}
# Shown only when an SLO target is set (slo.*): whether every target held, and goodput.
SLO_COLUMNS = {
    "slo.all_met": "slo_met",
    "slo.attained_all_share_of_measured_requests": "slo_ok/measured",
    "slo.goodput_requests_per_s": "goodput_req/s",
}
SERVING_ROWS = [  # (vllm bench serve's label, metrics.json key under vllm_bench)
    ("Successful requests", "completed"),
    ("Request throughput (req/s)", "request_throughput"),
    ("Output token throughput (tok/s)", "output_throughput"),
    ("Total Token throughput (tok/s)", "total_token_throughput"),
    ("Mean TTFT (ms)", "mean_ttft_ms"), ("Median TTFT (ms)", "median_ttft_ms"),
    ("P99 TTFT (ms)", "p99_ttft_ms"),
    ("Mean TPOT (ms)", "mean_tpot_ms"), ("Median TPOT (ms)", "median_tpot_ms"),
    ("P99 TPOT (ms)", "p99_tpot_ms"),
    ("Mean ITL (ms)", "mean_itl_ms"), ("Median ITL (ms)", "median_itl_ms"),
    ("P99 ITL (ms)", "p99_itl_ms"),
]


def _number(v) -> str:
    return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"


def format_table(comparison: pd.DataFrame) -> str:
    """The KV and headline table; shares name their denominator (x/used, x/capacity)."""
    columns = dict(TABLE_COLUMNS)
    columns.update({k: v for k, v in UNSERVED_COLUMNS.items()
                    if k in comparison and comparison[k].fillna(0).any()})
    if any(f"slo.{name}.target_s" in comparison for name in ("ttft", "tpot", "e2e")):
        columns.update(SLO_COLUMNS)
    table = comparison[list(columns)].rename(columns=columns)
    return table.to_string(index=False, float_format=_number, na_rep="n/a")  # NaN: sim.metrics.NO_DATA


def format_serving(comparison: pd.DataFrame) -> str:
    """The serving results in vllm bench serve's words and units (milliseconds)."""
    def cell(key: str, value) -> str:
        if value != value:  # NaN (or null read back): no request measured
            return "n/a"
        return f"{int(value)}" if key == "completed" else f"{value:.2f}"

    rows = {label: [cell(key, v) for v in comparison[f"vllm_bench.{key}"]] for label, key in SERVING_ROWS}
    frame = pd.DataFrame(rows, index=comparison.allocator).T
    frame.index.name = "serving (measured window)"
    return frame.to_string()


def run_title(cfg, hydra_cfg=None, replicas: str | None = None) -> str:
    """model, GPU, parallelism and precision (where not the default), replicas, scenario and, in a
    sweep, the job's overrides."""
    scenario = hydra_cfg.runtime.choices.get("scenario") if hydra_cfg is not None else None
    drafts = cfg.get("speculative_config") or {}
    extra = "".join(f" {key}={str(value).lower() if isinstance(value, bool) else value}" for key, value, default in (
        ("pipeline_parallel_size", cfg.get("pipeline_parallel_size", 1), 1),
        ("enable_expert_parallel", cfg.get("enable_expert_parallel", False), False),
        ("expert_tokens_cv", cfg.get("expert_tokens_cv", EXPERT_TOKENS_CV), EXPERT_TOKENS_CV),
        ("data_parallel_size", cfg.get("data_parallel_size", 1), 1),
        ("speculative_config.method", drafts.get("method"), None),
        ("speculative_config.num_speculative_tokens", drafts.get("num_speculative_tokens", 0), 0),
        ("speculative_config.acceptance_length", drafts.get("acceptance_length"), None),
        ("quantization", cfg.get("quantization"), None),
        ("async_scheduling", cfg.get("async_scheduling", False) and cfg.get("pipeline_parallel_size", 1) == 1, False),
        ("capacity_scheduler_policy", cfg.get("capacity_scheduler_policy", "max_utilization"), "max_utilization"))
        if value != default)
    replicas = cfg.cluster.num_replicas if replicas is None else replicas
    gpus = f"gpu={cfg.gpu} tensor_parallel_size={cfg.tensor_parallel_size}{extra} cluster.num_replicas={replicas}"
    pd = cfg.get("disaggregation")
    if pd is not None and pd.enabled:
        gpus = "disaggregated: " + " + ".join(
            f"{pd[f'{role}_replicas']} {role} ({pd[f'{role}_gpu'] or cfg.gpu} TP "
            f"{pd[f'{role}_tensor_parallel_size'] or cfg.tensor_parallel_size})" for role in ("prefill", "decode")) + extra
    title = f"scenario={scenario} model={cfg.model.name} {gpus} seed={cfg.seed}"
    if hydra_cfg is not None and hydra_cfg.mode == RunMode.MULTIRUN:
        swept = " ".join(o for o in hydra_cfg.overrides.task if not o.startswith("hydra"))
        title += f" | job {hydra_cfg.job.num}: {swept}"
    return title


def _pyplot():
    import logging

    import matplotlib
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: Path) -> None:
    _atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))


def plot_comparison(comparison: pd.DataFrame, path: Path, title: str = "") -> None:
    """Stacked KV memory breakdown (shares of capacity) and output throughput per allocator."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))
    names = comparison.allocator.tolist()
    bottom = [0.0] * len(names)
    for key, label, color in BREAKDOWN:
        values = comparison[f"kv.{key}_of_capacity"].tolist()
        left.bar(names, values, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    left.set_ylabel("share of KV capacity (time-weighted)")
    left.set_title("KV memory breakdown (of capacity)")
    left.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    right.bar(names, comparison["throughput.output_tokens_per_s"], color="#4C72B0")
    right.set_ylabel("output tokens / s (measured window)")
    right.set_title("Throughput")
    for ax in (left, right):
        ax.tick_params(axis="x", labelrotation=30)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    _finish(fig, path, title)


def _finish(fig, path: Path, title: str) -> None:
    plt = _pyplot()
    if title:
        fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def _carried(timeline: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """Replicas step at different times: carry each replica's last sample forward, sum them."""
    wide = timeline.pivot_table(index="time_s", columns="replica", values=columns, aggfunc="last").ffill()
    return pd.DataFrame({c: wide[c].sum(axis=1) for c in columns})


def _shade_excluded(ax, window: tuple[float, float] | None) -> None:
    if window is None:
        return
    lo, hi = ax.get_xlim()
    ax.axvspan(lo, window[0], color="#000000", alpha=0.08, lw=0)
    ax.axvspan(window[1], hi, color="#000000", alpha=0.08, lw=0)
    ax.set_xlim(lo, hi)


def plot_breakdown_over_time(timelines: dict[str, pd.DataFrame], path: Path, title: str = "",
                             window: tuple[float, float] | None = None) -> None:
    """Per allocator, the KV memory breakdown over time as stacked shares of capacity."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(timelines), 1, figsize=(10, 2.4 * len(timelines) + 0.6),
                             sharex=True, squeeze=False)
    keys = [key for key, _, _ in BREAKDOWN]
    for ax, (name, timeline) in zip(axes[:, 0], timelines.items()):
        summed = _carried(timeline, ["capacity", *keys])
        shares = [summed[k] / summed["capacity"] for k in keys]
        ax.stackplot(summed.index, *shares, step="post", labels=[l for _, l, _ in BREAKDOWN],
                     colors=[c for _, _, c in BREAKDOWN])
        ax.set_ylim(0, 1)
        ax.set_ylabel("share of capacity")
        ax.set_title(name, fontsize=9)
        _shade_excluded(ax, window)
    axes[0, 0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes[-1, 0].set_xlabel("simulated time (s); shaded: outside the measured window")
    _finish(fig, path, title)


def plot_latency_cdfs(requests: dict[str, pd.DataFrame], path: Path, title: str = "",
                      window: tuple[float, float] | None = None) -> None:
    """CDFs of TTFT and TPOT (milliseconds) of the finished requests measured, per allocator."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, frame in requests.items():
        done = frame[frame.status == "finished"]
        if window is not None:
            done = done[(done.arrival_time_s >= window[0]) & (done.arrival_time_s <= window[1])]
        for ax, column in zip(axes, ("ttft_s", "tpot_s")):
            values = np.sort(done[column].dropna().to_numpy() * 1e3)
            if values.size:
                ax.step(values, np.arange(1, values.size + 1) / values.size, where="post", label=name)
    for ax, label in zip(axes, ("TTFT (ms)", "TPOT (ms)")):
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("share of measured requests")
        ax.set_ylim(0, 1.01)
        ax.set_title(f"{label.split()[0]} CDF")
    if axes[0].get_legend_handles_labels()[1]:  # no finished request: nothing to name
        axes[0].legend(fontsize=8)
    _finish(fig, path, title)


def plot_kv_usage(timelines: dict[str, pd.DataFrame], path: Path, title: str = "",
                  window: tuple[float, float] | None = None) -> None:
    """Share of KV capacity allocated (used = capacity - free - cached idle), over time."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    for name, timeline in timelines.items():
        summed = _carried(timeline, ["capacity", "free", "cached_idle"])
        used = (summed["capacity"] - summed["free"] - summed["cached_idle"]) / summed["capacity"]
        ax.step(used.index, used.values, where="post", label=name, linewidth=1)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("used share of KV capacity")
    ax.set_ylim(0, 1.02)
    _shade_excluded(ax, window)
    ax.legend(fontsize=8)
    _finish(fig, path, title)


def _window(comparison: pd.DataFrame) -> tuple[float, float] | None:
    if "measurement.window_s" not in comparison:
        return None
    window = comparison["measurement.window_s"].iloc[0]
    if isinstance(window, str):  # read back from comparison.csv
        window = [float(v) for v in window.strip("[]").split(",")]
    return float(window[0]), float(window[1])


def plot_run(comparison: pd.DataFrame, timelines: dict, requests: dict, out_dir: Path,
             title: str) -> list[Path]:
    """Every plot of a run directory: the same numbers as comparison.csv and the table."""
    window = _window(comparison)
    written = [out_dir / "comparison.png"]
    plot_comparison(comparison, written[0], title)
    if timelines:
        written += [out_dir / "memory_breakdown.png", out_dir / "kv_usage.png"]
        plot_breakdown_over_time(timelines, written[-2], title, window)
        plot_kv_usage(timelines, written[-1], title, window)
    if requests:
        written.append(out_dir / "latency_cdf.png")
        plot_latency_cdfs(requests, written[-1], title, window)
    return written


def _with_denominator_names(comparison: pd.DataFrame) -> pd.DataFrame:
    """Runs written before the *_of_capacity / *_of_used names had the same shares as *_frac."""
    if "kv.token_states_of_capacity" in comparison:
        return comparison
    comparison = comparison.copy()
    for key, _, _ in BREAKDOWN:
        comparison[f"kv.{key}_of_capacity"] = comparison[f"kv.{key}_frac"]
    used = 1 - comparison["kv.free_frac"] - comparison["kv.cached_idle_frac"]
    comparison["kv.waste_of_used"] = comparison["kv.waste_frac"]
    comparison["kv.token_states_of_used"] = (comparison["kv.token_states_frac"] / used).where(used > 0)  # else NaN
    return comparison


def report(run_dir: Path) -> list[Path]:
    """Redraw a run directory's plots and write its memory breakdown as CSV; for a sweep
    directory, its summary, figures and index.html (sim.sweep)."""
    comparison_path = run_dir / COMPARISON_FILE
    if not comparison_path.is_file():
        if run_dir.is_dir() and any((p / COMPARISON_FILE).is_file() or (p / "status.json").is_file()
                                    for p in run_dir.iterdir() if p.is_dir()):
            from sim.sweep import last_sweep_jobs, report_sweep
            return report_sweep(run_dir, num_jobs=last_sweep_jobs(run_dir))
        raise KvsimError(f"no {COMPARISON_FILE} in '{run_dir}', key run_dir, "
                         f"pass a directory written by 'python -m sim run' or a sweep directory")
    comparison = _with_denominator_names(pd.read_csv(comparison_path))
    timelines, requests = {}, {}
    for name in comparison.allocator:
        for kind, store in (("timeline", timelines), ("requests", requests)):
            path = run_dir / name / f"{kind}.parquet"
            if path.is_file():
                store[name] = pd.read_parquet(path)
    title = str(comparison["run_title"].iloc[0]) if "run_title" in comparison else ""
    written = plot_run(comparison, timelines, requests, run_dir, title)
    columns = (["allocator"] + [f"kv.{key}_of_capacity" for key, _, _ in BREAKDOWN]
               + ["kv.waste_of_used", "kv.token_states_of_used"])
    write_csv(run_dir / "memory_breakdown.csv", comparison[columns])
    return written + [run_dir / "memory_breakdown.csv"]
