"""Azure LLM inference trace 2023 (Azure/AzurePublicDataset, CC-BY-4.0; Patel et al., Splitwise,
ISCA 2024), CSV: `TIMESTAMP` (wall clock, 7 fractional digits), `ContextTokens`,
`GeneratedTokens`. No prefix information."""
from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Iterator

from sim.workload.csv_rows import rows
from sim.workload.records import TraceError, TraceFormat, TraceRequest, integer

FORMAT = TraceFormat("azure", block_size=0, covers_partial_block=False, has_timestamps=True,
                     has_sessions=False)
COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def parse_timestamp(text: str, where: str) -> tuple[int, float]:
    """(whole seconds since the epoch, fraction) of `YYYY-MM-DD HH:MM:SS[.fffffff]`: more digits
    than datetime takes, kept apart so that differences stay exact to 100 ns."""
    stamp = text.strip()
    whole, _, fraction = stamp.partition(".")
    try:
        seconds = int(datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").timestamp())
    except ValueError:
        raise TraceError(f"TIMESTAMP '{text}' is not YYYY-MM-DD HH:MM:SS.fffffff", where, "TIMESTAMP",
                         "write timestamps like 2023-11-16 18:17:03.9799600") from None
    if fraction and not fraction.isdigit():
        raise TraceError(f"TIMESTAMP '{text}' has a malformed fraction", where, "TIMESTAMP",
                         "write timestamps like 2023-11-16 18:17:03.9799600")
    return seconds, (int(fraction) / 10 ** len(fraction) if fraction else 0.0)


def records(path: Path) -> Iterator[TraceRequest | TraceError]:
    first = None
    for where, row in rows(path, COLUMNS):
        try:
            seconds, fraction = parse_timestamp(row["TIMESTAMP"], where)
            first = (seconds, fraction) if first is None else first
            yield TraceRequest(arrival_s=(seconds - first[0]) + (fraction - first[1]),
                               input_len=integer(row["ContextTokens"], where, "ContextTokens", minimum=1),
                               output_len=integer(row["GeneratedTokens"], where, "GeneratedTokens", minimum=1),
                               where=where)
        except TraceError as error:
            yield error


def write(requests, path: Path, start: str = "2023-11-16 18:00:00") -> None:
    base = datetime.strptime(start, "%Y-%m-%d %H:%M:%S").timestamp()
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(",".join(COLUMNS) + "\n")
        for r in requests:
            moment = base + r.arrival_s
            whole = datetime.fromtimestamp(int(moment)).strftime("%Y-%m-%d %H:%M:%S")
            fraction = round((moment - int(moment)) * 10**7)
            handle.write(f"{whole}.{fraction:07d},{r.input_len},{r.output_len}\n")
