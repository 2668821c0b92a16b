"""scenario=trace: replay a trace file through the simulator.

Readers (one module per format) stream `TraceRequest`s; this module checks order, applies the
`trace.*` selection keys, gives untimed traces an arrival process, maps the trace's hash ids onto
prompt segments and builds the Workload.

Hash granularity: each trace block becomes one segment whose content id is its (namespaced)
hash id, so the simulated prefix key of any token position (sim.workload.request) is equal
exactly when the trace prefixes are, at every simulated block size; the engines then cache only
the simulated blocks that are full. Mooncake's last id covers the partial last block; agentic ids
cover full 64-token blocks only, and the remainder of the prompt is unique to its request.
"""
from __future__ import annotations

import glob
import logging
import math
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

import numpy as np

from sim.errors import ConfigError
from sim.workload import agentic, azure, burstgpt, length_stats, mooncake
from sim.workload.records import TraceError, TraceFormat, TraceRequest
from sim.workload.request import CopyShift, PrefixInterner, RepeatedSessions, Session, Workload, make_request

log = logging.getLogger(__name__)
READERS = {"mooncake": mooncake, "azure": azure, "agentic": agentic, "burstgpt": burstgpt,
           "length_stats": length_stats}
FORMATS = ("auto", *READERS)
SAMPLES = {"mooncake": "mooncake_conversation.jsonl", "azure": "azure_code.csv", "azure_conv": "azure_conv.csv",
           "agentic": "agentic", "sharegpt": "sharegpt_length_stats.csv",
           "sharegpt_v3": "sharegpt_v3_vllm_seed0.csv"}


@dataclass(frozen=True, slots=True)
class TraceSpec:
    path: str | None = None
    format: str = "auto"
    max_requests: int | None = None
    start_s: float | None = None
    end_s: float | None = None
    time_scale: float = 1.0
    target_rate_rps: float | None = None
    repeat: int = 1
    sort: bool = False
    on_error: str = "raise"
    timing: str = "closed"
    share_preamble: bool = False
    arrival_process: str = "poisson"
    arrival_rate_rps: float = 1.0
    on_overlength: str = "reject"  # applied by the run (sim.workload.overlength), not the reader
    arrivals: str = "recorded"     # recorded: the trace's timestamps; process: trace.arrival_process
    max_total_tokens: int | None = None  # clip prompt + output as Vidur's max_tokens does

    def __post_init__(self):
        checks = [
            (self.path is not None, "trace.path is not set", "trace.path",
             "give a trace file, e.g. trace.path=sample:mooncake"),
            (self.format in FORMATS, f"unknown trace format '{self.format}'", "trace.format",
             f"use one of: {', '.join(FORMATS)}"),
            (self.on_error in ("raise", "skip"), f"unknown trace.on_error '{self.on_error}'",
             "trace.on_error", "use raise or skip"),
            (self.timing in ("closed", "open"), f"unknown trace.timing '{self.timing}'",
             "trace.timing", "use closed or open"),
            (self.arrival_process in ("poisson", "constant"),
             f"unknown trace.arrival_process '{self.arrival_process}'", "trace.arrival_process",
             "use poisson or constant"),
            (self.time_scale > 0 and self.arrival_rate_rps > 0 and self.repeat >= 1,
             "trace.time_scale and trace.arrival_rate_rps must be > 0, trace.repeat >= 1",
             "trace.time_scale", "fix the values"),
            (self.target_rate_rps is None or self.target_rate_rps > 0,
             "trace.target_rate_rps must be > 0", "trace.target_rate_rps", "give a positive rate or null"),
            (self.max_requests is None or self.max_requests >= 1, "trace.max_requests must be >= 1",
             "trace.max_requests", "give a positive count or null"),
            (self.arrivals in ("recorded", "process"), f"unknown trace.arrivals '{self.arrivals}'",
             "trace.arrivals", "use recorded or process"),
            (self.max_total_tokens is None or self.max_total_tokens >= 2,
             "trace.max_total_tokens must be >= 2", "trace.max_total_tokens", "give a token count or null"),
        ]
        for ok, what, key, fix in checks:
            if not ok:
                raise ConfigError(f"{what}, key {key}, {fix}")

    def generate(self, seed: int) -> Workload:
        return build_workload(self, seed)


