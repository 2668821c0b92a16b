"""SGLang's cache-aware router (sgl-model-gateway's `cache_aware` policy; defaults from its
documentation, docs/concepts/routing/cache-aware.md: cache_threshold 0.3, balance_abs_threshold
64, balance_rel_threshold 1.5), loads in requests (running + waiting):

- imbalanced (max load - min load > balance_abs_threshold and max load > balance_rel_threshold x
  min load): the least loaded replica;
- otherwise the replica holding the longest prefix of the prompt, when that prefix is more than
  cache_threshold of the prompt (ties: least loaded, then lowest index);
- otherwise the least loaded replica.

Prefixes come from sim.router.prefix_index (precise: the replicas' caches; approximate: the
router's own record of what it sent where).
"""
from __future__ import annotations

from sim.errors import ConfigError
from sim.router.prefix_index import PrefixIndex
from sim.router.view import least_loaded


class PrefixAware:
    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: float = 64,
                 balance_rel_threshold: float = 1.5, index: str = "precise", block_size: int = 16,
                 index_capacity_tokens: int | None = None):
        if not 0 <= cache_threshold <= 1:
            raise ConfigError(f"router.cache_threshold={cache_threshold} is not a share of the prompt, "
                              f"key router.cache_threshold, use 0 to 1 (SGLang's default 0.3)")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold, self.balance_rel_threshold = balance_abs_threshold, balance_rel_threshold
        self.index = PrefixIndex(index, block_size, index_capacity_tokens)
        self.reads_kv_state = self.index.precise

    def __call__(self, replicas, request) -> int:
        choice = self._choose(replicas, request)
        self.index.record(choice, request)
        return choice

    def _choose(self, replicas, request) -> int:
        loads = [replica.load("requests") for replica in replicas]
        low, high = min(loads), max(loads)
        if high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low:
            return loads.index(low)
        matched = self.index.matched_tokens(replicas, request)
        best = min(range(len(replicas)), key=lambda i: (-matched[i], loads[i], i))
        if matched[best] > self.cache_threshold * request.prompt_len:
            return best
        return least_loaded(replicas, "requests")
