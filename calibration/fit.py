"""Raw measurements -> a calibrated profile (numpy and pandas only: no torch, no triton).

Per operator kind, a calibrated roofline t = t0 + max(flops / (peak e_c), bytes / (bw e_m)) is
fitted (e_c, e_m, t0 minimising the mean absolute log error), then a correction table of
measured / fitted over log2(size) per shape class (sim.latency.calibrated applies it, held at the
edges, monotone, never below the datasheet roofline). The report gives MAPE, P90 error and
signed bias on held-out shape classes (5 folds of whole classes), on an extrapolation split
(train sizes <= 1024, test >= 2048), the repeat-to-repeat noise of the measurements, and the
same errors for the datasheet profile alone.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from calibration.ops import OPS, shape_class
from sim.latency.calibrated import CalibratedOp, CorrectionTable, Roofline

EFFICIENCIES = np.geomspace(0.03, 1.0, 40)
T0_GRID_S = np.array([0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96]) * 1e-6
TABLE_POINTS = 32
NUM_FOLDS = 5
EXTRAPOLATION = (1024, 2048)


def _peak(profile: dict, op: str, dtype: str) -> float:
    if op == "gemm" and dtype == "fp8" and profile.get("fp8_flops_per_s"):
        return float(profile["fp8_flops_per_s"])
    return float(profile["bf16_flops_per_s"])


def _bandwidth(profile: dict, op: str) -> float:
    return float(profile["host_link_bytes_per_s" if OPS[op].bandwidth == "host" else "hbm_bandwidth_bytes_per_s"])


def prepare(frame: pd.DataFrame, op: str, profile: dict) -> pd.DataFrame:
    """Rows of one op with size, class, FLOPs, bytes and the datasheet-unit times."""
    model = OPS[op]
    rows = frame[frame.op == op].copy()
    records = rows.to_dict("records")
    rows["size"] = [float(r[model.size_column]) for r in records]
    rows["klass"] = [shape_class(op, r) for r in records]
    work = [model.work(r, float(r[model.size_column])) for r in records]
    peaks = np.array([_peak(profile, op, r["dtype"]) for r in records])
    rows["tc"] = np.array([w[0] for w in work]) / peaks
    rows["tm"] = np.array([w[1] for w in work]) / _bandwidth(profile, op)
    rows["t"] = rows.time_s.astype(float)
    return rows.reset_index(drop=True)


def fit_roofline(tc: np.ndarray, tm: np.ndarray, t: np.ndarray, seed: int = 0) -> tuple[float, float, float]:
    """(e_c, e_m, t0) minimising mean |log(predicted / measured)|, by grid then local search."""
    if len(t) > 4000:
        pick = np.random.default_rng(seed).choice(len(t), 4000, replace=False)
        tc, tm, t = tc[pick], tm[pick], t[pick]
    log_t = np.log(t)

    def loss(ec, em, t0):
        return np.abs(np.log(t0 + np.maximum(tc / ec, tm / em)) - log_t).mean()

    best = (np.inf, 1.0, 1.0, 0.0)
    em_grid = EFFICIENCIES[:, None]
    for t0 in T0_GRID_S:
        for ec in EFFICIENCIES:
            losses = np.abs(np.log(t0 + np.maximum(tc / ec, tm / em_grid)) - log_t).mean(axis=1)
            j = int(np.argmin(losses))
            if losses[j] < best[0]:
                best = (float(losses[j]), float(ec), float(EFFICIENCIES[j]), float(t0))
    _, ec, em, t0 = best
    for step in (1.08, 1.03, 1.01):  # local refinement, efficiencies capped at 1
        for _ in range(20):
            candidates = [(ec * a, em * b, max(0.0, t0 * c + d))
                          for a in (1 / step, 1, step) for b in (1 / step, 1, step)
                          for c, d in ((1, 0), (step, 0), (1 / step, 0), (1, 2e-7), (1, -2e-7))]
            candidates = [(min(a, 1.0), min(b, 1.0), c) for a, b, c in candidates]
            scored = min(candidates, key=lambda p: loss(*p))
            if loss(*scored) >= loss(ec, em, t0) - 1e-12:
                break
            ec, em, t0 = scored
    return ec, em, t0


def fit_table(rows: pd.DataFrame, fitted: np.ndarray) -> CorrectionTable:
    x = np.log2(rows["size"].to_numpy())
    grid = np.linspace(x.min(), x.max(), min(TABLE_POINTS, len(np.unique(x))))
    ratio = rows.t.to_numpy() / fitted
    nearest = np.abs(x[:, None] - grid[None, :]).argmin(axis=1)
    classes = {}
    for klass, index in rows.groupby("klass").indices.items():
        frame = pd.DataFrame({"bin": nearest[index], "ratio": ratio[index]})
        medians = frame.groupby("bin").ratio.median()
        classes[klass] = tuple(np.interp(np.arange(len(grid)), medians.index.to_numpy(), medians.to_numpy()))
    stacked = np.array(list(classes.values()))
    return CorrectionTable(tuple(grid.tolist()), tuple(np.median(stacked, axis=0).tolist()),
                           {k: tuple(float(v) for v in values) for k, values in classes.items()})


def fit_op(rows: pd.DataFrame, profile: dict, op: str) -> dict:
    ec, em, t0 = fit_roofline(rows.tc.to_numpy(), rows.tm.to_numpy(), rows.t.to_numpy())
    fitted = t0 + np.maximum(rows.tc.to_numpy() / ec, rows.tm.to_numpy() / em)
    table = fit_table(rows, fitted)
    return {"compute_efficiency": ec, "memory_efficiency": em, "t0_s": t0,
            "correction": table.to_json()}


def predict(rows: pd.DataFrame, profile: dict, op: str, params: dict) -> np.ndarray:
    model = OPS[op]
    table = CorrectionTable.from_json(params.get("correction"))
    out = np.empty(len(rows))
    calibrated: dict[tuple, CalibratedOp] = {}
    for i, record in enumerate(rows.to_dict("records")):
        key = (_peak(profile, op, record["dtype"]),)
        if key not in calibrated:
            calibrated[key] = CalibratedOp(Roofline(key[0], _bandwidth(profile, op), params["compute_efficiency"],
                                                    params["memory_efficiency"], params["t0_s"]), table)
        out[i] = calibrated[key].time(record["klass"], record["size"], lambda s, r=record: model.work(r, s))
    return out


def errors(predicted: np.ndarray, measured: np.ndarray) -> dict:
    relative = (predicted - measured) / measured
    return {"mape": float(np.abs(relative).mean()), "p90_abs_error": float(np.percentile(np.abs(relative), 90)),
            "bias": float(relative.mean()), "num_rows": int(len(measured))}


def evaluate(rows: pd.DataFrame, profile: dict, op: str, datasheet: dict) -> dict:
    classes = sorted(rows.klass.unique())
    roofline = {"compute_efficiency": 1.0, "memory_efficiency": 1.0, "t0_s": 0.0}
    held_pred, held_true, sheet_pred, roof_pred = [], [], [], []
    for fold in range(NUM_FOLDS):
        test_classes = set(classes[fold::NUM_FOLDS])
        test = rows[rows.klass.isin(test_classes)]
        train = rows[~rows.klass.isin(test_classes)]
        if test.empty or train.empty:
            continue
        params = fit_op(train, profile, op)
        held_pred.append(predict(test, profile, op, params))
        held_true.append(test.t.to_numpy())
        sheet_pred.append(predict(test, profile, op, datasheet))
        roof_pred.append(predict(test, profile, op, roofline))
    report = {}
    if held_true:
        truth = np.concatenate(held_true)
        report["held_out_classes"] = errors(np.concatenate(held_pred), truth)
        report["held_out_classes_datasheet"] = errors(np.concatenate(sheet_pred), truth)
        report["held_out_classes_roofline"] = errors(np.concatenate(roof_pred), truth)
    train = rows[rows["size"] <= EXTRAPOLATION[0]]
    test = rows[rows["size"] >= EXTRAPOLATION[1]]
    if len(train) and len(test):
        params = fit_op(train, profile, op)
        report["extrapolation"] = errors(predict(test, profile, op, params), test.t.to_numpy())
        report["extrapolation_datasheet"] = errors(predict(test, profile, op, datasheet), test.t.to_numpy())
        report["extrapolation_roofline"] = errors(predict(test, profile, op, roofline), test.t.to_numpy())
    if "time_s_std" in rows and rows.time_s_std.notna().any():
        report["noise_rel_std_median"] = float((rows.time_s_std / rows.t).median())
    elif {"time_s_p20", "time_s_p80"} <= set(rows.columns) and rows.time_s_p80.notna().any():
        report["noise_rel_iqr_median"] = float(((rows.time_s_p80 - rows.time_s_p20) / rows.t).median())
    return report


def fit_profile(frame: pd.DataFrame, base: dict, *, name: str, source: str, origin: str,
                date: str, versions: dict) -> tuple[dict, dict]:
    """The base (datasheet) profile with every measured operator fitted; and the fit report."""
    profile = {**base, "name": name, "source": source, "origin": origin, "date": date,
               "versions": versions, "operators": {k: dict(v) for k, v in base["operators"].items()}}
    report = {}
    for op in sorted(set(frame.op) & set(OPS)):
        rows = prepare(frame, op, base)
        params = fit_op(rows, base, op)
        datasheet = {k: base["operators"].get(operator_key(op), base["operators"]["gemm"])[k]
                     for k in ("compute_efficiency", "memory_efficiency", "t0_s")}
        report[op] = {"fit": {k: params[k] for k in ("compute_efficiency", "memory_efficiency", "t0_s")},
                      **evaluate(rows, base, op, datasheet)}
        key = operator_key(op)
        if key in profile["operators"]:
            profile["operators"][key] = {**params, "source": source, "origin": origin}
        else:
            profile.setdefault("extra_operators", {})[op] = {**params, "source": source, "origin": origin}
    profile["fit_report"] = report
    return profile, report


def operator_key(op: str) -> str:
    """Raw op names -> the latency model's operators (sim.latency.profile.OPERATORS)."""
    return {"paged_decode": "attention_decode", "prefill": "attention_prefill"}.get(op, op)


def operator_params(profile: dict, op: str) -> dict:
    """A profile's fitted parameters for a raw op: its latency-model operator, else an extra
    fitted operator, else (never measured, unknown to the latency model) the GEMM's."""
    return (profile["operators"].get(operator_key(op)) or profile.get("extra_operators", {}).get(op)
            or profile["operators"]["gemm"])