def trace_scenario(trace: dict) -> TraceSpec:
    """The `scenario=trace` entry: its settings are the top-level `trace.*` keys."""
    return TraceSpec(**trace)


def resolve_path(path_text: str) -> str:
    if path_text.startswith("sample:"):
        name = path_text.removeprefix("sample:")
        if name not in SAMPLES:
            raise ConfigError(f"unknown sample '{name}', key trace.path, use one of: "
                              + ", ".join(f"sample:{n}" for n in SAMPLES))
        return str(resources.files("sim.workload") / "samples" / SAMPLES[name])
    return path_text


TRACE_SUFFIXES = (".json", ".jsonl", ".csv")  # what a directory or glob is searched for


def _is_glob(path_text: str) -> bool:
    return any(ch in path_text for ch in "*?[")


def detect_format(path_text: str) -> str:
    """The format of a file, or of the first file of a directory or glob (only agentic sessions
    come as many files, so anything else found there is an error naming it)."""
    path = Path(path_text)
    if path.is_dir() or _is_glob(path_text):
        found = path.iterdir() if path.is_dir() else map(Path, glob.glob(path_text))
        files = sorted(p for p in found if p.is_file() and p.suffix in TRACE_SUFFIXES)
        if not files:
            what = (f"no trace files ({', '.join('*' + s for s in TRACE_SUFFIXES)}) in the directory"
                    if path.is_dir() else "a glob that matches no trace file")
            raise TraceError(what, path_text, None, "check trace.path")
        found = detect_format(str(files[0]))
        if found != "agentic":
            raise TraceError(f"{files[0].name} is a {found} trace, and only agentic sessions come "
                             f"as many files", path_text, None, "give trace.path one file")
        return found
    if not path.is_file():
        raise TraceError("no such file", path_text, None, "check trace.path")
    with open(path, encoding="utf-8", errors="replace") as handle:
        head = handle.read(4096)
    first = next((line.strip() for line in head.splitlines() if line.strip()), "")
    if not first:
        raise TraceError("empty file", f"{path_text}:1", None, "give a non-empty trace")
    if first.startswith("{") and '"hash_ids"' in first and '"timestamp"' in first:
        return "mooncake"
    if first.startswith("{") and '"requests"' in head:
        return "agentic"
    header = {name.strip() for name in first.split(",")}
    for name, reader in (("azure", azure), ("burstgpt", burstgpt), ("length_stats", length_stats)):
        if set(reader.COLUMNS) <= header:
            return name
    raise TraceError("unrecognised trace format", f"{path_text}:1", None,
                     f"set trace.format to one of: {', '.join(READERS)}")


def read_requests(spec: TraceSpec) -> tuple[TraceFormat, list[TraceRequest], int, int]:
    """The trace's valid requests (in order, at most max_requests), skipped and failed counts."""
    path = resolve_path(spec.path)
    name = spec.format
    if name == "auto":
        name = detect_format(path)
        log.debug("trace: format auto -> %s (%s)", name, path)
    elif name != "agentic":
        if Path(path).is_dir():
            raise TraceError("a directory", path, None, "give a file (only trace.format=agentic reads a directory)")
        if not Path(path).is_file():
            raise TraceError("no such file", path, None, "check trace.path")
    reader = READERS[name]
    stream = (reader.records(path, spec.share_preamble) if name == "agentic" else reader.records(Path(path)))
    kept: list[TraceRequest] = []
    skipped = failed = 0
    last_arrival: dict = {}
    for item in stream:
        if isinstance(item, TraceError):
            if spec.on_error == "raise":
                raise item
            skipped += 1
            if skipped == 1:
                log.warning("trace: skipping malformed records (first: %s)", item)
            continue
        if isinstance(item, burstgpt.FailedRequest):
            failed += 1
            continue
        order_key = (item.session, item.chain)
        if not spec.sort and reader.FORMAT.has_timestamps and item.arrival_s < last_arrival.get(order_key, -math.inf):
            raise TraceError(f"timestamp {item.arrival_s:g} s is before the previous request's "
                             f"{last_arrival[order_key]:g} s", item.where, "timestamp",
                             "sort the trace or set trace.sort=true")
        last_arrival[order_key] = item.arrival_s
        kept.append(item)
        if spec.max_requests is not None and len(kept) >= spec.max_requests and not spec.sort:
            break
    if not kept:
        raise TraceError("no requests", path, None,
                         "the trace is empty or every record was skipped or failed")
    if spec.max_requests is not None and len(kept) < spec.max_requests:
        log.warning("trace: max_requests=%d but %s holds %d valid requests; running %d",
                    spec.max_requests, path, len(kept), len(kept))
    return reader.FORMAT, kept, skipped, failed


