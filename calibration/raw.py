"""The long-format raw measurement CSV: one row per measurement (torch-free).

Columns: op, the op's shape columns (gemm: m, n, k, tp), dtype, block_size, time_s (median),
time_s_p20, time_s_p80, time_s_std, repeats, gpu, driver, torch, triton, timestamp, source.
Missing shape columns of other ops stay empty.
"""
from __future__ import annotations

import csv
from pathlib import Path

import pandas as pd

from sim.errors import KvsimError

COLUMNS = ("op", "m", "n", "k", "tp", "batch", "heads", "kv_heads", "head_dim", "context",
           "num_tokens", "bytes", "block_size", "num_splits", "pinned", "kind", "dtype", "time_s",
           "time_s_p20", "time_s_p80", "time_s_min", "time_s_max",
           "time_s_std", "repeats", "gpu", "driver", "torch", "triton", "timestamp", "source")
REQUIRED = ("op", "dtype", "time_s")
SHAPE_COLUMNS = {"gemm": ("m", "n", "k")}


class RawError(KvsimError):
    pass


def write_raw(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)


def read_raw(path: Path) -> pd.DataFrame:
    if not path.is_file():
        raise RawError(f"no such file '{path}', key raw, give a raw.csv written by calibration")
    try:
        frame = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise RawError(f"unreadable CSV ({str(exc).splitlines()[0]}), {path}, "
                       f"give a raw.csv written by calibration") from None
    missing = [c for c in REQUIRED if c not in frame.columns]
    if missing:
        raise RawError(f"missing column(s) {', '.join(missing)}, {path}:1, the header needs "
                       f"{', '.join(REQUIRED)} and the op's shape columns")
    for op, shape in SHAPE_COLUMNS.items():
        rows = frame[frame.op == op]
        for column in shape:
            if column not in frame.columns or rows[column].isna().any():
                raise RawError(f"{op} rows without '{column}', {path}, give m, n, k for every gemm row")
    bad = frame[~(pd.to_numeric(frame.time_s, errors="coerce") > 0)]
    if len(bad):
        line = int(bad.index[0]) + 2  # header is line 1
        raise RawError(f"time_s '{bad.time_s.iloc[0]}' is not a positive number, {path}:{line} "
                       f"field time_s, give seconds")
    return frame
