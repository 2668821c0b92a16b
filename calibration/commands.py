"""The Hydra task functions behind `python -m calibration <verb>` (fit, import-vidur, predict and
show import neither torch nor triton; run imports the benchmarks lazily)."""
from __future__ import annotations

import json
import os
import shutil
import sys
from datetime import date
from importlib import resources
from pathlib import Path

import numpy as np
import pandas as pd
from omegaconf import DictConfig

from calibration.fit import (
    fit_profile,
    gemm_operator,
    operator_params,
    predict,
    prepare,
)
from calibration.gpus import base_profile, check_profile_name
from calibration.ops import OPS
from calibration.raw import RawError, read_raw, write_raw
from calibration.report import worse_than_datasheet, write_report
from calibration.shapes import op_rows, read_shapes, unread_columns
from sim.errors import UnknownNameError
from sim.latency.profile import load_profile, packaged_profiles
from sim.staging import first_missing

PACKAGED = "calibration/profiles"


def profile_json(name: str) -> dict:
    """A profile's JSON: results/calibration/<name>/profile.json here first, then packaged."""
    load_profile(name)  # validates and raises the one-line error for unknown names
    local = Path("results") / "calibration" / name / "profile.json"
    if local.is_file():
        return json.loads(local.read_text())
    return json.loads((resources.files("calibration") / "profiles" / f"{name}.json").read_text())


def _datasheet(name: str) -> dict:
    packaged = resources.files("calibration") / "profiles" / f"{name}.json"
    if not packaged.is_file():
        raise UnknownNameError("base GPU profile", name, packaged_profiles(), "key base")
    return json.loads(packaged.read_text())


def _fit_and_write(frame: pd.DataFrame, cfg: DictConfig, source: str, origin: str,
                   raw_rows: list[dict] | None = None, base: dict | None = None) -> Path:
    """Fit, then write raw.csv (if given), profile.json and the report: all of them or none.
    The base is a packaged datasheet profile unless given (a CPU's measured ceilings)."""
    gpu_names = sorted(str(g) for g in frame["gpu"].dropna().unique()) if "gpu" in frame else []
    packaged = packaged_profiles()
    check_profile_name(cfg.name, gpu_names, packaged)
    if base is None:
        base = _datasheet(base_profile(cfg.base, cfg.name, gpu_names, packaged))
    versions = {k: str(frame[k].dropna().iloc[0]) for k in ("driver", "torch", "triton")
                if k in frame and frame[k].notna().any()}
    profile, report = fit_profile(frame, base, name=cfg.name, source=source, origin=origin,
                                  date=date.today().isoformat(), versions=versions)
    if gpu_names:
        profile["gpu_name"] = ", ".join(gpu_names)  # what the data says, not the base's name
    folder = Path(cfg.out_dir) / cfg.name
    staging = folder.parent / f".{folder.name}.partial-{os.getpid()}"
    created = first_missing(folder)
    written = False
    try:
        staging.mkdir(parents=True, exist_ok=True)
        if raw_rows is not None:
            write_raw(raw_rows, staging / "raw.csv")
        (staging / "profile.json").write_text(json.dumps(profile, indent=1) + "\n")
        write_report(frame, profile, base, report, staging)
        folder.mkdir(parents=True, exist_ok=True)
        for path in staging.iterdir():
            os.replace(path, folder / path.name)
        written = True
    except OSError as exc:
        raise RawError(f"cannot write the profile ({exc.strerror}), {exc.filename}, "
                       f"give out_dir= a folder you can write to") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if not written and created is not None and created.is_dir() and not any(created.rglob("*.*")):
            shutil.rmtree(created, ignore_errors=True)  # folders this call made, still empty
    for op, numbers in report.items():
        fit = numbers["fit"]
        errors = "  ".join(f"{label} MAPE {numbers[key]['mape']:.1%}" for key, label in
                           (("held_out_classes", "held-out classes"), ("extrapolation", "extrapolation"))
                           if key in numbers)
        print(f"{op}: e_c={fit['compute_efficiency']:.3f} e_m={fit['memory_efficiency']:.3f} t0={fit['t0_s'] * 1e6:.1f}us"
              + (f" per_seq={fit['per_seq_s'] * 1e6:.2f}us" if fit.get("per_seq_s") else "")
              + (f" e_causal={fit['causal_efficiency']:.3f}" if fit.get("causal_efficiency") else "")
              + f"  {errors or 'no held-out split (one shape class, one size range)'}")
    print(f"wrote {folder / 'profile.json'} and {folder / 'fit_report.md'} "
          f"(GPU {profile['gpu_name']}, datasheet base {base['name']})")
    for worse in worse_than_datasheet(report):
        print(f"warning: {worse}: the fit predicts rows it did not see worse than the datasheet profile "
              f"(too few or too noisy measurements); the profile keeps the fit, see fit_report.md; fix: a "
              f"larger grid (grid=quick or full) or a quieter machine", file=sys.stderr)
    return folder


