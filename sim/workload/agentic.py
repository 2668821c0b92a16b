"""kv-cache-tester agentic sessions (callanjfox/kv-cache-tester, Apache-2.0): one JSON file per
session (REFERENCE.md section 4). `block_size` 64; `requests[]` with `t` (s since the session
start), `type` (`n`, `s` = streaming, treated as `n`; `subagent` = a nested block with its own
`requests`, whose inner `t` restarts at 0 at the entry's `t`), `in`, `out`, `hash_ids` (local to
the session, full 64-token blocks only: len == in // 64), `api_time`, `think_time`;
`tool_tokens` and `system_tokens` give the shared preamble's length.

Each subagent becomes its own chain of the parent's session: it starts at its entry's `t` and
runs closed-loop, while the parent's chain goes on with its own think times (the trace's
think_time of the parent's next request already includes waiting for the subagent).
"""
from __future__ import annotations

import glob
import json
from dataclasses import replace
from pathlib import Path
from typing import Iterator

from sim.workload.records import TraceError, TraceFormat, TraceRequest, integer, number

FORMAT = TraceFormat("agentic", block_size=64, covers_partial_block=False, has_timestamps=True,
                     has_sessions=True)
REQUEST_TYPES = ("n", "s", "subagent")


def session_files(path_text: str) -> list[Path]:
    path = Path(path_text)
    if path.is_dir():
        files = sorted(path.glob("*.json"))
    elif any(ch in path_text for ch in "*?["):
        files = sorted(Path(p) for p in glob.glob(path_text))
    else:
        files = [path]
    if not files:
        raise TraceError("no session files found", path_text, None,
                         "give a session file, a directory of *.json files or a glob")
    return files


def load_session(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            text = handle.read()
    except OSError as exc:
        raise TraceError(f"cannot read the file ({exc.strerror})", str(path), None, "check trace.path") from None
    if not text.strip():
        raise TraceError("empty file", f"{path}:1", None, "a session file holds one JSON object")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"malformed JSON ({exc.msg})", f"{path}:{exc.lineno}", None,
                         "a session file holds one JSON object") from None
    if not isinstance(data, dict) or not isinstance(data.get("requests"), list):
        raise TraceError("no requests list", f"{path} requests", "requests",
                         "a session is an object with a 'requests' list")
    block = data.get("block_size", FORMAT.block_size)
    if block != FORMAT.block_size:
        raise TraceError(f"block_size {block}, not 64", f"{path} block_size", "block_size",
                         "kv-cache-tester sessions use 64-token blocks")
    return data


def preamble_blocks(data: dict, path: Path) -> int:
    tool = integer(data.get("tool_tokens", 0), f"{path} tool_tokens", "tool_tokens")
    system = integer(data.get("system_tokens", 0), f"{path} system_tokens", "system_tokens")
    return (tool + system) // FORMAT.block_size


def session_requests(data: dict, path: Path, session_key) -> Iterator[TraceRequest]:
    """The session's requests, main chain first, then each subagent chain, in trace order."""
    chains = [0]

    def walk(requests: list, offset_s: float, chain: int, prefix: str) -> Iterator[TraceRequest]:
        previous_t = None
        for index, item in enumerate(requests):
            where = f"{path} {prefix}[{index}]"
            if not isinstance(item, dict):
                raise TraceError("request is not a JSON object", where, None, "fix the session file")
            kind = item.get("type", "n")
            if kind not in REQUEST_TYPES:
                raise TraceError(f"unknown request type '{kind}'", f"{where}.type", "type",
                                 f"use one of {', '.join(REQUEST_TYPES)}")
            if "t" not in item:
                raise TraceError("missing field 't'", f"{where}.t", "t", "give seconds since the session start")
            t = number(item["t"], f"{where}.t", "t")
            if previous_t is not None and t < previous_t:
                raise TraceError(f"t {t} is before the previous request's {previous_t}", f"{where}.t", "t",
                                 "order requests by t, or set trace.sort=true")
            previous_t = t
            if kind == "subagent":
                if not isinstance(item.get("requests"), list):
                    raise TraceError("subagent without a requests list", f"{where}.requests", "requests",
                                     "a subagent entry holds its own 'requests'")
                chains.append(len(chains))
                yield from walk(item["requests"], offset_s + t, chains[-1], f"{prefix}[{index}].requests")
                continue
            for field in ("in", "out", "hash_ids"):
                if field not in item:
                    raise TraceError(f"missing field '{field}'", f"{where}.{field}", field,
                                     "each request needs t, in, out and hash_ids")
            input_len = integer(item["in"], f"{where}.in", "in", minimum=1)
            hash_ids = item["hash_ids"]
            if not isinstance(hash_ids, list) or len(hash_ids) != input_len // FORMAT.block_size:
                count = len(hash_ids) if isinstance(hash_ids, list) else "no list of"
                raise TraceError(f"{count} hash ids for in={input_len} (full 64-token blocks need "
                                 f"{input_len // FORMAT.block_size})", f"{where}.hash_ids", "hash_ids",
                                 "give one id per full 64-token block")
            yield TraceRequest(
                arrival_s=offset_s + t, input_len=input_len,
                output_len=integer(item["out"], f"{where}.out", "out", minimum=1),
                hash_ids=tuple((session_key, h) for h in hash_ids),
                think_time_s=number(item.get("think_time", 0.0), f"{where}.think_time", "think_time"),
                session=session_key, chain=chain, where=where)

    yield from walk(data["requests"], 0.0, 0, "requests")


def records(path_text: str, share_preamble: bool = False) -> Iterator[TraceRequest | TraceError]:
    for path in session_files(path_text):
        try:
            data = load_session(path)
            shared = preamble_blocks(data, path) if share_preamble else 0
            for request in session_requests(data, path, str(path)):
                if shared and request.chain == 0:  # subagents have preambles of their own
                    ids = list(request.hash_ids)
                    ids[:shared] = [("preamble", i) for i in range(min(shared, len(ids)))]
                    request = replace(request, hash_ids=tuple(ids))
                yield request
        except TraceError as error:
            yield error


def write(sessions: list[list[TraceRequest]], folder: Path, tool_tokens: int = 0, system_tokens: int = 0) -> None:
    """One file per session; main-chain requests only (what the round-trip tests generate)."""
    folder.mkdir(parents=True, exist_ok=True)
    for index, session in enumerate(sessions):
        body = {"id": f"trace_{index:04d}", "block_size": 64, "hash_id_scope": "local",
                "tool_tokens": tool_tokens, "system_tokens": system_tokens,
                "requests": [{"t": r.arrival_s, "type": "n", "in": r.input_len, "out": r.output_len,
                              "hash_ids": [h[1] if isinstance(h, tuple) else h for h in r.hash_ids],
                              "api_time": 0.0, "think_time": r.think_time_s} for r in session]}
        (folder / f"trace_{index:04d}.json").write_text(json.dumps(body))
