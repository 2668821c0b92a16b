"""synthetic: independent single-turn requests with lognormal lengths and Poisson arrivals.

No two prompts share a token, so prefix caching can only lose; this is the no-sharing baseline
(and, with the ShareGPT means of the PagedAttention paper, its section 6.2 workload).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.errors import ConfigError
from sim.workload.request import PrefixInterner, Session, Workload, make_request
from sim.workload.sampling import lognormal_tokens, poisson_arrivals


@dataclass(frozen=True, slots=True)
class SyntheticSpec:
    num_requests: int
    request_rate_per_s: float
    input_tokens_mean: float
    output_tokens_mean: float
    length_sigma: float
    max_total_tokens: int  # prompt + output are capped here (0: no cap)
    n: int = 1             # parallel samples per request (vLLM's SamplingParams.n)
    priority_classes: int = 1  # request priorities drawn uniformly from 0..classes-1 (queue_order=priority)

    def __post_init__(self):
        if (self.num_requests < 1 or self.request_rate_per_s <= 0 or not 1 <= self.n <= 1024
                or self.priority_classes < 1):
            raise ConfigError("scenario.num_requests must be >= 1, request_rate_per_s > 0, "
                              "n in 1..1024 and priority_classes >= 1, scenario synthetic, fix the values")

    def generate(self, seed: int) -> Workload:
        arrivals_rng, lengths_rng = (np.random.default_rng(s)
                                     for s in np.random.SeedSequence(seed).spawn(2))
        n = self.num_requests
        arrivals = poisson_arrivals(arrivals_rng, self.request_rate_per_s, n)
        inputs = lognormal_tokens(lengths_rng, self.input_tokens_mean, self.length_sigma, n)
        outputs = lognormal_tokens(lengths_rng, self.output_tokens_mean, self.length_sigma, n)
        if self.max_total_tokens:
            inputs = np.minimum(inputs, self.max_total_tokens - 1)
            outputs = np.minimum(outputs, self.max_total_tokens - inputs)
        priorities = np.zeros(n, dtype=int)
        if self.priority_classes > 1:  # a third stream: the first two draw as before
            priorities = np.random.default_rng(np.random.SeedSequence(seed).spawn(3)[2]).integers(
                self.priority_classes, size=n)
        interner, sessions = PrefixInterner(), []
        for i in range(n):
            # Content ids 2i+1 (prompt) and 2i+2 (output) are unique to request i.
            request = make_request(interner, i, [(2 * i + 1, int(inputs[i]))], int(outputs[i]),
                                   2 * i + 2, session_id=i, n=self.n, priority=int(priorities[i]))
            sessions.append(Session(i, float(arrivals[i]), (request,)))
        return Workload(tuple(sessions), prefix_tree=interner.tree)
