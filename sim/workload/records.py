"""What every trace reader yields, and the one-line errors it raises.

A reader streams `TraceRequest`s from a file (one parsed line or session at a time). Hash ids are
the trace's own opaque block ids, already namespaced where the format scopes them (agentic ids
are per session), at the trace's own block size.
"""
from __future__ import annotations

from dataclasses import dataclass

from sim.errors import KvsimError


class TraceError(KvsimError):
    """A malformed trace record: `<what>, <file>:<line> field <name>, <fix>`."""

    def __init__(self, what: str, where: str, field: str | None, fix: str):
        place = f"{where} field {field}" if field else where
        # Values quoted from the file may hold line breaks; the message stays one line.
        message = f"{what}, {place}, {fix}".replace("\r", "\\r").replace("\n", "\\n")
        super().__init__(message)
        self.where = where


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float            # recorded arrival (agentic: relative to its session's start)
    input_len: int
    output_len: int
    hash_ids: tuple = ()        # prefix block ids at the trace's block size
    think_time_s: float = 0.0   # closed-loop delay after the previous request of its chain
    session: object = None      # session key; None: an independent request
    chain: int = 0              # 0: the session's main agent; k: its k-th subagent
    where: str = ""             # "file:line" or "file requests[3]", for messages


@dataclass(frozen=True, slots=True)
class TraceFormat:
    """A format's block granularity and how its hash ids cover a prompt."""
    name: str
    block_size: int             # 0: no prefix information
    covers_partial_block: bool  # Mooncake: the last id covers the partial last block too
    has_timestamps: bool
    has_sessions: bool


def integer(value, where: str, field: str, *, minimum: int = 0) -> int:
    """A non-negative (or >= minimum) integer, accepting 12 and "12" but not 1.5 or -3."""
    if isinstance(value, bool):
        raise TraceError(f"{field} is {value!r}, not an integer", where, field, "write a whole number")
    if isinstance(value, str):
        text = value.strip()
        if not text.lstrip("-").isdigit():
            raise TraceError(f"{field} is '{value}', not an integer", where, field, "write a whole number")
        value = int(text)
    if isinstance(value, float):
        if not value.is_integer():
            raise TraceError(f"{field} is {value}, not an integer", where, field, "write a whole number")
        value = int(value)
    if not isinstance(value, int):
        raise TraceError(f"{field} is {value!r}, not an integer", where, field, "write a whole number")
    if value < minimum:
        raise TraceError(f"{field} is {value}, below {minimum}", where, field,
                         f"lengths and counts must be at least {minimum}")
    return value


def number(value, where: str, field: str, *, minimum: float | None = 0.0) -> float:
    try:
        result = float(value)
    except (TypeError, ValueError):
        raise TraceError(f"{field} is {value!r}, not a number", where, field, "write a number") from None
    if result != result or result in (float("inf"), float("-inf")):
        raise TraceError(f"{field} is {value!r}, not a finite number", where, field, "write a number")
    if minimum is not None and result < minimum:
        raise TraceError(f"{field} is {result}, below {minimum}", where, field, "write a non-negative number")
    return result
