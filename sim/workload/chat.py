"""chat: multi-turn conversations whose history grows each turn.

Turn 1 prompt = [system prompt (one of a few, shared by all sessions that use it)][user message];
turn k+1 prompt = turn k prompt + turn k answer + a new user message, a think time later.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.errors import ConfigError
from sim.workload.request import PrefixInterner, Session, Workload, make_request
from sim.workload.sampling import lognormal_tokens, off_grid, poisson_arrivals, zipf_choice


@dataclass(frozen=True, slots=True)
class ChatSpec:
    num_sessions: int
    session_rate_per_s: float
    num_system_prompts: int
    system_prompt_tokens_mean: float
    user_tokens_mean: float
    output_tokens_mean: float
    turns_per_session_mean: float
    max_turns_per_session: int
    think_time_s_mean: float
    length_sigma: float

    def __post_init__(self):
        if min(self.num_sessions, self.num_system_prompts, self.max_turns_per_session) < 1 \
                or self.session_rate_per_s <= 0 or self.turns_per_session_mean < 1:
            raise ConfigError("chat needs num_sessions, num_system_prompts, max_turns_per_session >= 1, "
                              "session_rate_per_s > 0 and turns_per_session_mean >= 1, scenario chat, "
                              "fix the values")

    def generate(self, seed: int) -> Workload:
        arrivals_rng, prompts_rng, session_rng = (np.random.default_rng(s)
                                                   for s in np.random.SeedSequence(seed).spawn(3))
        next_content = iter(range(1, 1 << 62)).__next__
        sigma = self.length_sigma
        systems = [(next_content(), off_grid(int(n))) for n in lognormal_tokens(
            prompts_rng, self.system_prompt_tokens_mean, sigma, self.num_system_prompts)]
        arrivals = poisson_arrivals(arrivals_rng, self.session_rate_per_s, self.num_sessions)
        choices = zipf_choice(prompts_rng, self.num_system_prompts, 1.0, self.num_sessions)
        interner, sessions, request_id = PrefixInterner(), [], 0
        for session_id in range(self.num_sessions):
            segments = [systems[int(choices[session_id])]]
            num_turns = min(self.max_turns_per_session,
                            int(session_rng.geometric(1.0 / self.turns_per_session_mean)))
            turns = []
            for turn in range(num_turns):
                user = int(lognormal_tokens(session_rng, self.user_tokens_mean, sigma))
                segments = [*segments, (next_content(), user)]
                output_len = int(lognormal_tokens(session_rng, self.output_tokens_mean, sigma))
                think = float(session_rng.exponential(self.think_time_s_mean)) if turn else 0.0
                request = make_request(interner, request_id, segments, output_len, next_content(),
                                       session_id=session_id, turn=turn, think_time_s=think)
                turns.append(request)
                request_id += 1
                segments = [*segments, (request.output_content_id, output_len)]
            sessions.append(Session(session_id, float(arrivals[session_id]), tuple(turns)))
        return Workload(tuple(sessions), prefix_tree=interner.tree)
