"""Prompts longer than max_model_len: `trace.on_overlength=truncate` keeps their last tokens.

vLLM rejects such a prompt by default (its API answers 400); with `truncate_prompt_tokens` it
keeps the last k tokens instead. Here a truncated prompt keeps its last max_model_len - output
tokens, so that the requested output still fits (at least one prompt token is kept). Dropping the front changes the identity of everything after the cut: the
partly kept segment becomes new content, and every request's prefix chain is interned afresh so
that the kept segments' prefix keys cannot meet keys of the untruncated prompts.
"""
from __future__ import annotations

from dataclasses import replace

from sim.workload.request import PrefixInterner, Request, Workload, make_request


def _kept_segments(request: Request, keep: int, new_content: int) -> list[tuple[int, int]]:
    cut = request.prompt_len - keep
    segments, position = [], 0
    for content_id, num_tokens in request.segments:
        end = position + num_tokens
        if end > cut:
            if position < cut:  # the segment the cut falls in: its tail is content of its own
                segments.append((new_content, end - cut))
            else:
                segments.append((content_id, num_tokens))
        position = end
    return segments


def truncate_overlength(workload: Workload, max_model_len: int) -> Workload:
    """The workload with every prompt longer than max_model_len cut to its last
    max_model_len - output_len tokens (at least 1), counted in num_truncated_prompts. The same
    object when no prompt is too long."""
    if all(t.prompt_len <= max_model_len for s in workload.sessions for t in s.turns):
        return workload
    next_content = 1 + max(max(max((c for c, _ in t.segments), default=0), t.output_content_id)
                           for s in workload.sessions for t in s.turns)
    interner, sessions, num_truncated = PrefixInterner(), [], 0
    for session in workload.sessions:
        turns = []
        for t in session.turns:
            segments = t.segments
            if t.prompt_len > max_model_len:
                segments = _kept_segments(t, max(1, max_model_len - t.output_len), next_content)
                next_content += 1
                num_truncated += 1
            rebuilt = make_request(interner, t.request_id, segments, t.output_len,
                                   t.output_content_id, session_id=t.session_id, turn=t.turn,
                                   think_time_s=t.think_time_s, n=t.n, chain=t.chain, priority=t.priority)
            turns.append(rebuilt)
        sessions.append(replace(session, turns=tuple(turns)))
    return replace(workload, sessions=tuple(sessions), num_truncated_prompts=num_truncated, prefix_tree=interner.tree)
