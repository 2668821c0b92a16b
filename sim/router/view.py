"""What a router may read of a replica: its loads and its prefix cache.

A router never touches a replica's scheduler or allocator, only these figures. With
`cluster.router_staleness_s` > 0 the loads are those of the last refresh, taken when a routing
decision finds them older than that (a router polling the engines' metrics): the decisions in
between see the same loads, however many requests they send meanwhile; and the prefix cache is
the HBM cache as its KV events describe it staleness_s late (llm-d's precise scorer follows the
engines' KV events; a block keyed or evicted counts once that old). Live, the cache view also
counts the replica's own CPU and disk tiers.
"""
from __future__ import annotations

from collections import deque
from itertools import takewhile

from sim.errors import ConfigError
from sim.kvcache.block_pool import BlockPool
from sim.kvcache.hybrid_prefix import HybridPrefixAllocator
from sim.kvcache.sized_pages import SizedPrefixAllocator
from sim.kvcache.radix import RadixAllocator

LOAD_METRICS = ("requests", "waiting", "queued_tokens", "kv_use")


def check_metric(metric: str, where: str) -> str:
    if metric not in LOAD_METRICS:
        raise ConfigError(f"unknown load metric '{metric}', {where}, use one of {', '.join(LOAD_METRICS)}")
    return metric


class ReplicaView:
    """A replica's figures now."""
    __slots__ = ("index", "_scheduler")

    def __init__(self, replica):
        self.index, self._scheduler = replica.index, replica.scheduler

    def load(self, metric: str) -> float:
        """requests: running, waiting and swapped; waiting: queued requests; queued_tokens:
        tokens not yet computed (whole waiting sequences, the rest of prefills, one per
        decoding sequence); kv_use: share of the KV pool's slots in use (not free, not idle
        cached)."""
        scheduler = self._scheduler
        if metric == "requests":
            return scheduler.load
        if metric == "waiting":
            return scheduler.num_waiting
        if metric == "queued_tokens":
            return scheduler.queued_tokens
        usage = scheduler.allocator.usage()
        return 1.0 - (usage.free + usage.cached_idle) / usage.capacity

    def cached_prefix_tokens(self, request) -> int:
        """Leading prompt tokens of request that this replica's cache holds now."""
        return self._scheduler.allocator.cached_prefix_tokens(request)


class StaleReplicaView(ReplicaView):
    """Each load as of its last refresh, at most staleness_s old when read; the cache from KV
    events staleness_s late."""
    __slots__ = ("_env", "_staleness_s", "_loads", "_cache")

    def __init__(self, replica, env, staleness_s: float, track_cache: bool = False):
        super().__init__(replica)
        self._env, self._staleness_s = env, staleness_s
        self._loads: dict[str, tuple[float, float]] = {}  # metric -> (value, when read)
        self._cache = DelayedCacheIndex(replica.scheduler.allocator, env, staleness_s) if track_cache else None

    def cached_prefix_tokens(self, request) -> int:
        return self._cache.cached_prefix_tokens(request) if self._cache is not None else 0

    def load(self, metric: str) -> float:
        now = self._env.now
        value, taken_s = self._loads.get(metric, (0.0, -float("inf")))
        if now - taken_s >= self._staleness_s:
            value = ReplicaView.load(self, metric)
            self._loads[metric] = (value, now)
        return value


class DelayedCacheIndex:
    """A replica's cached block keys as its KV events report them, staleness_s late. An
    allocator that caches nothing (contiguous, paged without caching) reports nothing."""

    def __init__(self, allocator, env, staleness_s: float):
        self._env, self._staleness_s = env, staleness_s
        self._events: deque[tuple[float, int, bool]] = deque()  # (when, key, keyed or evicted)
        self._known: set[int] = set()
        self.block_size = getattr(allocator, "block_size", 1)
        if isinstance(allocator, (RadixAllocator, HybridPrefixAllocator, SizedPrefixAllocator)):
            raise ConfigError(f"cluster.router_staleness_s with a router reading the replicas' caches takes the "
                              f"paged and prefix allocators only ({type(allocator).__name__} sends no KV events "
                              f"here), key cluster.router_staleness_s, set it to 0 or use router.index=approximate")
        pool = getattr(allocator, "pool", None)
        if not isinstance(pool, BlockPool):
            return  # no prefix cache (contiguous): nothing to report
        pool.observe(evicted=lambda key: self._events.append((env.now, key, False)),
                     keyed=lambda keys: self._events.extend((env.now, key, True) for key in keys))

    def cached_prefix_tokens(self, request) -> int:
        events, known, horizon = self._events, self._known, self._env.now - self._staleness_s
        while events and events[0][0] <= horizon:
            _, key, keyed = events.popleft()
            if keyed:
                known.add(key)
            else:
                known.discard(key)
        if not known:
            return 0
        keys = request.prefix_keys(self.block_size, 0, (request.prompt_len - 1) // self.block_size)
        return sum(1 for _ in takewhile(known.__contains__, keys)) * self.block_size


def least_loaded(replicas, metric: str) -> int:
    """The replica with the lowest load; ties go to the lowest index."""
    loads = [replica.load(metric) for replica in replicas]
    return loads.index(min(loads))
