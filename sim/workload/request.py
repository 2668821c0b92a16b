"""Requests and sessions, with prompt identity as segments.

A prompt is a sequence of segments (content_id, num_tokens): tokens 0..n-1 of that content. The
prefix before segment j is interned to an integer (`PrefixInterner`), so the identity of the first
e tokens of a prompt is the exact key (prefix id before the segment holding token e-1, content id,
offset e - segment start), packed into one integer (`pack_key`: 32 bits each for the content id
and the offset; ints hash and compare cheaper than tuples and are not tracked by the garbage
collector). Keys are equal exactly when the token prefixes are equal, at any block size, with no
hashing and so no collisions. Generated output is one more segment with the
request's own content id, so a follow-up turn that quotes it shares its blocks.
"""
from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field


KEY_FIELD_BITS = 32  # content ids and offsets stay below 2**32 (checked in make_request)


def pack_key(prefix_id: int, content_id: int, offset: int) -> int:
    """The integer form of the key (prefix_id, content_id, offset), one-to-one."""
    return (((prefix_id << KEY_FIELD_BITS) | content_id) << KEY_FIELD_BITS) | offset


@dataclass(frozen=True, slots=True, eq=False)
class PrefixTree:
    """An interner's prefixes by id (0: the empty prefix), in machine integers (numpy reads
    them without a copy): each one's parent (the prefix before its last segment), that
    segment's content id, the prefix's tokens and its segments. A request's segments can be
    read back from its whole prompt's id alone (sim.engine.compiled.rows reads a run's keys so),
    and the requests made with the interner (make_request) are kept, in the order made, with
    their whole prompts' ids and output content ids: a reader that finds a workload's requests
    to be these very objects (frozen) reads those columns instead of each request's tuples.
    An array('q') cannot grow while a numpy view of it lives (BufferError): readers copy the
    columns (rows.PrefixTable.of). Compared and hashed by identity."""
    parents: array = field(default_factory=lambda: array("q", [0]))
    contents: array = field(default_factory=lambda: array("q", [0]))
    tokens: array = field(default_factory=lambda: array("q", [0]))
    depths: array = field(default_factory=lambda: array("q", [0]))
    made: list = field(default_factory=list)                                # the Request objects made
    made_prompts: array = field(default_factory=lambda: array("q"))         # their whole prompts' ids
    made_output_contents: array = field(default_factory=lambda: array("q"))  # their output content ids


class PrefixInterner:
    """Gives each distinct segment chain a small integer; 0 is the empty prefix. Its tree
    (PrefixTree) outlives it in the workload; the dictionary is only needed while interning."""

    def __init__(self):
        self._ids: dict[tuple[int, int, int], int] = {}
        self.tree = PrefixTree()

    @property
    def num_prefixes(self) -> int:
        """Prefix ids given so far (they are 1 .. num_prefixes)."""
        return len(self._ids)

    def extend(self, prefix_id: int, content_id: int, num_tokens: int) -> int:
        key = (prefix_id, content_id, num_tokens)
        found = self._ids.get(key)
        if found is None:
            found = self._ids[key] = len(self._ids) + 1
            tree = self.tree
            tree.parents.append(prefix_id)
            tree.contents.append(content_id)
            tree.tokens.append(tree.tokens[prefix_id] + num_tokens)
            tree.depths.append(tree.depths[prefix_id] + 1)
        return found


