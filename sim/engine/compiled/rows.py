"""The workload as the compiled loop reads it: a row per request, sessions (and their chains) in
the cluster's arrival order, each session's turns one after another, in columns. A repeated trace
(sim.workload.request.RepeatedSessions) is read once and its copies are tiled with their shifts,
the same ids and times RepeatedSessions._shifted gives them, so that its requests are never built
as objects (building them took about 10 us a request, most of a million-request run's loop)."""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from operator import attrgetter, is_, itemgetter

import numpy as np

from sim.workload.request import RepeatedSessions


@dataclass(frozen=True)
class PromptKeys:
    """What the prefix cache keys blocks by (sim.workload.request.Request.prefix_key), in rows."""
    output_content: np.ndarray  # each request's output content id
    prompt_prefix: np.ndarray   # each request's whole-prompt prefix id
    num_segments: np.ndarray    # each request's prompt segments
    first_segment: np.ndarray   # each request's first row of segments
    segments: np.ndarray        # a row per prompt segment: start, content id, prefix id before it


@dataclass(frozen=True)
class RequestRows:
    prompt: np.ndarray          # prompt tokens
    output: np.ndarray          # output tokens asked for
    next_turn: np.ndarray       # the row of the session's next turn, -1: none
    think_s: np.ndarray         # think time before the turn
    request_id: np.ndarray
    session_id: np.ndarray
    turn: np.ndarray
    starts: np.ndarray          # each session's first row
    arrival_s: np.ndarray       # each session's arrival time
    keys: PromptKeys | None     # read only for a prefix cache

    def __len__(self) -> int:
        return len(self.prompt)


def request_rows(workload, with_keys: bool) -> RequestRows:
    """The workload's rows; with_keys: with the prompts' keys too (a prefix cache's run)."""
    sessions, tree = workload.sessions, workload.prefix_tree
    if isinstance(sessions, RepeatedSessions):
        return _tiled(_read(sessions.one_copy, with_keys, tree), sessions.repeat, sessions.shift)
    return _read(workload.in_arrival_order(), with_keys, tree)


def arrival_clock(arrival_s: np.ndarray) -> np.ndarray:
    """The sessions' arrival times as the cluster's SimPy clock reaches them (one addition after
    another, as its timeouts add them)."""
    now, clock = 0.0, []
    for when in arrival_s.tolist():
        if when > now:
            now = now + (when - now)
        clock.append(now)
    return np.array(clock, dtype=np.float64)


def _read(sessions, with_keys: bool, tree) -> RequestRows:
    requests, starts, next_turn, arrivals = [], [], [], []
    for session in sessions:
        starts.append(len(requests))
        arrivals.append(session.arrival_time_s)
        for turn, request in enumerate(session.turns):
            requests.append(request)
            next_turn.append(len(requests) if turn + 1 < len(session.turns) else -1)

    def column(name, dtype=np.int64):
        return np.fromiter(map(attrgetter(name), requests), dtype=dtype, count=len(requests))

    prompt, next_turn = column("prompt_len"), np.array(next_turn, dtype=np.int64)
    keys = None
    if with_keys:
        keys = _read_keys(requests, next_turn, tree)
    return RequestRows(prompt, column("output_len"), next_turn, column("think_time_s", np.float64),
                       column("request_id"), column("session_id"), column("turn"),
                       np.array(starts, dtype=np.int64), np.array(arrivals, dtype=np.float64), keys)


