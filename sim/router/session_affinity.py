"""Every turn of a session goes to the replica its first turn went to (sticky sessions, as a
gateway keyed on a session id keeps them); a first turn goes to the least loaded replica."""
from __future__ import annotations

from sim.router.view import check_metric, least_loaded


class SessionAffinity:
    def __init__(self, metric: str = "requests"):
        self.metric = check_metric(metric, "key router.metric")
        self.reads_kv_state = metric == "kv_use"
        self._home: dict[int, int] = {}  # session id -> replica

    def __call__(self, replicas, request) -> int:
        home = self._home.get(request.session_id)
        if home is None:
            home = self._home[request.session_id] = least_loaded(replicas, self.metric)
        return home
