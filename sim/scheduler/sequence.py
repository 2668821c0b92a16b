"""A request's mutable serving state on one replica."""
from __future__ import annotations

import math

from sim.workload.request import Request


class Sequence:
    """Tokens known (prompt + sampled outputs) versus tokens whose KV is computed.

    As in vLLM v1, prefill and decode are one mechanism: a step computes KV for up to
    num_tokens - num_computed tokens, and once a sequence has caught up it samples one more token.
    """
    __slots__ = ("seq_id", "request", "arrival_time_s", "num_tokens", "num_computed",
                 "num_output", "final_len", "first_token_time_s", "finish_time_s",
                 "num_preemptions", "prefix_hit_tokens", "admitted", "replica")

    def __init__(self, request: Request, arrival_time_s: float, max_model_len: int):
        self.seq_id = request.request_id
        self.request = request
        self.arrival_time_s = arrival_time_s
        self.num_tokens = request.prompt_len
        self.num_computed = 0
        self.num_output = 0
        self.final_len = min(request.prompt_len + request.output_len, max_model_len)
        self.first_token_time_s = math.nan
        self.finish_time_s = math.nan
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0
        self.admitted = False
        self.replica = -1
