"""long_context: 128K to 1M-token prompts over a few very long shared contexts (code bases, books,
logs); a request is [context, shared by every request about it][question, unique]. Context
lengths are log-uniform between the bounds."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.errors import ConfigError
from sim.workload.request import Workload, independent_requests
from sim.workload.sampling import lognormal_tokens, off_grid, poisson_arrivals, zipf_choice


@dataclass(frozen=True, slots=True)
class LongContextSpec:
    num_requests: int
    request_rate_per_s: float
    num_contexts: int
    context_zipf: float
    context_tokens_min: int
    context_tokens_max: int
    question_tokens_mean: float
    output_tokens_mean: float
    length_sigma: float

    def __post_init__(self):
        if min(self.num_requests, self.num_contexts) < 1 or self.request_rate_per_s <= 0 \
                or not 0 < self.context_tokens_min <= self.context_tokens_max:
            raise ConfigError("long_context needs num_requests, num_contexts >= 1, request_rate_per_s > 0 "
                              "and 0 < context_tokens_min <= context_tokens_max, scenario long_context, "
                              "fix the values")

    def generate(self, seed: int) -> Workload:
        arrivals_rng, corpus_rng, request_rng = (np.random.default_rng(s)
                                                  for s in np.random.SeedSequence(seed).spawn(3))
        next_content = iter(range(1, 1 << 62)).__next__
        sigma, n = self.length_sigma, self.num_requests
        lengths = np.exp(corpus_rng.uniform(np.log(self.context_tokens_min),
                                            np.log(self.context_tokens_max), self.num_contexts))
        contexts = [(next_content(), off_grid(int(t))) for t in lengths]
        chosen = zipf_choice(request_rng, self.num_contexts, self.context_zipf, n)
        questions = lognormal_tokens(request_rng, self.question_tokens_mean, sigma, n)
        prompts = [[contexts[c], (next_content(), int(q))] for c, q in zip(chosen.tolist(), questions.tolist())]
        outputs = lognormal_tokens(request_rng, self.output_tokens_mean, sigma, n)
        arrivals = poisson_arrivals(arrivals_rng, self.request_rate_per_s, n)
        return independent_requests(arrivals, prompts, outputs, next_content)
