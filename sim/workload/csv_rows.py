"""Streaming CSV rows with 1-based line numbers (the header is line 1) and checked columns."""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Iterator

from sim.workload.records import TraceError


def rows(path: Path, required: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    with open(path, newline="", encoding="utf-8", errors="replace") as handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if header is None:
            raise TraceError("empty file", f"{path}:1", None, "the first line must be the CSV header")
        header = [name.strip() for name in header]
        missing = [name for name in required if name not in header]
        if missing:
            raise TraceError(f"missing column(s) {', '.join(missing)} (found {', '.join(header)})",
                             f"{path}:1", missing[0], f"the header needs {', '.join(required)}")
        index = {name: header.index(name) for name in required}
        for row in reader:
            where = f"{path}:{reader.line_num}"
            if not row or not any(cell.strip() for cell in row):
                continue
            if len(row) < len(header):
                yield where, ShortRow(TraceError(f"{len(row)} values for {len(header)} columns", where, None,
                                                 "give one value per header column"))
                continue
            yield where, {name: row[i] for name, i in index.items()}


class ShortRow(dict):
    """A row with fewer values than the header has columns: reading any field raises its error,
    which the readers yield as a malformed record like any other (trace.on_error raise or skip)."""

    def __init__(self, error: TraceError):
        super().__init__()
        self.error = error

    def __getitem__(self, name):
        raise self.error
