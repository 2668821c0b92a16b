"""A replica drawn uniformly at random, from the run's seed (its own stream)."""
from __future__ import annotations

import numpy as np

ROUTER_STREAM = 0x524F5554  # spawn key of the router's stream, apart from the workload's


def router_rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(ROUTER_STREAM,)))


class RandomChoice:
    reads_kv_state = False
    reads_replica_state = False  # cluster.router_staleness_s has nothing to delay

    def __init__(self, seed: int = 0):
        self._rng = router_rng(seed)

    def __call__(self, replicas, request) -> int:
        return int(self._rng.integers(len(replicas)))
