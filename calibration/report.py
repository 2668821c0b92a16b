"""The fit report: a Markdown summary and a measured-against-predicted plot per profile."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from calibration.fit import operator_params, predict, prepare, to_catalogue
from calibration.ops import OPS
from sim.report import _pyplot, _save

NO_SPLIT = ("No held-out split: the grid gave this operator one shape class and one size range, so its "
            "fit is not checked against rows it did not see")


def worse_than_datasheet(report: dict) -> list[str]:
    """'op split: calibrated MAPE x against the datasheet profile's y' wherever the fit does worse."""
    return [f"{op} {label.split(' (')[0]}: calibrated MAPE {numbers[key]['mape']:.1%} against the datasheet "
            f"profile's {numbers[key + '_datasheet']['mape']:.1%}"
            for op, numbers in report.items() for key, label in splits(op)
            if key in numbers and numbers[key]["mape"] > numbers[key + "_datasheet"]["mape"]]


def splits(op: str) -> tuple[tuple[str, str], ...]:
    low, high = OPS[op].extrapolation_split
    axis = OPS[op].extrapolation_axis
    return (("held_out_classes", "held-out shape classes (5 folds of whole classes)"),
            ("extrapolation", f"extrapolation (fit on {axis} <= {low:g}, test {axis} >= {high:g})"))


def _row(label: str, e: dict) -> str:
    return f"| {label} | {e['num_rows']:,} | {e['mape']:.1%} | {e['p90_abs_error']:.1%} | {e['bias']:+.1%} |"


def markdown(profile: dict, report: dict) -> str:
    lines = [f"# Fit report: {profile['name']} ({profile['gpu_name']})", "",
             f"Source: {profile['source']} ({profile.get('origin', '')}); date {profile.get('date', '')}; "
             f"versions {profile.get('versions', {})}.", "",
             "Model per operator (sim.latency.operators): t = t0 + per_seq sequences + max(FLOPs / (peak e_c) "
             "+ causal FLOPs / (peak e_causal), bytes / (bandwidth e_m)); GEMMs and kernels times a correction "
             "table over log2(size) per shape class (monotone, never below the datasheet roofline, a GEMM's "
             "bandwidth at the profile's read ceiling); attention without one (its physical form "
             "extrapolates, a table would hold its edges). An efficiency the data cannot tell from the "
             "datasheet prior's (e_c of memory-bound decode, e_m of compute-bound prefill) keeps the prior.", ""]
    for op, numbers in report.items():
        fit = numbers["fit"]
        extra = (f", per_seq = {fit['per_seq_s'] * 1e6:.2f} us" if fit.get("per_seq_s") else "") + (
            f", e_causal = {fit['causal_efficiency']:.3f}" if fit.get("causal_efficiency") else "")
        lines += [f"## {op}", "",
                  f"Fitted: e_c = {fit['compute_efficiency']:.3f}, e_m = {fit['memory_efficiency']:.3f}, "
                  f"t0 = {fit['t0_s'] * 1e6:.1f} us{extra}.", ""]
        if not any(key in numbers for key, _ in splits(op)):
            lines += [NO_SPLIT + ".", ""]
            continue
        lines += ["| split | rows | MAPE | P90 abs. error | signed bias |", "|---|---:|---:|---:|---:|"]
        for key, label in splits(op):
            if key in numbers:
                lines.append(_row(f"calibrated, {label}", numbers[key]))
                lines.append(_row(f"datasheet profile alone, {label}", numbers[f"{key}_datasheet"]))
                lines.append(_row(f"bare datasheet roofline (e = 1, t0 = 0), {label}", numbers[f"{key}_roofline"]))
        for key in ("noise_rel_std_median", "noise_rel_iqr_median"):
            if key in numbers:
                lines += ["", f"Repeat-to-repeat noise of the measurements ({key}): {numbers[key]:.1%}."]
        for key, label in splits(op):
            if key in numbers:
                ours, sheet, roof = (numbers[k]["mape"] for k in (key, f"{key}_datasheet", f"{key}_roofline"))
                lines.append(f"{label.split(' (')[0].capitalize()}: calibrated MAPE {ours:.1%} against "
                             f"{sheet:.1%} for the datasheet profile's default efficiencies and {roof:.1%} "
                             f"for the bare datasheet roofline."
                             + (" **The fit is worse than the datasheet profile here**: too few or too noisy "
                                "measurements for this operator; the profile keeps the fit." if ours > sheet else ""))
        lines.append("")
    return "\n".join(lines) + "\n"


def write_report(frame: pd.DataFrame, profile: dict, base: dict, report: dict, folder: Path) -> None:
    tmp = folder / "fit_report.md.tmp"
    tmp.write_text(markdown(profile, report))
    tmp.replace(folder / "fit_report.md")
    plt = _pyplot()
    ops, frame = list(report), to_catalogue(frame)
    fig, axes = plt.subplots(1, len(ops), figsize=(5 * len(ops), 4.5), squeeze=False)
    for ax, op in zip(axes[0], ops):
        rows = prepare(frame, op, base)
        predicted = predict(rows, base, op, operator_params(profile, op))
        ax.loglog(rows.t, predicted, ".", markersize=2, alpha=0.4)
        low, high = float(np.min(rows.t)), float(np.max(rows.t))
        ax.plot([low, high], [low, high], "k--", linewidth=0.8)
        ax.set_xlabel("measured (s)")
        ax.set_ylabel("predicted (s)")
        ax.set_title(f"{op}: all rows, calibrated model")
    fig.suptitle(f"profile {profile['name']}: {profile['gpu_name']} ({profile['source']}"
                 + (f", {profile['date']}" if profile.get("date") else "") + ")", fontsize=9)
    fig.tight_layout()
    _save(fig, folder / "fit.png")
    plt.close(fig)
