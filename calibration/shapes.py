"""The shapes CSV `python -m calibration predict` reads: one row per operator call, its `op` and
that operator's shape columns (calibration.ops.OPS). Every cell is kept as written (the output is
the input with `time_s` added). A row whose shape no GPU runs (a count below its least or not whole,
an all-reduce over fewer than two GPUs, query heads that are no multiple of the KV heads) or that
the file cannot hold (values for more or fewer columns than the header) is refused in one line
naming its line; columns that none of the file's operators reads are named, since a misspelt
optional column (`batch` for `batch_size`) would otherwise fall back to its default without a word.

Sizes the work models read as amounts may be fractional, as the simulator's own are (a pipeline's
micro-batch of 3.5 sequences, a GEMM over 3.5 tokens a rank): `bytes`, a GEMM's `m`, the host
steps' `batch_size`. Every other count is whole."""
from __future__ import annotations

import csv
from pathlib import Path

import pandas as pd

from calibration.ops import OPS
from calibration.raw import RawError

TEXT_COLUMNS = frozenset({"dtype", "kind"})             # shape columns that are names, not counts
FLAGS = frozenset({"pinned"})                           # true or false, as the benchmark writes it
OPTIONAL = {"attention_prefill": ("batch_size",)}       # read where given (sim.latency.operators._prefill)
AT_LEAST = {"context_len": 0, "context": 0}             # counts that may be zero (no cached tokens)
COLLECTIVES = frozenset({"all_reduce", "all_to_all"})   # need two GPUs or more
AMOUNTS = {"bytes": None, "m": ("gemm",), "batch_size": ("cpu_step", "cpu_output")}  # None: every op
HEAD_PAIRS = (("num_q_heads", "num_kv_heads"), ("heads", "kv_heads"))


def read_shapes(path: Path) -> tuple[pd.DataFrame, list[int]]:
    """The CSV as text (no column retyped) and each row's line in the file, with its op column,
    op names and row lengths checked."""
    if not path.is_file():
        raise RawError(f"no such file '{path}', key shapes, give a CSV with column op and its shape columns")
    header, rows, lines = None, [], []
    try:
        with open(path, newline="", encoding="utf-8-sig") as handle:
            reader = csv.reader(handle)
            for row in reader:
                if not any(cell.strip() for cell in row):
                    continue
                if header is None:
                    header = [name.strip() for name in row]
                elif len(row) != len(header):
                    raise RawError(f"{len(row)} values for {len(header)} columns, {path}:{reader.line_num}, "
                                   f"give one value per header column")
                else:
                    rows.append(row)
                    lines.append(reader.line_num)
    except UnicodeDecodeError:
        raise RawError(f"'{path}' is not UTF-8 text, key shapes, give a CSV file") from None
    if header is None:
        raise RawError(f"empty file, {path}, key shapes, give a CSV whose header has column op and its shape columns")
    if "op" not in header:
        raise RawError(f"missing column op, {path}:1, give a CSV with column op and its shape columns")
    if not rows:
        raise RawError(f"no rows under the header, {path}, give one row per operator call")
    shapes = pd.DataFrame(rows, columns=header, dtype=str)
    unknown = sorted(set(shapes.op) - set(OPS))
    if unknown:
        raise RawError(f"unknown op(s) {', '.join(unknown)}, {path} column op, use {', '.join(OPS)}")
    return shapes, lines


def unread_columns(shapes: pd.DataFrame) -> list[str]:
    """Columns that none of the file's operators reads (kept in the output as they are)."""
    read = {"op", "time_s"}.union(*(OPS[op].columns + OPTIONAL.get(op, ()) for op in set(shapes.op)))
    return [c for c in shapes.columns if c not in read]


def op_rows(shapes: pd.DataFrame, lines: list[int], op: str, index, path: Path) -> pd.DataFrame:
    """One op's rows with their shape columns as numbers (flags as booleans), after checking that
    each is a real shape."""
    needed = OPS[op].columns
    rows = shapes.iloc[index]
    missing = [c for c in needed if c not in rows or (rows[c].str.strip() == "").any()]
    if missing:
        raise RawError(f"op={op} rows need column(s) {', '.join(missing)}, {path}, "
                       f"give {op} rows {', '.join(needed)}")
    where = [f"{path}:{lines[i]}" for i in index]
    typed = rows.copy()
    converted = [c for c in (*needed, *OPTIONAL.get(op, ())) if c in rows and c not in TEXT_COLUMNS]
    for column in converted:
        read = _flag if column in FLAGS else _number
        typed[column] = [read(text, column, op, at) for text, at in zip(rows[column], where)]
    for queries, kv in HEAD_PAIRS:
        if queries in converted and kv in converted:
            bad = [(q, k, at) for q, k, at in zip(typed[queries], typed[kv], where) if q % k]
            if bad:
                q, k, at = bad[0]
                raise RawError(f"op={op}: {queries}={q} is no multiple of {kv}={k}, {at}, "
                               f"give query heads a multiple of the KV heads (GQA groups)")
    return typed


def _flag(text: str, column: str, op: str, where: str) -> bool:
    word = text.strip().lower()
    if word not in ("true", "false", "1", "0"):
        raise RawError(f"op={op}: {column}={text!r} is not true or false, {where}, give {column} true or false")
    return word in ("true", "1")


def _number(text: str, column: str, op: str, where: str):
    """A cell of a count column as an int (of an amount, a float above zero), or None where an
    optional column's cell is empty."""
    text = text.strip()
    if text == "" and column in OPTIONAL.get(op, ()):
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if column in AMOUNTS and (AMOUNTS[column] is None or op in AMOUNTS[column]):
        if not 0 < value < float("inf"):
            raise RawError(f"op={op}: {column}={text!r} is not a number above 0, {where}, "
                           f"give {column} a positive number")
        return value
    least = 2 if column == "num_gpus" and op in COLLECTIVES else AT_LEAST.get(column, 1)
    if not value.is_integer() or value < least:
        why = " (a collective needs two GPUs or more)" if least == 2 else ""
        raise RawError(f"op={op}: {column}={text!r} is not a whole number of at least {least}{why}, "
                       f"{where}, give {column} a whole number >= {least}")
    return int(value)
