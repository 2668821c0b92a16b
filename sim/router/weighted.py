"""llm-d's scheduler: a weighted sum of scorers, each in [0, 1], the highest total wins and ties
are drawn at random (its max-score picker). Scorers: prefix (share of the prompt the replica holds
cached, sim.router.prefix_index), queue (waiting requests, min-max scaled: the shortest queue 1,
the longest 0, all 1 when equal) and KV (1 - the share of the pool in use). Default weights
prefix 3 and queue 2 are llm-d's default profile (Red Hat OpenShift AI 3.4, "Configuring scheduler
settings for LLM inference services": queue depth weight 2, prefix cache weight 3); the KV
scorer is off unless given a weight (it reads the pool, so replicas step one step at a time)."""
from __future__ import annotations

from sim.errors import ConfigError
from sim.router.prefix_index import PrefixIndex
from sim.router.random_choice import router_rng


class WeightedScorer:
    def __init__(self, prefix_weight: float = 3.0, queue_weight: float = 2.0, kv_weight: float = 0.0,
                 index: str = "precise", block_size: int = 16, index_capacity_tokens: int | None = None,
                 seed: int = 0):
        weights = {"prefix_weight": prefix_weight, "queue_weight": queue_weight, "kv_weight": kv_weight}
        if min(weights.values()) < 0 or not sum(weights.values()) > 0:
            raise ConfigError(f"router weights {weights}: need weights >= 0, not all 0, "
                              f"key router.prefix_weight, router.queue_weight or router.kv_weight, fix them")
        self.prefix_weight, self.queue_weight, self.kv_weight = prefix_weight, queue_weight, kv_weight
        self.index = PrefixIndex(index, block_size, index_capacity_tokens)
        self.reads_kv_state = (self.index.precise and prefix_weight > 0) or kv_weight > 0
        self._rng = router_rng(seed)

    def __call__(self, replicas, request) -> int:
        scores = [0.0] * len(replicas)
        if self.prefix_weight:
            matched = self.index.matched_tokens(replicas, request)
            scores = [s + self.prefix_weight * m / max(request.prompt_len, 1) for s, m in zip(scores, matched)]
        if self.queue_weight:
            queues = [replica.load("waiting") for replica in replicas]
            low, span = min(queues), max(queues) - min(queues)
            scores = [s + self.queue_weight * (1.0 if not span else 1.0 - (q - low) / span)
                      for s, q in zip(scores, queues)]
        if self.kv_weight:
            scores = [s + self.kv_weight * (1.0 - replica.load("kv_use")) for s, replica in zip(scores, replicas)]
        best = max(scores)
        tied = [i for i, score in enumerate(scores) if score == best]
        choice = tied[0] if len(tied) == 1 else tied[int(self._rng.integers(len(tied)))]
        self.index.record(choice, request)
        return choice
