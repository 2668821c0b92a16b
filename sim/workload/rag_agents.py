"""rag_agents: tool-using agent sessions over a retrieval corpus.

A session belongs to one of several applications. Its first prompt is the application's system
prompt and tool definitions (shared by every session of that application), then documents
retrieved from a corpus with Zipf popularity, then the task. Each later turn's prompt is the
previous prompt, the model's previous output and a tool result, and arrives a tool/think delay
after the previous turn finished. Sessions arrive as a Poisson process.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.errors import ConfigError
from sim.workload.request import PrefixInterner, Session, Workload, make_request
from sim.workload.sampling import lognormal_tokens, off_grid, poisson_arrivals, zipf_choice

@dataclass(frozen=True, slots=True)
class RagAgentsSpec:
    num_sessions: int
    session_rate_per_s: float
    num_applications: int
    application_zipf: float
    system_prompt_tokens_mean: float
    tool_definitions_tokens_mean: float
    corpus_size: int
    corpus_zipf: float
    docs_per_prompt: int
    doc_tokens_mean: float
    task_tokens_mean: float
    turns_per_session_mean: float
    max_turns_per_session: int
    output_tokens_mean: float
    tool_result_tokens_mean: float
    think_time_s_mean: float
    length_sigma: float

    def __post_init__(self):
        for name in ("num_sessions", "num_applications", "corpus_size", "max_turns_per_session"):
            if getattr(self, name) < 1:
                raise ConfigError(f"scenario.{name} must be at least 1, key scenario.{name}, "
                                  f"set a positive integer")
        if self.session_rate_per_s <= 0 or self.turns_per_session_mean < 1:
            raise ConfigError("scenario.session_rate_per_s must be > 0 and turns_per_session_mean"
                              " >= 1, scenario rag_agents, fix the values")

    def generate(self, seed: int) -> Workload:
        return generate(self, seed)


def generate(spec: RagAgentsSpec, seed: int) -> Workload:
    arrivals_rng, apps_rng, corpus_rng, session_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(4))
    sigma = spec.length_sigma
    next_content = iter(range(1, 1 << 62)).__next__
    system = [(next_content(), off_grid(int(n))) for n in
              lognormal_tokens(apps_rng, spec.system_prompt_tokens_mean, sigma, spec.num_applications)]
    tools = [(next_content(), off_grid(int(n))) for n in
             lognormal_tokens(apps_rng, spec.tool_definitions_tokens_mean, sigma, spec.num_applications)]
    docs = [(next_content(), off_grid(int(n))) for n in
            lognormal_tokens(corpus_rng, spec.doc_tokens_mean, sigma, spec.corpus_size)]

    arrival_times = poisson_arrivals(arrivals_rng, spec.session_rate_per_s, spec.num_sessions)
    session_apps = zipf_choice(apps_rng, spec.num_applications, spec.application_zipf, spec.num_sessions)
    interner, sessions, request_id = PrefixInterner(), [], 0
    for session_id in range(spec.num_sessions):
        app = int(session_apps[session_id])
        num_docs = min(spec.docs_per_prompt, spec.corpus_size)
        retrieved = zipf_choice(session_rng, spec.corpus_size, spec.corpus_zipf, num_docs)
        segments = [system[app], tools[app], *(docs[int(d)] for d in retrieved),
                    (next_content(), int(lognormal_tokens(session_rng, spec.task_tokens_mean, sigma)))]
        num_turns = min(spec.max_turns_per_session,
                        int(session_rng.geometric(1.0 / spec.turns_per_session_mean)))
        turns = []
        for turn in range(num_turns):
            output_len = int(lognormal_tokens(session_rng, spec.output_tokens_mean, sigma))
            think = 0.0 if turn == 0 else float(session_rng.exponential(spec.think_time_s_mean))
            request = make_request(interner, request_id, segments, output_len, next_content(),
                                   session_id=session_id, turn=turn, think_time_s=think)
            turns.append(request)
            request_id += 1
            tool_result = int(lognormal_tokens(session_rng, spec.tool_result_tokens_mean, sigma))
            segments = [*segments, (request.output_content_id, output_len), (next_content(), tool_result)]
        sessions.append(Session(session_id, float(arrival_times[session_id]), tuple(turns)))
    return Workload(tuple(sessions), prefix_tree=interner.tree)