@dataclass(frozen=True, slots=True)
class Request:
    request_id: int
    prompt_len: int
    output_len: int
    segments: tuple[tuple[int, int], ...]
    # prefix_ids[j]: interned prefix before segment j; prefix_ids[-1]: the whole prompt.
    prefix_ids: tuple[int, ...]
    segment_starts: tuple[int, ...]
    output_content_id: int
    session_id: int = 0
    turn: int = 0
    # Delay between the previous turn's finish and this turn's arrival (tool call, thinking).
    think_time_s: float = 0.0
    n: int = 1
    chain: int = 0  # a session's independent closed-loop chains (agentic subagents)
    priority: int = 0  # queue_order=priority serves lower values first (vLLM's priority)

    def prefix_key(self, end: int) -> int:
        """Identity of tokens [0, end), end >= 1, over prompt then generated output."""
        if end > self.prompt_len:
            return pack_key(self.prefix_ids[-1], self.output_content_id, end - self.prompt_len)
        j = bisect_right(self.segment_starts, end - 1) - 1
        return pack_key(self.prefix_ids[j], self.segments[j][0], end - self.segment_starts[j])


    def prefix_keys(self, block_size: int, first_block: int, end_block: int) -> list[int]:
        """prefix_key((i + 1) * block_size) for i in [first_block, end_block), a segment's
        blocks at a time (one range of packed keys each)."""
        keys: list[int] = []
        end, last = (first_block + 1) * block_size, end_block * block_size  # block ends, inclusive
        prompt_last = min(last, self.prompt_len)
        starts, segments = self.segment_starts, self.segments
        if end <= prompt_last:
            j = bisect_right(starts, end - 1) - 1  # the segment holding token end - 1
            while end <= prompt_last:
                start = starts[j]
                stop = min(start + segments[j][1], prompt_last)
                if stop >= end:
                    base = pack_key(self.prefix_ids[j], segments[j][0], 0) - start
                    keys.extend(range(base + end, base + stop + 1, block_size))
                    end += ((stop - end) // block_size + 1) * block_size
                j += 1
        if end <= last:
            base = pack_key(self.prefix_ids[-1], self.output_content_id, 0) - self.prompt_len
            keys.extend(range(base + end, base + last + 1, block_size))
        return keys


def make_request(interner: PrefixInterner, request_id: int, segments, output_len: int,
                 output_content_id: int, **extra) -> Request:
    starts, prefix_ids, position, prefix = [], [0], 0, 0
    if not 0 <= output_content_id < 1 << KEY_FIELD_BITS:
        raise ValueError(f"content id {output_content_id} outside the packed key's 32 bits")
    for content_id, num_tokens in segments:
        if not 0 <= content_id < 1 << KEY_FIELD_BITS:
            raise ValueError(f"content id {content_id} outside the packed key's 32 bits")
        starts.append(position)
        position += num_tokens
        prefix = interner.extend(prefix, content_id, num_tokens)
        prefix_ids.append(prefix)
    if position + output_len >= 1 << KEY_FIELD_BITS:
        raise ValueError(f"request of {position + output_len} tokens: offsets outside the packed key's 32 bits")
    request = Request(request_id=request_id, prompt_len=position, output_len=output_len,
                      segments=tuple(segments), prefix_ids=tuple(prefix_ids),
                      segment_starts=tuple(starts), output_content_id=output_content_id, **extra)
    tree = interner.tree
    tree.made.append(request)
    tree.made_prompts.append(prefix)
    tree.made_output_contents.append(output_content_id)
    return request


@dataclass(frozen=True, slots=True)
class Session:
    """Turns that arrive one after another: turn k+1 after turn k finished plus its think time.

    A session with subagents is several Session objects with the same session_id, one per chain.
    """
    session_id: int
    arrival_time_s: float
    turns: tuple[Request, ...] = field(default_factory=tuple)
    chain: int = 0


def session_order(session: "Session") -> tuple:
    """The order sessions reach the cluster in: arrival, then session id, then chain."""
    return session.arrival_time_s, session.session_id, session.chain


@dataclass(frozen=True, slots=True)
class CopyShift:
    """What one more copy of a repeated trace adds to every id and time of the one before."""
    requests: int      # request ids
    sessions: int      # session ids
    contents: int      # content ids (segments and outputs)
    prefixes: int      # interned prefix ids (0, the empty prefix, stays)
    period_s: float    # arrival times


class RepeatedSessions(Sequence):
    """`repeat` copies of one copy's sessions, copy k built when it is reached: every id shifted
    by k x the shift, arrivals by k x the period (copies share no prefix). Iterating yields the
    sessions in the cluster's order (arrival, session id, chain) without holding the copies, so
    a repeated trace's memory does not grow with its length."""

    def __init__(self, one_copy: tuple[Session, ...], repeat: int, shift: CopyShift):
        self.one_copy, self.repeat, self.shift = tuple(sorted(one_copy, key=session_order)), repeat, shift
        self.num_requests = repeat * sum(len(s.turns) for s in one_copy)
        times = [s.arrival_time_s for s in one_copy]
        self.first_arrival_s = min(times, default=0.0)
        self.last_arrival_s = max(times, default=0.0) + (repeat - 1) * shift.period_s

    def __len__(self) -> int:
        return self.repeat * len(self.one_copy)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        copy, within = divmod(index if index >= 0 else index + len(self), len(self.one_copy))
        if not 0 <= copy < self.repeat:
            raise IndexError(index)
        return self._shifted(self.one_copy[within], copy)

    def __iter__(self):
        for copy in range(self.repeat):
            for session in self.one_copy:
                yield self._shifted(session, copy)

    def _shifted(self, session: Session, copy: int) -> Session:
        """Copy `copy` of a session (Requests built positionally, in Request's field order, for
        speed: tests/test_traces.py compares every field with a copy built from the trace)."""
        if not copy:
            return session
        shift = self.shift
        contents, prefixes = copy * shift.contents, copy * shift.prefixes
        requests, sessions = copy * shift.requests, copy * shift.sessions
        turns = tuple(
            Request(r.request_id + requests, r.prompt_len, r.output_len,
                    tuple([(content + contents, n) for content, n in r.segments]),
                    tuple([p + prefixes if p else 0 for p in r.prefix_ids]), r.segment_starts,
                    r.output_content_id + contents, r.session_id + sessions, r.turn, r.think_time_s, r.n,
                    r.chain, r.priority)
            for r in session.turns)
        return Session(session.session_id + copy * shift.sessions, session.arrival_time_s + copy * shift.period_s,
                       turns, session.chain)


@dataclass(frozen=True, slots=True)
class Workload:
    sessions: Sequence[Session]      # a tuple, or RepeatedSessions (built as they are reached)
    num_skipped_records: int = 0   # malformed trace records skipped with trace.on_error=skip
    num_failed_requests: int = 0   # requests the trace marks as failed (BurstGPT zero responses)
    trace_format: str = ""         # the format a trace was read as (trace.format=auto says which)
    num_truncated_prompts: int = 0  # prompts cut to max_model_len - 1 (trace.on_overlength=truncate)
    # Requests in flight at most, over the whole cluster (a benchmark client's semaphore); a
    # request arriving when that many are in flight is sent when one finishes. None: no cap.
    max_concurrency: int | None = None
    # The tree of the interner that gave the requests' prefix ids (of one copy, for a streamed
    # repeat), if known: the compiled loop then reads their keys from it (sim.engine.compiled.rows).
    prefix_tree: PrefixTree | None = field(default=None, compare=False)

    # A streamed repeat (RepeatedSessions) answers these without building its copies.
    @property
    def num_requests(self) -> int:
        if isinstance(self.sessions, RepeatedSessions):
            return self.sessions.num_requests
        return sum(len(s.turns) for s in self.sessions)

    @property
    def first_arrival_s(self) -> float:
        if isinstance(self.sessions, RepeatedSessions):
            return self.sessions.first_arrival_s
        return min((s.arrival_time_s for s in self.sessions), default=0.0)

    @property
    def last_arrival_s(self) -> float:
        if isinstance(self.sessions, RepeatedSessions):
            return self.sessions.last_arrival_s
        return max((s.arrival_time_s for s in self.sessions), default=0.0)

    @property
    def one_copy(self) -> Sequence[Session]:
        """The sessions of one copy of a repeated trace (all sessions otherwise): what every
        copy's requests look like, apart from their ids and times."""
        return self.sessions.one_copy if isinstance(self.sessions, RepeatedSessions) else self.sessions

    def in_arrival_order(self):
        """The sessions in the cluster's order (arrival, session id, chain)."""
        if isinstance(self.sessions, RepeatedSessions):
            return iter(self.sessions)  # already in that order
        return iter(sorted(self.sessions, key=session_order))


def independent_requests(arrivals, prompts, output_lens, next_content, n: int = 1) -> Workload:
    """One single-turn session per request: prompts[i] (segments) arriving at arrivals[i]."""
    interner, sessions = PrefixInterner(), []
    for i, (arrival, segments, output_len) in enumerate(zip(arrivals, prompts, output_lens)):
        request = make_request(interner, i, segments, int(output_len), next_content(), session_id=i, n=n)
        sessions.append(Session(i, float(arrival), (request,)))
    return Workload(tuple(sessions), prefix_tree=interner.tree)
