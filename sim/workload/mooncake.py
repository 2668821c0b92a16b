"""Mooncake traces (kvcache-ai/Mooncake, Apache-2.0), JSON lines (REFERENCE.md section 4):
`timestamp` (ms), `input_length`, `output_length`, `hash_ids` (one per 512-token block, the last
covering the partial last block too; an id identifies the whole prefix through its block)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from sim.workload.records import TraceError, TraceFormat, TraceRequest, integer, number

FORMAT = TraceFormat("mooncake", block_size=512, covers_partial_block=True, has_timestamps=True,
                     has_sessions=False)
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def parse_line(text: str, where: str) -> TraceRequest:
    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"malformed JSON ({exc.msg})", where, None, "one JSON object per line") from None
    if not isinstance(row, dict):
        raise TraceError("line is not a JSON object", where, None, "one JSON object per line")
    for field in FIELDS:
        if field not in row:
            raise TraceError(f"missing field '{field}'", where, field,
                             f"each line needs {', '.join(FIELDS)}")
    input_len = integer(row["input_length"], where, "input_length", minimum=1)
    hash_ids = row["hash_ids"]
    if not isinstance(hash_ids, list):
        raise TraceError("hash_ids is not a list", where, "hash_ids", "write a JSON list of ids")
    expected = -(-input_len // FORMAT.block_size)
    if len(hash_ids) != expected:
        raise TraceError(f"{len(hash_ids)} hash ids for input_length {input_len} (512-token blocks "
                         f"need {expected})", where, "hash_ids",
                         "give one id per 512-token block, the partial last block included")
    return TraceRequest(
        arrival_s=number(row["timestamp"], where, "timestamp") / 1000.0, input_len=input_len,
        output_len=integer(row["output_length"], where, "output_length", minimum=1),
        hash_ids=tuple(hash_ids), where=where)


def read(path: Path) -> Iterator[tuple[str, str]]:
    """(location, text) per non-empty line, streamed."""
    with open(path, encoding="utf-8", errors="replace") as handle:  # bad bytes fail as JSON
        for number_, line in enumerate(handle, start=1):
            if line.strip():
                yield f"{path}:{number_}", line


def records(path: Path) -> Iterator[TraceRequest | TraceError]:
    for where, text in read(path):
        try:
            yield parse_line(text, where)
        except TraceError as error:
            yield error


def write(requests, path: Path) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for r in requests:
            handle.write(json.dumps({"timestamp": round(r.arrival_s * 1000), "input_length": r.input_len,
                                     "output_length": r.output_len, "hash_ids": list(r.hash_ids)}) + "\n")
