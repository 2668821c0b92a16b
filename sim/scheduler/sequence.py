"""A request's mutable serving state on one replica: one Sequence per sample."""
from __future__ import annotations

import dataclasses
import math

from sim.workload.request import Request


class Sequence:
    """Tokens known (prompt + sampled outputs) versus tokens whose KV is computed.

    As in vLLM v1, prefill and decode are one mechanism: a step computes KV for up to
    num_tokens - num_computed tokens, and once a sequence has caught up it samples one more token.
    A request with n > 1 parallel samples forks n - 1 sibling sequences when its prompt is done.
    """
    __slots__ = ("seq_id", "request", "arrival_time_s", "num_tokens", "num_computed",
                 "num_output", "final_len", "first_token_time_s", "last_token_time_s", "finish_time_s",
                 "num_preemptions", "prefix_hit_tokens", "admitted", "replica", "sample_index",
                 "num_swapped_tokens", "transferred_tokens", "first_scheduled_s", "decode_twin",
                 "num_verifications")

    def __init__(self, request: Request, arrival_time_s: float, max_model_len: int,
                 seq_id: int | None = None, sample_index: int = 0):
        self.seq_id = request.request_id if seq_id is None else seq_id
        self.request = request
        self.arrival_time_s = arrival_time_s
        self.num_tokens = request.prompt_len
        self.num_computed = 0
        self.num_output = 0
        self.final_len = min(request.prompt_len + request.output_len, max_model_len)
        self.first_token_time_s = math.nan
        self.last_token_time_s = math.nan
        self.finish_time_s = math.nan
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0
        self.admitted = False
        self.replica = -1
        self.sample_index = sample_index
        self.num_swapped_tokens = 0  # KV tokens held in CPU memory while swapped out
        # Disaggregation (sim.engine.disaggregated): prompt KV received from a prefill replica
        # (admitted as computed, once), when the prefill side first scheduled it, and the decode
        # side's sequence a prefill sequence hands its KV to.
        self.transferred_tokens = 0
        self.first_scheduled_s = math.nan
        self.decode_twin = None
        self.num_verifications = 0  # speculative decoding: verification steps so far

    def sibling(self, seq_id: int, sample_index: int) -> "Sequence":
        """Another sample of the same request, at the same point (its prompt computed)."""
        twin = Sequence.__new__(Sequence)
        for name in Sequence.__slots__:
            setattr(twin, name, getattr(self, name))
        twin.seq_id, twin.sample_index = seq_id, sample_index
        twin.prefix_hit_tokens = twin.num_preemptions = 0
        # Each sample generates its own tokens: a distinct (negative, never generated) output
        # content id keeps their KV from ever matching one another in a prefix cache.
        twin.request = dataclasses.replace(
            self.request, output_content_id=-(self.request.output_content_id * 1024 + sample_index))
        return twin
