"""The cluster: session arrivals, routing, follow-up turns after think time, and a benchmark
client's cap on requests in flight (a request over the cap waits, and its latency counts from
when it is sent, as `vllm bench serve` measures it). A request reaches its replica's scheduler
`serving_overhead_s` after it arrives (the API server, tokenisation and detokenisation, lumped
before the engine), so TTFT and E2E include that overhead and TPOT does not."""
from __future__ import annotations

from collections import deque

import simpy

from sim.router.view import ReplicaView, StaleReplicaView
from sim.scheduler import Sequence
from sim.workload.request import Session, Workload


class Cluster:
    def __init__(self, env: simpy.Environment, router, recorder, max_model_len: int,
                 serving_overhead_s: float = 0.0, router_staleness_s: float = 0.0):
        self.env, self.router, self.recorder, self.max_model_len = env, router, recorder, max_model_len
        self.serving_overhead_s = serving_overhead_s
        self.router_staleness_s = router_staleness_s
        self.replicas = []
        self._views = []  # what the router reads of each replica (sim.router.view)
        self.on_progress = lambda now: None  # called once per request served or rejected
        self._sessions: dict[tuple[int, int], Session] = {}
        self._samples: dict[int, list[Sequence]] = {}  # request id -> finished samples so far
        self.max_concurrency: int | None = None
        self._in_flight = 0
        self._held: deque[tuple[Session, int, float]] = deque()  # over the cap, in arrival order
        self.num_held_requests = 0   # requests that waited at the client for a free slot
        self.held_time_s = 0.0       # their waits, summed

    def add_replica(self, replica) -> None:
        self.replicas.append(replica)
        if self.router_staleness_s:
            reads_cache = getattr(getattr(self.router, "index", None), "precise", False)
            self._views.append(StaleReplicaView(replica, self.env, self.router_staleness_s, reads_cache))
        else:
            self._views.append(ReplicaView(replica))

    def start(self, workload: Workload) -> None:
        self.max_concurrency = workload.max_concurrency
        self.env.process(self._arrivals(workload.in_arrival_order()))

    def _arrivals(self, sessions):
        """Sessions as they arrive; each is held here from its first turn until its last
        finishes (what a streamed workload keeps in memory)."""
        env = self.env
        for session in sessions:
            if session.arrival_time_s > env.now:
                yield env.timeout(session.arrival_time_s - env.now)
            self._sessions[session.session_id, session.chain] = session
            self._submit(session, 0)

    def _submit(self, session: Session, turn: int) -> None:
        if self.max_concurrency is not None:
            if self._in_flight >= self.max_concurrency:
                self._held.append((session, turn, self.env.now))
                return
            self._in_flight += 1
        request = session.turns[turn]
        if request.prompt_len > self.max_model_len:
            # vLLM rejects such a prompt at once; the client goes on with its next turn.
            self.recorder.append_rejected(request, self.env.now)
            self.on_progress(self.env.now)
            self._release()
            self._next_turn(session, turn + 1)
            return
        seq = Sequence(request, self.env.now, self.max_model_len)
        if self.serving_overhead_s:
            delay = self.env.timeout(self.serving_overhead_s)
            delay.callbacks.append(lambda _event: self._route(seq))
        else:
            self._route(seq)

    def _route(self, seq: Sequence) -> None:
        self.replicas[self.router(self._views, seq.request)].submit(seq)

    def on_finish(self, seq: Sequence) -> None:
        """A sample finished; a request is done when all of its n samples are."""
        samples = [seq]
        if seq.request.n > 1:
            samples = self._samples.setdefault(seq.request.request_id, [])
            samples.append(seq)
            if len(samples) < seq.request.n:
                return
            del self._samples[seq.request.request_id]
        self.recorder.append_finished(samples)
        self.on_progress(self.env.now)
        self._release()
        self._next_turn(self._sessions[seq.request.session_id, seq.request.chain], seq.request.turn + 1)

    def _next_turn(self, session: Session, turn: int) -> None:
        if turn < len(session.turns):
            delay = self.env.timeout(session.turns[turn].think_time_s)
            delay.callbacks.append(lambda _event: self._submit(session, turn))
        else:
            del self._sessions[session.session_id, session.chain]

    def _release(self) -> None:
        """A request left the client's cap: send the longest-waiting held one."""
        if self.max_concurrency is None:
            return
        self._in_flight -= 1
        if self._held:
            session, turn, since = self._held.popleft()
            self.num_held_requests += 1
            self.held_time_s += self.env.now - since
            self._submit(session, turn)