def _arrivals(spec: TraceSpec, count: int, seed: int) -> np.ndarray:
    if spec.arrival_process == "constant":
        return np.arange(count) / spec.arrival_rate_rps
    rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(1)[0])
    return np.concatenate([[0.0], np.cumsum(rng.exponential(1.0 / spec.arrival_rate_rps, count - 1))])


def check_keys_apply(spec: TraceSpec, fmt: TraceFormat) -> None:
    """A trace.* key that this format does not read is an error, not silently ignored."""
    default = TraceSpec(path=spec.path)
    untimed = not fmt.has_timestamps or fmt.has_sessions or spec.arrivals == "process"
    unread = [
        ("trace.arrivals", spec.arrivals != default.arrivals and (fmt.has_sessions or not fmt.has_timestamps),
         f"{fmt.name} arrivals (or session starts) always come from trace.arrival_process"),
        ("trace.share_preamble", spec.share_preamble != default.share_preamble and fmt.name != "agentic",
         "only agentic sessions have a preamble"),
        ("trace.timing", spec.timing != default.timing and not fmt.has_sessions,
         f"{fmt.name} requests are independent (no closed loop)"),
        ("trace.arrival_process", spec.arrival_process != default.arrival_process and not untimed,
         f"{fmt.name} records its own arrival times"),
        ("trace.arrival_rate_rps", spec.arrival_rate_rps != default.arrival_rate_rps and not untimed,
         f"{fmt.name} records its own arrival times (trace.target_rate_rps rescales them)"),
    ]
    for key, unused, why in unread:
        if unused:
            raise ConfigError(f"{key} does not apply to this trace: {why}, key {key}, drop it")


