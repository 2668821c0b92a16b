"""The replica with the lowest load by one metric (sim.router.view.ReplicaView.load); ties go to
the lowest index. `requests` (running + waiting) is vLLM production-stack's and SGLang's
load-balancing default; `kv_use` reads the KV pool (so replicas step one step at a time)."""
from __future__ import annotations

from sim.router.view import check_metric, least_loaded


class LeastLoaded:
    def __init__(self, metric: str = "requests"):
        self.metric = check_metric(metric, "key router.metric")
        self.reads_kv_state = metric == "kv_use"

    def __call__(self, replicas, request) -> int:
        return least_loaded(replicas, self.metric)
