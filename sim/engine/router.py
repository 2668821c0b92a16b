"""Routing policies: pick the replica for a newly arrived request (injected via Hydra _target_)."""
from __future__ import annotations


class RoundRobin:
    """Replicas in turn, regardless of load."""

    def __init__(self):
        self._next = 0

    def __call__(self, replicas, request) -> int:
        choice = self._next % len(replicas)
        self._next += 1
        return choice


class LeastLoaded:
    """The replica with the fewest running plus waiting sequences; ties go to the lowest index."""

    def __call__(self, replicas, request) -> int:
        loads = [r.scheduler.load for r in replicas]
        return loads.index(min(loads))