def _read_keys(requests, next_turn: np.ndarray, tree) -> PromptKeys:
    """The requests' keys. A turn whose prompt is the start of its next turn's prompt reads its
    segment rows from that turn's (equal prefix ids are equal segment chains, PrefixInterner), so
    a session's rows are read once: a conversation's turns repeat every segment before (at
    rag_agents_100k 320,016 rows for 1,194,150 prompt segments). When the requests are the very
    objects the workload's interner made (Workload.prefix_tree; requests are frozen), each one's
    whole prompt id and output content id are read from the tree's columns and its segments from
    the tree (_keys_from_table); else (no tree, another interner's, a request rebuilt since) from
    each request's tuples (_keys_from_tuples, Python work per segment: at rag_agents_100k the
    keys take 0.19 s so, 0.08 s from the tree reading each request's whole prompt id, 0.02 s
    from the tree's columns)."""
    made = None if tree is None else _made_rows(tree, requests)
    if made is not None:
        table = PrefixTable.of(tree)
        whole, output_content = table.made_prompts[made], table.made_output_contents[made]
        return _keys_from_table(table, whole, table.depths[whole], next_turn, output_content)
    output_content = np.fromiter(map(attrgetter("output_content_id"), requests), dtype=np.int64,
                                 count=len(requests))
    prefix_lists = list(map(attrgetter("prefix_ids"), requests))
    counts = np.fromiter(map(len, prefix_lists), dtype=np.int64, count=len(requests)) - 1
    return _keys_from_tuples(requests, prefix_lists, counts, next_turn, output_content)


ALL_IN_ORDER = slice(None)  # _made_rows: the requests are those made, in the order made


def _made_rows(tree, requests: list):
    """Each request's row among the requests the tree's interner made (ALL_IN_ORDER when they
    are those, in that order), or None if one of them was not made by it (compared by identity:
    the tree holds the objects it made, so no other live object shares one's id)."""
    made = tree.made
    if len(made) == len(requests) and all(map(is_, requests, made)):
        return ALL_IN_ORDER
    row_of = {id(request): row for row, request in enumerate(made)}
    rows = [row_of.get(id(request), -1) for request in requests]
    return None if -1 in rows else np.array(rows, dtype=np.int64)


@dataclass(frozen=True)
class PrefixTable:
    """A PrefixTree's columns as numpy arrays, by prefix id (0: the empty prefix)."""
    parents: np.ndarray   # the prefix before the last segment
    contents: np.ndarray  # the last segment's content id
    tokens: np.ndarray    # the prefix's tokens
    depths: np.ndarray    # the prefix's segments
    made_prompts: np.ndarray          # the requests the interner made: their whole prompts' ids
    made_output_contents: np.ndarray  # and output content ids

    @classmethod
    def of(cls, tree) -> PrefixTable:
        return cls(*(np.frombuffer(column, dtype=np.int64).copy() for column in
                     (tree.parents, tree.contents, tree.tokens, tree.depths, tree.made_prompts,
                      tree.made_output_contents)))

    def ancestors(self, ids: np.ndarray, depths: np.ndarray) -> np.ndarray:
        """Each id's prefix of depths[i] segments (the id itself where it has no more)."""
        ids = ids.copy()
        climbing = np.flatnonzero(self.depths[ids] > depths)
        while climbing.size:
            ids[climbing] = self.parents[ids[climbing]]
            climbing = climbing[self.depths[ids[climbing]] > depths[climbing]]
        return ids


def _keys_from_table(table: PrefixTable, whole: np.ndarray, counts: np.ndarray, next_turn: np.ndarray,
                     output_content: np.ndarray) -> PromptKeys:
    following = np.maximum(next_turn, 0)
    starts_next = (next_turn >= 0) & (counts[following] >= counts) & (
        table.ancestors(whole[following], counts) == whole)
    owned, owned_counts, first_row, owner_rank = _owned_rows(_owners(starts_next), counts)
    # Row first_row + k of an owner holds the prefix after its segment k: its whole prompt's id,
    # then each parent in turn, filled from the last row up.
    ids = np.empty(int(owned_counts.sum()), dtype=np.int64)
    cursor, row = whole[owned], first_row + owned_counts - 1
    filling = np.flatnonzero(owned_counts > 0)
    while filling.size:
        ids[row[filling]] = cursor[filling]
        cursor[filling], row[filling] = table.parents[cursor[filling]], row[filling] - 1
        filling = filling[table.depths[cursor[filling]] > 0]
    before = table.parents[ids]
    segments = np.stack([table.tokens[before], table.contents[ids], before], axis=1)
    return PromptKeys(output_content, whole, counts, first_row[owner_rank], segments)


