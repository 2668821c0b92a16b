"""The decode cohort: the leading running sequences that only decode, advanced in arrays.

A decoding sequence is scheduled one token every step, in admission order, ahead of any sequence
still prefilling behind it. So the scheduler keeps the leading run of such sequences as a cohort:
their counters live in numpy arrays (tokens known, outputs sampled, steps left before they
finish, last token time) and a step costs numpy over the cohort, not Python per sequence. The
allocator's side (`memory`, e.g. sim.kvcache.paged_cohort) keeps their KV the same way. A
member's Sequence object lags while it is a member: leave() and flush() write its counters back
(a finished member leaves at once). Between steps a member has computed all but its last token
(num_computed = num_tokens - 1) and the allocator holds exactly its computed tokens.
"""
from __future__ import annotations

import numpy as np


class DecodeCohort:
    def __init__(self, memory, max_model_len: int):
        self.memory, self.max_model_len = memory, max_model_len
        self.seqs: list = []
        self.tokens = np.empty(0, dtype=np.int64)      # num_tokens
        self.output = np.empty(0, dtype=np.int64)      # num_output
        self.left = np.empty(0, dtype=np.int64)        # samples before it finishes
        self.last_time = np.empty(0, dtype=np.float64) # last_token_time_s

    def __len__(self) -> int:
        return len(self.seqs)

    def extend_from(self, running: list) -> None:
        """Admit the decoding sequences that directly follow the members in `running`."""
        start = index = len(self.seqs)
        if start and (start > len(running) or running[start - 1] is not self.seqs[-1]):
            raise AssertionError("the decode cohort is no longer the head of the running batch")
        memory = self.memory
        while index < len(running):
            seq = running[index]
            if not (seq.num_output and seq.num_computed == seq.num_tokens - 1 and memory.can_join(seq)):
                break
            index += 1
        if index == start:
            return
        joining = running[start:index]
        self.seqs.extend(joining)
        memory.join(joining)
        max_model_len = self.max_model_len
        self.tokens = np.concatenate((self.tokens, [s.num_tokens for s in joining]))
        self.output = np.concatenate((self.output, [s.num_output for s in joining]))
        self.left = np.concatenate((self.left, [min(s.request.output_len - s.num_output,
                                                     max_model_len - s.num_tokens) for s in joining]))
        self.last_time = np.concatenate((self.last_time, [s.last_token_time_s for s in joining]))

    @property
    def context_tokens(self) -> int:
        """Decode context of a step over every member, the new tokens included."""
        return int(self.tokens.sum())

    def _write_back(self, indices) -> None:
        seqs = self.seqs
        for index, tokens, output, last in zip(indices, self.tokens[indices].tolist(),
                                               self.output[indices].tolist(), self.last_time[indices].tolist()):
            seq = seqs[index]
            seq.num_tokens, seq.num_computed, seq.num_output, seq.last_token_time_s = tokens, tokens - 1, output, last

    def flush(self) -> None:
        """Every member leaves, its Sequence brought up to date."""
        if self.seqs:
            self._write_back(range(len(self.seqs)))
            self.memory.flush()
            self.__init__(self.memory, self.max_model_len)

    def commit(self, now: float) -> tuple[list[tuple[float, int]], list]:
        """Every member sampled a token at `now`. Returns the inter-token gaps as (gap_s, count)
        pairs in the members' order of first occurrence, and the members that finished (they
        leave, in order, with finish_time_s set)."""
        self.tokens += 1
        self.output += 1
        self.left -= 1
        gaps = _gap_counts(now - self.last_time)
        self.last_time[:] = now
        done = np.flatnonzero(self.left <= 0)
        if not len(done):
            return gaps, []
        self._write_back(done.tolist())
        finished = [self.seqs[index] for index in done.tolist()]
        for seq in finished:
            seq.finish_time_s = now
        self._drop(done)
        return gaps, finished

    def _drop(self, indices: np.ndarray) -> None:
        self.memory.leave(indices)
        keep = np.ones(len(self.seqs), dtype=bool)
        keep[indices] = False
        self.seqs = [s for s, k in zip(self.seqs, keep.tolist()) if k]
        self.tokens, self.output = self.tokens[keep], self.output[keep]
        self.left, self.last_time = self.left[keep], self.last_time[keep]

    def advance(self, step_ends: np.ndarray) -> np.ndarray:
        """Commit len(step_ends) steps in which no member finishes; returns their inter-token
        gaps as rows (time_s, gap_s, count)."""
        num_steps = len(step_ends)
        rows = stretch_gap_rows(step_ends, self.last_time)
        self.tokens += num_steps
        self.output += num_steps
        self.left -= num_steps
        self.last_time[:] = float(step_ends[-1])
        return rows


def stretch_gap_rows(step_ends: np.ndarray, last_times: np.ndarray) -> np.ndarray:
    """Inter-token gaps of a stretch's steps as rows (time_s, gap_s, count) for sequences that
    last sampled at last_times: each one's own gap at the first step, then one shared gap per step."""
    first_end = float(step_ends[0])
    first = np.array([(first_end, gap, count) for gap, count in _gap_counts(first_end - last_times)])
    rest = np.column_stack((step_ends[1:], np.diff(step_ends), np.full(len(step_ends) - 1, len(last_times))))
    return np.concatenate((first.reshape(-1, 3), rest))


def _gap_counts(gaps: np.ndarray) -> list[tuple[float, int]]:
    """(gap, count) for each distinct gap, in order of first occurrence."""
    if not len(gaps):
        return []
    if gaps.min() == gaps.max():
        return [(float(gaps[0]), len(gaps))]
    values, first, counts = np.unique(gaps, return_index=True, return_counts=True)
    order = np.argsort(first)
    return list(zip(values[order].tolist(), counts[order].tolist()))