def fit_task(cfg: DictConfig) -> None:
    """Refit a profile from a raw CSV (no GPU needed)."""
    frame = read_raw(Path(cfg.raw))
    _fit_and_write(frame, cfg, raw_provenance(frame, Path(cfg.raw)), origin=str(cfg.raw))


def raw_provenance(frame, path: Path) -> str:
    """`measured` when every row's source is `measured` (or the file has no sources: calibration
    run writes `measured`), `imported` when none is (Vidur's, published timings); a file mixing
    both is refused."""
    if "source" not in frame or frame.source.isna().all():
        return "measured"
    measured = frame.source.fillna("measured").astype(str).str.strip().str.lower().eq("measured")
    if measured.all():
        return "measured"
    if not measured.any():
        return "imported"
    raise RawError(f"{path}: {int(measured.sum())} rows say source=measured and {int((~measured).sum())} name "
                   f"another source, field source, fit measured and imported timings from separate files")


def import_vidur_task(cfg: DictConfig) -> None:
    """Vidur's public operator profiles -> raw.csv -> fitted profile (source: imported)."""
    from calibration.vidur import import_directory

    folders = [cfg.path] if isinstance(cfg.path, str) else list(cfg.path)
    rows = [row for folder in folders for row in import_directory(Path(str(folder)))]
    _fit_and_write(pd.DataFrame(rows), cfg, "imported", raw_rows=rows,
                   origin="Vidur (microsoft/vidur, MIT; Agrawal et al., MLSys 2024): "
                          + ", ".join(Path(str(f)).name for f in folders))


def predict_task(cfg: DictConfig) -> None:
    """Predicted seconds for each row of a shapes CSV (calibration.shapes), in order, written to `out`."""
    profile = profile_json(cfg.gpu)
    shapes_path, out_path = Path(cfg.shapes), Path(cfg.out)
    shapes, lines = read_shapes(shapes_path)
    if not out_path.parent.is_dir() or out_path.is_dir():
        raise RawError(f"cannot write '{out_path}', key out, give a file path in a folder that exists")
    out = np.empty(len(shapes))
    for op, index in shapes.groupby("op").indices.items():
        rows = op_rows(shapes, lines, op, index, shapes_path).assign(time_s=1.0)
        if op != "gemm" and "dtype" in OPS[op].columns and (rows.dtype == "nvfp4").any():
            raise RawError(f"op={op} rows of dtype nvfp4: NVFP4 is a weight type, {shapes_path}, "
                           f"give {op} rows a dtype of fp16, bf16, fp8 or fp32 (nvfp4: op=gemm rows only)")
        try:
            prepared = prepare(rows, op, profile)
        except (KeyError, ValueError) as exc:
            raise RawError(f"op={op} rows have a bad value ({exc}), {shapes_path}, give {op} rows "
                           + ("a dtype of fp16, bf16, fp8, fp32 or nvfp4 (gemm)" if "dtype" in OPS[op].columns else
                              f"values for {', '.join(OPS[op].columns)}")) from None
        if op == "all_reduce":
            out[index] = engine_all_reduce(rows, profile)
        elif op == "gemm":  # each dtype's own operator (gemm_fp8, gemm_fp4), as the simulator picks it
            if (prepared.dtype == "nvfp4").any() and not profile.get("fp4_flops_per_s"):
                raise RawError(f"op=gemm rows of dtype nvfp4 need FP4 tensor cores, which gpu={cfg.gpu} lacks, "
                               f"{shapes_path}, use a Blackwell profile (gpu=b200) or another dtype")
            for dtype, part in prepared.groupby("dtype").indices.items():
                params = operator_params(profile, gemm_operator(profile, dtype))
                out[index[part]] = predict(prepared.iloc[part], profile, op, params)
        else:
            out[index] = predict(prepared, profile, op, operator_params(profile, op))
    result = shapes.assign(time_s=out)
    tmp = Path(str(out_path) + ".tmp")
    result.to_csv(tmp, index=False)
    tmp.replace(out_path)
    unread = unread_columns(shapes)
    if unread:
        print(f"note: column(s) {', '.join(unread)} of {shapes_path}: no operator reads them (kept as they are; "
              f"a misspelt optional column falls back to its default)", file=sys.stderr)
    print(f"wrote {len(result)} predictions to {out_path}")


