"""The shapes CSV `python -m calibration predict` reads: one row per operator call, its `op` and
that operator's shape columns (calibration.ops.OPS). Every cell is kept as written (the output is
the input with `time_s` added); a row whose shape is not a real one (a negative or fractional count,
an all-reduce over fewer than two GPUs, query heads that are no multiple of the KV heads) is refused
in one line, and columns that no operator reads are named, since a misspelt optional column (`batch`
for `batch_size`) would otherwise fall back to its default without a word."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from calibration.ops import OPS
from calibration.raw import RawError

TEXT_COLUMNS = frozenset({"dtype", "kind", "pinned"})  # the shape columns that are not counts
OPTIONAL = {"attention_prefill": ("batch_size",)}       # read where given (sim.latency.operators._prefill)
AT_LEAST = {"context_len": 0, "context": 0}             # counts that may be zero (no cached tokens)
AMOUNTS = frozenset({"bytes"})  # above zero, not whole: the simulator's all-to-all volumes are expected values
COLLECTIVES = frozenset({"all_reduce", "all_to_all"})   # need two GPUs or more
HEAD_PAIRS = (("num_q_heads", "num_kv_heads"), ("heads", "kv_heads"))


def read_shapes(path: Path) -> pd.DataFrame:
    """The CSV as text (no column retyped), with its op column and op names checked."""
    if not path.is_file():
        raise RawError(f"no such file '{path}', key shapes, give a CSV with column op and its shape columns")
    shapes = pd.read_csv(path, dtype=str, keep_default_na=False)
    if "op" not in shapes:
        raise RawError(f"missing column op, {path}:1, give a CSV with column op and its shape columns")
    unknown = sorted(set(shapes.op) - set(OPS))
    if unknown:
        raise RawError(f"unknown op(s) {', '.join(unknown)}, {path} column op, use {', '.join(OPS)}")
    return shapes


def unread_columns(shapes: pd.DataFrame) -> list[str]:
    """Columns that none of the file's operators reads (kept in the output as they are)."""
    ops = set(shapes.op)
    read = {"op", "time_s"}.union(*(OPS[op].columns + OPTIONAL.get(op, ()) for op in ops))
    return [c for c in shapes.columns if c not in read]


def op_rows(shapes: pd.DataFrame, op: str, index, path: Path) -> pd.DataFrame:
    """One op's rows with their shape columns as numbers, after checking that each is a real shape."""
    needed = OPS[op].columns
    rows = shapes.iloc[index]
    missing = [c for c in needed if c not in rows or (rows[c].str.strip() == "").any()]
    if missing:
        raise RawError(f"op={op} rows need column(s) {', '.join(missing)}, {path}, "
                       f"give {op} rows {', '.join(needed)}")
    counts = [c for c in (*needed, *OPTIONAL.get(op, ())) if c in rows and c not in TEXT_COLUMNS]
    typed = rows.copy()
    for column in counts:
        least = 2 if column == "num_gpus" and op in COLLECTIVES else AT_LEAST.get(column, 1)
        typed[column] = [_number(text, column, least, op, path, line) for text, line in
                         zip(rows[column], rows.index + 2)]
    for queries, kv in HEAD_PAIRS:
        if queries in counts and kv in counts:
            bad = typed[typed[queries] % typed[kv] != 0]
            if len(bad):
                line = bad.index[0] + 2
                raise RawError(f"op={op}: {queries}={bad[queries].iloc[0]} is no multiple of {kv}={bad[kv].iloc[0]}, "
                               f"{path}:{line}, give query heads a multiple of the KV heads (GQA groups)")
    return typed


def _number(text: str, column: str, least: int, op: str, path: Path, line: int):
    """A cell of a count column as an int (of an amount, a float above zero), or None where an
    optional column's cell is empty."""
    text = text.strip()
    if text == "" and column in OPTIONAL.get(op, ()):
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if column in AMOUNTS:
        if not value > 0 or value == float("inf"):
            raise RawError(f"op={op}: {column}={text!r} is not a number above 0, {path}:{line}, "
                           f"give {column} a positive number")
        return value
    if not value.is_integer() or value < least:
        why = " (a collective needs two GPUs or more)" if column == "num_gpus" and least == 2 else ""
        raise RawError(f"op={op}: {column}={text!r} is not a whole number of at least {least}{why}, "
                       f"{path}:{line}, give {column} a whole number >= {least}")
    return int(value)
