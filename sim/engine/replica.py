"""One replica: a model on a TP group with one KV pool, stepping as a SimPy process.

Each step: the scheduler plans a batch against the allocator, the latency model times it,
the process waits that long (one SimPy event), then the plan is committed and the memory
breakdown sampled.
"""
from __future__ import annotations

from typing import Callable

import simpy

from sim.latency.model import LatencyModel
from sim.scheduler import Scheduler, Sequence


class Replica:
    def __init__(self, env: simpy.Environment, index: int, scheduler: Scheduler,
                 latency: LatencyModel, recorder, on_finish: Callable[[Sequence], None]):
        self.env, self.index, self.scheduler, self.latency = env, index, scheduler, latency
        self.recorder, self.on_finish = recorder, on_finish
        self._wakeup: simpy.Event | None = None
        self.process = env.process(self._loop())

    def submit(self, seq: Sequence) -> None:
        seq.replica = self.index
        self.scheduler.add(seq)
        if self._wakeup is not None and not self._wakeup.triggered:
            self._wakeup.succeed()

    def _loop(self):
        env, scheduler = self.env, self.scheduler
        num_empty_plans = 0
        while True:
            if not scheduler.has_work():
                self._wakeup = env.event()
                yield self._wakeup
                self._wakeup = None
                continue
            plan = scheduler.schedule()
            if not plan.scheduled:
                # Only after a step that preempted every running sequence; the next plan admits.
                num_empty_plans += 1
                if num_empty_plans > 1:
                    raise RuntimeError(f"replica {self.index} cannot schedule its waiting queue")
                continue
            num_empty_plans = 0
            yield env.timeout(self.latency.step_time(plan.shape))
            finished = scheduler.commit(plan, env.now)
            self.recorder.record_step(self.index, env.now, plan, scheduler)
            for seq in finished:
                self.on_finish(seq)