def engine_all_reduce(rows: pd.DataFrame, profile: dict) -> np.ndarray:
    """The simulator's all-reduce (its algorithm chosen per size, sim.latency.collectives) per row."""
    from sim.latency.collectives import all_reduce_for
    from sim.latency.profile import profile_from_dict
    gpu = profile_from_dict(profile)
    groups = {n: all_reduce_for(gpu, n) for n in rows.num_gpus.astype(int).unique()}
    return np.array([groups[int(n)].time(float(b)) for b, n in zip(rows["bytes"], rows.num_gpus)])


def flops_text(flops: float) -> str:
    return f"{flops / 1e12:.0f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.1f} GFLOP/s"


def show_task(cfg: DictConfig) -> None:
    """A profile's parameters, provenance and fit quality."""
    profile = profile_json(cfg.gpu)
    print(f"{profile['name']}: {profile['gpu_name']}  source={profile['source']}"
          + (f"  date={profile['date']}" if profile.get("date") else ""))
    print(f"memory {profile['memory_bytes'] / 2**30:.1f} GiB  "
          f"HBM {profile['hbm_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s  "
          f"bf16 {flops_text(profile['bf16_flops_per_s'])}"
          + "".join(f"  {dtype} {flops_text(profile[key])}" for dtype, key in
                    (("fp8", "fp8_flops_per_s"), ("fp4", "fp4_flops_per_s")) if profile.get(key)))
    for name, op in profile["operators"].items():
        if name == "gemm_floor":  # not a cost added to each GEMM: the least time any GEMM kernel takes
            print(f"  {name:<18} source={op.get('source')} least GEMM kernel time={op['t0_s'] * 1e6:.2f}us "
                  "(every GEMM dtype, grouped GEMMs too)")
            continue
        print(f"  {name:<18} source={op.get('source', profile['source']):<9} "
              f"e_c={op.get('compute_efficiency', op.get('link_efficiency', 1)):.3f} "
              f"e_m={op.get('memory_efficiency', op.get('link_efficiency', 1)):.3f} t0={op['t0_s'] * 1e6:.1f}us"
              + (f" per_seq={op['per_seq_s'] * 1e6:.2f}us" if op.get("per_seq_s") else "")
              + ("  +correction table" if op.get("correction") else ""))
    for name, source in load_profile(cfg.gpu).provenance().items():
        if name not in profile["operators"]:  # what the simulator uses for an operator the file lacks
            print(f"  {name:<18} source={source}")
    for op, numbers in profile.get("fit_report", {}).items():
        for split in ("held_out_classes", "extrapolation"):
            if split in numbers:
                e, d, r = (numbers.get(f"{split}{suffix}", {}) for suffix in ("", "_datasheet", "_roofline"))
                print(f"  fit {op} {split}: MAPE {e['mape']:.1%} P90 {e['p90_abs_error']:.1%} bias {e['bias']:+.1%}"
                      + (f"  (datasheet defaults: {d['mape']:.1%}, bare roofline: {r['mape']:.1%})" if d and r else ""))