def clip_total(request: TraceRequest, max_tokens: int, fmt: TraceFormat) -> TraceRequest:
    """Prompt + output at most max_tokens, the excess taken from both in proportion (rounded
    up), at least one token each: Vidur's TraceRequestLengthGenerator (microsoft/vidur)."""
    total = request.input_len + request.output_len
    excess = max(0, total - max_tokens)
    if not excess:
        return request
    prompt = max(1, request.input_len - math.ceil(excess * request.input_len / total))
    output = max(1, request.output_len - math.ceil(excess * request.output_len / total))
    hash_ids = request.hash_ids
    if hash_ids and fmt.block_size:  # keep the ids of the blocks the shorter prompt still has
        blocks = -(-prompt // fmt.block_size) if fmt.covers_partial_block else prompt // fmt.block_size
        hash_ids = hash_ids[:blocks]
    return replace(request, input_len=prompt, output_len=output, hash_ids=hash_ids)


def timed_requests(spec: TraceSpec, fmt: TraceFormat, requests: list[TraceRequest],
                   seed: int) -> list[TraceRequest]:
    """Absolute arrivals after the arrival process, window, scaling and target rate."""
    check_keys_apply(spec, fmt)
    if fmt.has_sessions:
        sessions = list(dict.fromkeys(r.session for r in requests))
        starts = dict(zip(sessions, _arrivals(spec, len(sessions), seed)))
        requests = [replace(r, arrival_s=starts[r.session] + r.arrival_s) for r in requests]
    elif not fmt.has_timestamps or spec.arrivals == "process":
        requests = [replace(r, arrival_s=t) for r, t in zip(requests, _arrivals(spec, len(requests), seed))]
    if spec.max_total_tokens is not None:
        requests = [clip_total(r, spec.max_total_tokens, fmt) for r in requests]
    requests.sort(key=lambda r: r.arrival_s)  # stable: ties keep trace order
    if spec.start_s is not None or spec.end_s is not None:
        low = spec.start_s if spec.start_s is not None else -math.inf
        high = spec.end_s if spec.end_s is not None else math.inf
        requests = [r for r in requests if low <= r.arrival_s < high]
        if not requests:
            raise ConfigError(f"no request arrives in [{spec.start_s}, {spec.end_s}) s, "
                              f"keys trace.start_s / trace.end_s, widen the window")
    if spec.max_requests is not None:
        requests = requests[:spec.max_requests]
    first = requests[0].arrival_s
    scale = spec.time_scale
    span = requests[-1].arrival_s - first
    if spec.target_rate_rps is not None and span > 0 and len(requests) > 1:
        scale = (len(requests) - 1) / span / spec.target_rate_rps
    return [replace(r, arrival_s=(r.arrival_s - first) * scale, think_time_s=r.think_time_s * scale)
            for r in requests]


def prompt_segments(fmt: TraceFormat, request: TraceRequest, content_of, unique) -> list[tuple[int, int]]:
    """Segments of a prompt: one per trace block (content = its hash id), then any remainder."""
    size = fmt.block_size
    if not size or not request.hash_ids:
        return [(unique(), request.input_len)]
    segments = []
    for index, block in enumerate(request.hash_ids):
        length = min(size, request.input_len - index * size)
        segments.append((content_of(block), length))
    covered = sum(n for _, n in segments)
    if covered < request.input_len:
        segments.append((unique(), request.input_len - covered))
    return segments


def build_workload(spec: TraceSpec, seed: int, stream: bool = True) -> Workload:
    """The trace's sessions. Copies of a repeated trace follow one another, one mean gap apart,
    and share no prefixes: streamed (RepeatedSessions), only the first is built, and each later
    copy is the first with its ids and times shifted, built as the run reaches it; stream=False
    builds every copy (the same sessions)."""
    fmt, raw, skipped, failed = read_requests(spec)
    timed = timed_requests(spec, fmt, raw, seed)
    period = timed[-1].arrival_s * len(timed) / max(len(timed) - 1, 1)
    closed = spec.timing == "closed" and fmt.has_sessions
    contents: dict = {}
    next_id = iter(range(1, 1 << 62)).__next__
    interner = PrefixInterner()
    session_ids: dict = {}
    chain_ids: dict = {}
    num_chains: dict[int, int] = {}
    chains: dict[tuple[int, int], list] = {}
    request_id = 0
    for copy in range(1 if stream else spec.repeat):
        def content_of(block, copy=copy):
            key = (copy, block)
            if key not in contents:
                contents[key] = next_id()
            return contents[key]
        for r in timed:
            session_key = (copy, r.session) if fmt.has_sessions else (copy, request_id)
            session_id = session_ids.setdefault(session_key, len(session_ids))
            chain_key = (session_id, r.chain if closed else ("open", request_id))
            if chain_key not in chain_ids:
                chain_ids[chain_key] = num_chains.get(session_id, 0)
                num_chains[session_id] = chain_ids[chain_key] + 1
            chain = chain_ids[chain_key]
            turns = chains.setdefault((session_id, chain), [])
            request = make_request(interner, request_id, prompt_segments(fmt, r, content_of, next_id),
                                   r.output_len, next_id(), session_id=session_id, turn=len(turns),
                                   think_time_s=r.think_time_s, chain=chain)
            turns.append((r.arrival_s + copy * period, request))
            request_id += 1
    sessions = tuple(Session(session_id, turns[0][0], tuple(req for _, req in turns), chain)
                     for (session_id, chain), turns in chains.items())
    if stream and spec.repeat > 1:
        shift = CopyShift(requests=request_id, sessions=len(session_ids), contents=next_id() - 1,
                          prefixes=interner.num_prefixes, period_s=period)
        sessions = RepeatedSessions(sessions, spec.repeat, shift)
    return Workload(sessions, skipped, failed, fmt.name, prefix_tree=interner.tree)
