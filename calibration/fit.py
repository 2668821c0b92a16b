"""Raw measurements -> a calibrated profile (numpy and pandas only: no torch, no triton).

Per operator kind, a calibrated roofline t = t0 + max(flops / (peak e_c), bytes / (bw e_m)) is
fitted (e_c, e_m, t0 minimising the mean absolute log error), then a correction table of
measured / fitted over log2(size) per shape class (sim.latency.calibrated applies it, held at the
edges, monotone, never below the datasheet roofline, a GEMM's bandwidth at the profile's read
ceiling). The report gives MAPE, P90 error and signed bias on held-out shape classes (5 folds of
whole classes), on an extrapolation split (train sizes <= 1024, test >= 2048), the
repeat-to-repeat noise of the measurements, and the same errors for the datasheet profile alone.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from calibration.ops import AS_CATALOGUE, OPS
from sim.latency.calibrated import CalibratedOp, CorrectionTable, Roofline
from sim.latency.operators import ring_latency_split
from sim.latency.profile import EVERY_FALLBACK, FALLBACKS, OPERATORS, QUANTIZED_GEMMS

SIMULATOR_OPERATORS = set(OPERATORS) | set(FALLBACKS)  # what sim.latency.profile reads

EFFICIENCIES = np.geomspace(0.03, 1.0, 40)
T0_GRID_S = np.array([0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96]) * 1e-6
PER_SEQ_GRID_S = np.array([0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3]) * 1e-6
TABLE_POINTS = 32
NUM_FOLDS = 5
UNIDENTIFIED_LOSS = 1e-3  # an efficiency the data cannot tell from the prior's within this mean |log error|
ROOFLINE_KEYS = ("compute_efficiency", "memory_efficiency", "t0_s", "per_seq_s", "causal_efficiency")


def _peak(profile: dict, op: str, dtype: str) -> float:
    operator, peak = QUANTIZED_GEMMS.get(dtype, (None, None))
    if op == "gemm" and operator and profile.get(peak):
        return float(profile[peak])
    return float(profile["bf16_flops_per_s"])


def gemm_operator(profile: dict, dtype: str) -> str:
    """The profile operator whose efficiencies time a GEMM of dtype (the simulator's choice):
    gemm_fp8 or gemm_fp4 where the GPU has the type's peak, else the 16-bit gemm."""
    operator, peak = QUANTIZED_GEMMS.get(dtype, (None, None))
    return operator if operator and profile.get(peak) else "gemm"


def _bandwidth(profile: dict, op: str) -> float:
    kind = OPS[op].bandwidth
    if kind == "none":  # no bytes to move (the CPU's step work)
        return 1.0
    if kind == "link":  # one direction of the GPU's link
        return float(profile["link_bandwidth_bytes_per_s"]) / 2
    return float(profile["host_link_bytes_per_s" if kind == "host" else "hbm_bandwidth_bytes_per_s"])


def to_catalogue(frame: pd.DataFrame) -> pd.DataFrame:
    """Benchmark rows of attention kernels as the catalogue's operators (sim.latency.operators),
    so that the fitted parameters, correction axes and classes are the ones the simulator and
    predict use; the kernel stays in column `kernel`."""
    parts = [frame[~frame.op.isin(list(AS_CATALOGUE))]]
    for kernel, (op, columns) in AS_CATALOGUE.items():
        rows = frame[frame.op == kernel]
        if rows.empty:
            continue
        renamed = rows.drop(columns=[c for c in columns if c in rows and columns[c] != c])
        renamed = renamed.assign(**{c: rows[raw].to_numpy() for c, raw in columns.items()}, op=op, kernel=kernel)
        parts.append(renamed)
    return pd.concat(parts, ignore_index=True, sort=False)


def prepare(frame: pd.DataFrame, op: str, profile: dict) -> pd.DataFrame:
    """Rows of one op with size, class, work and the datasheet-unit times: tc and tk (FLOPs and
    causal FLOPs over the peak), tm (bytes over the bandwidth), seqs (sequences)."""
    model = OPS[op]
    rows = frame[frame.op == op].copy()
    records = rows.to_dict("records")
    sizes = [model.size(r) for r in records]
    rows["size"] = sizes
    rows["klass"] = [model.shape_class(r) for r in records]
    rows["split_axis"] = [model.extrapolation(r) for r in records]
    work = [tuple(model.work(r, size)) + (0.0, 0.0) for r, size in zip(records, sizes)]
    peaks = np.array([_peak(profile, op, r["dtype"]) if "dtype" in r else 1.0 for r in records])
    rows["tc"] = np.array([w[0] for w in work]) / peaks
    rows["tm"] = np.array([w[1] for w in work]) / _bandwidth(profile, op)
    rows["seqs"] = np.array([w[2] for w in work], dtype=float)
    rows["tk"] = np.array([w[3] for w in work]) / peaks
    rows["t"] = rows.time_s.astype(float)
    return rows.reset_index(drop=True)


def modelled(params: dict, tc: np.ndarray, tm: np.ndarray, n: np.ndarray, tk: np.ndarray) -> np.ndarray:
    """The fitted form on prepared columns: t0 + per_seq n + max(tc / e_c + tk / e_causal, tm / e_m)."""
    compute = tc / params["compute_efficiency"]
    if params["causal_efficiency"]:
        compute = compute + tk / params["causal_efficiency"]
    return params["t0_s"] + params["per_seq_s"] * n + np.maximum(compute, tm / params["memory_efficiency"])


def fit_roofline(tc: np.ndarray, tm: np.ndarray, t: np.ndarray, seed: int = 0, n: np.ndarray | None = None,
                 tk: np.ndarray | None = None, prior_compute_efficiency: float = 0.5,
                 prior_memory_efficiency: float = 0.8) -> dict:
    """t0 + per_seq n + max(tc / e_c + tk / e_causal, tm / e_m) minimising mean
    |log(predicted / measured)|, by grid then local search: per_seq only where the rows' sequence
    counts differ, e_causal only where they have causal FLOPs. An efficiency whose term never binds
    (e_c in memory-bound decode, e_m in compute-bound prefill) is not identified: the prior's (the
    datasheet profile's) is kept."""
    n = np.zeros_like(t) if n is None else n
    tk = np.zeros_like(t) if tk is None else tk
    if len(t) > 4000:
        pick = np.random.default_rng(seed).choice(len(t), 4000, replace=False)
        tc, tm, t, n, tk = tc[pick], tm[pick], t[pick], n[pick], tk[pick]
    log_t = np.log(t)
    per_seq_grid = PER_SEQ_GRID_S if np.ptp(n) > 0 else np.zeros(1)
    causal_grid = EFFICIENCIES if tk.any() else np.ones(1)

    def loss(p):
        return np.abs(np.log(modelled(p, tc, tm, n, tk)) - log_t).mean()

    best, memory = (np.inf,), tm[None, None, :] / EFFICIENCIES[None, :, None]
    for t0 in T0_GRID_S:
        for per_seq in per_seq_grid:
            base = t0 + per_seq * n
            for ec in EFFICIENCIES:
                compute = (tc / ec)[None, None, :] + tk[None, None, :] / causal_grid[:, None, None]
                losses = np.abs(np.log(base + np.maximum(compute, memory)) - log_t).mean(axis=2)
                i, j = np.unravel_index(int(np.argmin(losses)), losses.shape)
                if losses[i, j] < best[0]:
                    best = (float(losses[i, j]), float(t0), float(per_seq), float(ec), float(causal_grid[i]),
                            float(EFFICIENCIES[j]))
    _, t0, per_seq, ec, ek, em = best
    fitted = {"compute_efficiency": ec, "memory_efficiency": em, "t0_s": t0, "per_seq_s": per_seq,
              "causal_efficiency": ek if tk.any() else None}
    for step in (1.08, 1.03, 1.01):  # local refinement, efficiencies capped at 1
        for _ in range(20):
            candidates = []
            for a in (1 / step, 1, step):
                for b in (1 / step, 1, step):
                    for c, d in ((1, 0), (step, 0), (1 / step, 0), (1, 2e-7), (1, -2e-7)):
                        for e in ((1 / step, 1, step) if tk.any() else (1,)):
                            candidates.append({
                                **fitted, "compute_efficiency": min(fitted["compute_efficiency"] * a, 1.0),
                                "memory_efficiency": min(fitted["memory_efficiency"] * b, 1.0),
                                "t0_s": max(0.0, fitted["t0_s"] * c + d),
                                "causal_efficiency": fitted["causal_efficiency"] and min(
                                    fitted["causal_efficiency"] * e, 1.0)})
            scored = min(candidates, key=loss)
            if loss(scored) >= loss(fitted) - 1e-12:
                break
            fitted = scored
    for key, value in (("compute_efficiency", prior_compute_efficiency),
                       ("memory_efficiency", prior_memory_efficiency)):
        prior = {**fitted, key: value}
        if loss(prior) <= loss(fitted) + UNIDENTIFIED_LOSS:
            fitted = prior
    return fitted


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


def roofline_params(params: dict) -> dict:
    return {k: params[k] for k in ROOFLINE_KEYS if k in params}


def fit_overhead(n: np.ndarray, t: np.ndarray) -> dict:
    """t0 + per_seq n for work without FLOPs or bytes (the CPU's step), least squares of the
    relative error, both terms >= 0."""
    weights = 1.0 / t
    design = np.stack([np.ones_like(n), n], axis=1) * weights[:, None]
    t0, per_seq = np.linalg.lstsq(design, t * weights, rcond=None)[0]
    if per_seq < 0:
        t0, per_seq = float(np.median(t)), 0.0
    elif t0 < 0:
        t0, per_seq = 0.0, float(np.median(t / n))
    return {"compute_efficiency": 1.0, "memory_efficiency": 1.0, "t0_s": float(t0),
            "per_seq_s": float(per_seq), "causal_efficiency": None}


def fit_op(rows: pd.DataFrame, profile: dict, op: str) -> dict:
    prior = operator_params(profile, op)
    columns = (rows.tc.to_numpy(), rows.tm.to_numpy(), rows.seqs.to_numpy(), rows.tk.to_numpy())
    if not (columns[0].any() or columns[1].any() or columns[3].any()):
        return fit_overhead(columns[2], rows.t.to_numpy())
    params = fit_roofline(columns[0], columns[1], rows.t.to_numpy(), n=columns[2], tk=columns[3],
                          prior_compute_efficiency=prior["compute_efficiency"],
                          prior_memory_efficiency=prior["memory_efficiency"])
    if op == "all_reduce" and np.ptp(columns[2]) == 0:
        # One GPU count cannot tell the ring's base latency from its per-step one: NCCL's split.
        base, per_step = ring_latency_split(params["t0_s"] + params["per_seq_s"] * columns[2][0],
                                            columns[2][0] / 2 + 1)
        params = {**params, "t0_s": base, "per_seq_s": per_step}
    if not OPS[op].table:  # the physical form extrapolates; a table would hold its edges
        return params
    return {**params, "correction": fit_table(rows, modelled(params, *columns)).to_json()}


def calibrated_op(profile: dict, op: str, params: dict, dtype: str | None) -> CalibratedOp:
    peak = _peak(profile, op, dtype) if OPS[op].peak == "compute" else 1.0
    # GEMMs read no faster than the profile's read ceiling and run no shorter than its measured small
    # kernels, as the simulator times them (sim.latency.calibrated; the profile's fallbacks where absent)
    ceiling = operator_params(profile, "gemm_ceiling")["memory_efficiency"] if op == "gemm" else 1.0
    floor = operator_params(profile, "gemm_floor")["t0_s"] if op == "gemm" else 0.0
    roof = Roofline(peak, _bandwidth(profile, op), params["compute_efficiency"], params["memory_efficiency"],
                    params["t0_s"], params.get("per_seq_s", 0.0), params.get("causal_efficiency"), ceiling, floor)
    return CalibratedOp(roof, CorrectionTable.from_json(params.get("correction")), OPS[op].monotone)


def predict(rows: pd.DataFrame, profile: dict, op: str, params: dict) -> np.ndarray:
    model = OPS[op]
    out = np.empty(len(rows))
    calibrated: dict[str | None, CalibratedOp] = {}
    for i, record in enumerate(rows.to_dict("records")):
        dtype = record.get("dtype")
        if dtype not in calibrated:
            calibrated[dtype] = calibrated_op(profile, op, params, dtype)
        out[i] = calibrated[dtype].time(record["klass"], record["size"], lambda s, r=record: model.work(r, s))
    return out


def errors(predicted: np.ndarray, measured: np.ndarray) -> dict:
    relative = (predicted - measured) / measured
    return {"mape": float(np.abs(relative).mean()), "p90_abs_error": float(np.percentile(np.abs(relative), 90)),
            "bias": float(relative.mean()), "num_rows": int(len(measured))}


def evaluate(rows: pd.DataFrame, profile: dict, op: str, datasheet: dict) -> dict:
    """Errors on held-out shape classes (5 folds) and on the op's extrapolation split, with the
    datasheet profile's and the bare roofline's errors on the same rows."""
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
    train_max, test_min = OPS[op].extrapolation_split
    train, test = rows[rows.split_axis <= train_max], rows[rows.split_axis >= test_min]
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
    frame = to_catalogue(frame)
    for op in sorted(set(frame.op) & set(OPS)):
        rows = prepare(frame, op, base)
        params = fit_op(rows, base, op)
        datasheet = operator_params(base, op)
        report[op] = {"fit": roofline_params(params), **evaluate(rows, base, op, datasheet)}
        key = operator_key(op)
        fitted = {**params, "source": provenance(source, rows), "origin": origin}
        if op == "all_reduce" and rows.seqs.nunique() == 1:
            fitted["source"] += "; latency split per ring step as NCCL's tuning.cc"
        if key in profile["operators"] or key in SIMULATOR_OPERATORS:
            profile["operators"][key] = fitted
        else:
            profile.setdefault("extra_operators", {})[op] = fitted
    profile["fit_report"] = report
    return profile, report


def provenance(source: str, rows: pd.DataFrame) -> str:
    """`measured`, or `imported:<where the rows came from> (<rows>)`."""
    if source == "measured":
        return "measured"
    families = sorted({str(s).split(":")[0] for s in rows.source.dropna()}) if "source" in rows else []
    return f"imported:{'+'.join(families) or source} ({len(rows)} rows)"


def operator_key(op: str) -> str:
    """Op names -> the profile's operators (sim.latency.profile.OPERATORS)."""
    return {"paged_decode": "attention_decode", "prefill": "attention_prefill", "all_reduce": "allreduce",
            "mla_decode": "attention_decode_mla"}.get(op, op)


def operator_params(profile: dict, op: str) -> dict:
    """A profile's parameters for an op: its profile operator, else an extra fitted operator,
    else the simulator's fallback for it (sim.latency.profile.EVERY_FALLBACK), else (never measured,
    unknown to the latency model) the GEMM's; a link's efficiency is its memory (and compute)
    efficiency."""
    key = operator_key(op)
    raw = (profile["operators"].get(key) or profile.get("extra_operators", {}).get(op)
           or (EVERY_FALLBACK[key](profile) if key in EVERY_FALLBACK else profile["operators"]["gemm"]))
    link = raw.get("link_efficiency", 1.0)
    return {**raw, "compute_efficiency": raw.get("compute_efficiency", link),
            "memory_efficiency": raw.get("memory_efficiency", link)}
