"""BurstGPT (HPMLL/BurstGPT), CSV: `Timestamp` (s from the trace start), `Model`,
`Request tokens`, `Response tokens`, `Total tokens`, `Log Type`. Rows with zero response tokens
are failed requests: skipped, and counted (REFERENCE.md section 4)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

from sim.workload.csv_rows import rows
from sim.workload.records import TraceError, TraceFormat, TraceRequest, integer, number

FORMAT = TraceFormat("burstgpt", block_size=0, covers_partial_block=False, has_timestamps=True,
                     has_sessions=False)
COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")


class FailedRequest:
    """A row the trace itself marks as a failed request (zero response tokens)."""
    __slots__ = ("where",)

    def __init__(self, where: str):
        self.where = where


def records(path: Path) -> Iterator[TraceRequest | TraceError | FailedRequest]:
    for where, row in rows(path, COLUMNS):
        try:
            response = integer(row["Response tokens"], where, "Response tokens")
            request = TraceRequest(arrival_s=number(row["Timestamp"], where, "Timestamp"),
                                   input_len=integer(row["Request tokens"], where, "Request tokens", minimum=1),
                                   output_len=max(response, 1), where=where)
            yield FailedRequest(where) if response == 0 else request
        except TraceError as error:
            yield error


def write(requests, path: Path, failed_rows: int = 0) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(",".join(COLUMNS) + "\n")
        for r in requests:
            handle.write(f"{r.arrival_s},ChatGPT,{r.input_len},{r.output_len},"
                         f"{r.input_len + r.output_len},Conversation log\n")
        for i in range(failed_rows):
            handle.write(f"{i},GPT-4,10,0,10,Conversation log\n")
