"""doc_qa: many questions about a few long documents. A request is [system prompt][document,
shared by every question about it][question, unique]; documents have Zipf popularity."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.errors import ConfigError
from sim.workload.request import Workload, independent_requests
from sim.workload.sampling import lognormal_tokens, off_grid, poisson_arrivals, zipf_choice


@dataclass(frozen=True, slots=True)
class DocQaSpec:
    num_requests: int
    request_rate_per_s: float
    num_documents: int
    document_zipf: float
    system_prompt_tokens: int
    document_tokens_mean: float
    question_tokens_mean: float
    output_tokens_mean: float
    length_sigma: float

    def __post_init__(self):
        if min(self.num_requests, self.num_documents) < 1 or self.request_rate_per_s <= 0:
            raise ConfigError("doc_qa needs num_requests, num_documents >= 1 and request_rate_per_s > 0, "
                              "scenario doc_qa, fix the values")

    def generate(self, seed: int) -> Workload:
        arrivals_rng, corpus_rng, request_rng = (np.random.default_rng(s)
                                                  for s in np.random.SeedSequence(seed).spawn(3))
        next_content = iter(range(1, 1 << 62)).__next__
        sigma, n = self.length_sigma, self.num_requests
        system = (next_content(), off_grid(self.system_prompt_tokens))
        documents = [(next_content(), off_grid(int(t))) for t in lognormal_tokens(
            corpus_rng, self.document_tokens_mean, sigma, self.num_documents)]
        chosen = zipf_choice(request_rng, self.num_documents, self.document_zipf, n)
        questions = lognormal_tokens(request_rng, self.question_tokens_mean, sigma, n)
        prompts = [[system, documents[d], (next_content(), int(q))]
                   for d, q in zip(chosen.tolist(), questions.tolist())]
        outputs = lognormal_tokens(request_rng, self.output_tokens_mean, sigma, n)
        arrivals = poisson_arrivals(arrivals_rng, self.request_rate_per_s, n)
        return independent_requests(arrivals, prompts, outputs, next_content)
