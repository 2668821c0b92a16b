"""code_completion: IDE completions. Each project has a repository context (shared by every
request of the project) and a few open files; a request is [repository context][file][the edit
at the cursor, unique], asking for a short completion. Projects have Zipf popularity."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.errors import ConfigError
from sim.workload.request import Workload, independent_requests
from sim.workload.sampling import lognormal_tokens, off_grid, poisson_arrivals, zipf_choice


@dataclass(frozen=True, slots=True)
class CodeCompletionSpec:
    num_requests: int
    request_rate_per_s: float
    num_projects: int
    project_zipf: float
    files_per_project: int
    repo_context_tokens_mean: float
    file_tokens_mean: float
    edit_tokens_mean: float
    output_tokens_mean: float
    length_sigma: float

    def __post_init__(self):
        if min(self.num_requests, self.num_projects, self.files_per_project) < 1 or self.request_rate_per_s <= 0:
            raise ConfigError("code_completion needs num_requests, num_projects, files_per_project >= 1 "
                              "and request_rate_per_s > 0, scenario code_completion, fix the values")

    def generate(self, seed: int) -> Workload:
        arrivals_rng, corpus_rng, request_rng = (np.random.default_rng(s)
                                                  for s in np.random.SeedSequence(seed).spawn(3))
        next_content = iter(range(1, 1 << 62)).__next__
        sigma, n = self.length_sigma, self.num_requests
        repos = [(next_content(), off_grid(int(t))) for t in lognormal_tokens(
            corpus_rng, self.repo_context_tokens_mean, sigma, self.num_projects)]
        files = [[(next_content(), off_grid(int(t))) for t in lognormal_tokens(
            corpus_rng, self.file_tokens_mean, sigma, self.files_per_project)] for _ in repos]
        projects = zipf_choice(request_rng, self.num_projects, self.project_zipf, n)
        which_file = request_rng.integers(self.files_per_project, size=n)
        edits = lognormal_tokens(request_rng, self.edit_tokens_mean, sigma, n)
        prompts = [[repos[p], files[p][f], (next_content(), int(e))]
                   for p, f, e in zip(projects.tolist(), which_file.tolist(), edits.tolist())]
        outputs = lognormal_tokens(request_rng, self.output_tokens_mean, sigma, n)
        arrivals = poisson_arrivals(arrivals_rng, self.request_rate_per_s, n)
        return independent_requests(arrivals, prompts, outputs, next_content)
