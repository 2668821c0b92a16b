"""Replicas in turn, regardless of load."""
from __future__ import annotations


class RoundRobin:
    reads_kv_state = False
    reads_replica_state = False  # cluster.router_staleness_s has nothing to delay

    def __init__(self):
        self._next = 0

    def __call__(self, replicas, request) -> int:
        choice = self._next % len(replicas)
        self._next += 1
        return choice
