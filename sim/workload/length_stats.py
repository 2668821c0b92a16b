"""Request-length statistics (Vidur / Sarathi-Serve / Etalon), CSV: `num_prefill_tokens`,
`num_decode_tokens`, ... (ShareGPT4, arXiv summarisation, BWB). No timestamps, no prefixes: the
trace scenario gives them an arrival process."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

from sim.workload.csv_rows import rows
from sim.workload.records import TraceError, TraceFormat, TraceRequest, integer

FORMAT = TraceFormat("length_stats", block_size=0, covers_partial_block=False, has_timestamps=False,
                     has_sessions=False)
COLUMNS = ("num_prefill_tokens", "num_decode_tokens")


def records(path: Path) -> Iterator[TraceRequest | TraceError]:
    for where, row in rows(path, COLUMNS):
        try:
            yield TraceRequest(arrival_s=0.0,
                               input_len=integer(row["num_prefill_tokens"], where, "num_prefill_tokens", minimum=1),
                               output_len=integer(row["num_decode_tokens"], where, "num_decode_tokens", minimum=1),
                               where=where)
        except TraceError as error:
            yield error


def write(requests, path: Path) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n")
        for r in requests:
            handle.write(f"{r.input_len},{r.output_len},{r.input_len + r.output_len},"
                         f"{r.input_len / r.output_len}\n")