def _keys_from_tuples(requests, prefix_lists, counts: np.ndarray, next_turn: np.ndarray,
                      output_content: np.ndarray) -> PromptKeys:
    owned, owned_counts, first_row, owner_rank = _owned_rows(
        _owners(_starts_next_from_tuples(prefix_lists, next_turn)), counts)
    owned_requests = [requests[i] for i in owned.tolist()]
    total = int(owned_counts.sum())
    # Per owned request: its first prefix id (one before each segment, then the whole prompt's:
    # one more per owned request before it).
    first_id = first_row + np.arange(len(owned))
    prefix_ids = np.fromiter(chain.from_iterable(map(attrgetter("prefix_ids"), owned_requests)), dtype=np.int64,
                             count=total + len(owned_requests))
    segments = np.empty((total, 3), dtype=np.int64)
    segments[:, 0] = np.fromiter(chain.from_iterable(map(attrgetter("segment_starts"), owned_requests)),
                                 dtype=np.int64, count=total)
    segments[:, 1] = np.fromiter(map(itemgetter(0), chain.from_iterable(map(attrgetter("segments"), owned_requests))),
                                 dtype=np.int64, count=total)
    segments[:, 2] = np.delete(prefix_ids, first_id + owned_counts)
    # A request's whole prompt is its owner's prefix before the request's segment count.
    prompt_prefix = prefix_ids[first_id[owner_rank] + counts]
    return PromptKeys(output_content, prompt_prefix, counts, first_row[owner_rank], segments)


def _starts_next_from_tuples(prefix_lists: list[tuple[int, ...]], next_turn: np.ndarray) -> np.ndarray:
    """Whether each turn's prompt starts its next turn's (turn i's prefix ids all stand first
    in turn i + 1's, the whole prompt's id at its segment count)."""
    return np.fromiter(
        (following >= 0 and len(prefix_lists[following]) > len(ids) - 1
         and prefix_lists[following][len(ids) - 1] == ids[-1]
         for ids, following in zip(prefix_lists, next_turn.tolist())), dtype=bool, count=len(prefix_lists))


def _owned_rows(owners: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, ...]:
    """The requests that own segment rows, their segment counts and first rows, and each
    request's owner's rank among them."""
    owned = np.flatnonzero(owners == np.arange(len(owners)))
    owned_counts = counts[owned]
    return owned, owned_counts, np.cumsum(owned_counts) - owned_counts, np.searchsorted(owned, owners)


def _owners(starts_next: np.ndarray) -> np.ndarray:
    """Each request's owner of segment rows: the last of the turns from it on whose prompts each
    start the next turn's (a session's turns are consecutive rows, next turn i + 1 or none)."""
    last_turns = np.flatnonzero(~starts_next)
    return last_turns[np.searchsorted(last_turns, np.arange(len(starts_next)))]


def _tiled(one: RequestRows, repeat: int, shift) -> RequestRows:
    """`repeat` copies of one copy's rows, copy k's ids shifted by k x the shift and its arrivals
    by k x the period (the interned prefix 0, the empty prefix, stays 0)."""
    num_rows, copies = len(one), np.arange(repeat, dtype=np.int64)[:, None]

    def tile(column):
        return np.tile(column, repeat)

    def shifted(column, by):
        return (column[None, :] + copies * by).ravel()

    def prefixes(column):
        return np.where(tile(column) == 0, 0, shifted(column, shift.prefixes))

    next_turn = np.where(tile(one.next_turn) < 0, -1, shifted(one.next_turn, num_rows))
    arrival_s = (one.arrival_s[None, :] + copies * shift.period_s).ravel()
    keys = None
    if one.keys is not None:
        segments = np.empty((repeat * len(one.keys.segments), 3), dtype=np.int64)
        segments[:, 0] = tile(one.keys.segments[:, 0])
        segments[:, 1] = shifted(one.keys.segments[:, 1], shift.contents)
        segments[:, 2] = prefixes(one.keys.segments[:, 2])
        keys = PromptKeys(shifted(one.keys.output_content, shift.contents), prefixes(one.keys.prompt_prefix),
                          tile(one.keys.num_segments), shifted(one.keys.first_segment, len(one.keys.segments)),
                          segments)
    return RequestRows(tile(one.prompt), tile(one.output), next_turn, tile(one.think_s),
                       shifted(one.request_id, shift.requests), shifted(one.session_id, shift.sessions),
                       tile(one.turn), shifted(one.starts, num_rows), arrival_s, keys)
