"""What a router may read of a replica: its loads and its prefix cache.

A router never touches a replica's scheduler or allocator, only these figures. With
`cluster.router_staleness_s` > 0 the loads are those of the last refresh, taken when a routing
decision finds them older than that (a router polling the engines' metrics): the decisions in
between see the same loads, however many requests they send meanwhile. The prefix cache is read
live (llm-d's precise scorer follows the engines' KV events).
"""
from __future__ import annotations

from sim.errors import ConfigError

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
    """Each load as of its last refresh, at most staleness_s old when read; the cache live."""
    __slots__ = ("_env", "_staleness_s", "_loads")

    def __init__(self, replica, env, staleness_s: float):
        super().__init__(replica)
        self._env, self._staleness_s = env, staleness_s
        self._loads: dict[str, tuple[float, float]] = {}  # metric -> (value, when read)

    def load(self, metric: str) -> float:
        now = self._env.now
        value, taken_s = self._loads.get(metric, (0.0, -float("inf")))
        if now - taken_s >= self._staleness_s:
            value = ReplicaView.load(self, metric)
            self._loads[metric] = (value, now)
        return value


def least_loaded(replicas, metric: str) -> int:
    """The replica with the lowest load; ties go to the lowest index."""
    loads = [replica.load(metric) for replica in replicas]
    return loads.index(min(loads))
