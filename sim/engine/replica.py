"""One replica: a model on a TP group with one KV pool, stepping as a SimPy process.

Each step: the scheduler plans a batch against the allocator, the latency model times it, the
process waits that long, then the plan is committed and a step record appended. A plan that
starts a decode stretch (sim.scheduler.scheduler) waits once for all of the stretch's steps: an
event per change of the batch, not per step. A request submitted meanwhile to an empty queue cuts
the stretch at the end of the step in progress, where the step-by-step loop would first see it;
one queued behind a blocked head only counts as waiting from then on. A submit at exactly a
step's end time counts after that step, as SimPy orders an event created at that instant after
the step's end, queued when the step began. `step_exact=True` keeps one event per step; both
give the same results (docs/design.md says the one exception: a submit whose event was queued
before the step began, at exactly its end time).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import simpy

from sim.engine.clock import Environment
from sim.engine.records import StepRecord, StretchRecord
from sim.latency.model import LatencyModel
from sim.scheduler import Scheduler, Sequence, StepPlan


class Replica:
    def __init__(self, env: Environment, index: int, scheduler: Scheduler,
                 latency: LatencyModel, recorder, on_finish: Callable[[Sequence], None],
                 step_exact: bool = False):
        self.env, self.index, self.scheduler, self.latency = env, index, scheduler, latency
        self.recorder, self.on_finish, self.step_exact = recorder, on_finish, step_exact
        self._wakeup: simpy.Event | None = None
        self._stretch_ends: np.ndarray | None = None    # the stretch in progress: each step's end
        self._stretch_steps = 0                         # steps it runs (cut short by a submit)
        self._stretch_open = False                      # whether the queue was empty (a submit cuts)
        self._stretch_submits: list[float] = []         # when requests queued behind a blocked head
        self.kv_load_wait_s = 0.0  # step time spent on KV tier loads (sim.kvcache.tiers)
        self.step_started_s = 0.0  # when the step (or stretch) in progress began
        self.process = env.process(self._loop())

    def submit(self, seq: Sequence) -> None:
        seq.replica = self.index
        self.scheduler.add(seq)
        if self._wakeup is not None and not self._wakeup.triggered:
            self._wakeup.succeed()
        elif self._stretch_ends is not None:
            if not self._stretch_open:
                self._stretch_submits.append(self.env.now)
                return
            # The step in progress; at exactly a step's end, the next one (see the module's doc).
            step = int(np.searchsorted(self._stretch_ends, self.env.now, side="right")) + 1
            if step < self._stretch_steps:
                self._stretch_steps = step
                self.process.interrupt()

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
            if not plan.batch_size:
                # Only after a step that preempted every running sequence; the next plan admits.
                num_empty_plans += 1
                if num_empty_plans > 1:
                    raise RuntimeError(f"replica {self.index} cannot schedule its waiting queue")
                continue
            num_empty_plans = 0
            self.step_started_s = env.now
            steps = 1 if self.step_exact else scheduler.decode_stretch(plan)
            if steps > 1:
                plan = yield from self._decode_stretch(plan, steps)
            else:
                if plan.shape.kv_load_s:
                    self.kv_load_wait_s += self.latency.breakdown(plan.shape)["kv_load"]
                yield env.timeout(self.latency.step_time(plan.shape))
            self._commit(plan)

    def _commit(self, plan: StepPlan) -> None:
        scheduler, now = self.scheduler, self.env.now
        committed = scheduler.commit(plan, now)
        self.recorder.append_step(StepRecord(
            self.index, now, scheduler.usage(), plan.batch_size, plan.shape.num_tokens,
            len(scheduler.running), scheduler.num_waiting, plan.num_preempted,
            plan.shape.swap_tokens, committed.num_sampled, committed.itl))
        for seq in committed.finished:
            self.on_finish(seq)

    def _decode_stretch(self, plan: StepPlan, steps: int):
        """Wait out up to `steps` decode steps of the plan's batch; commit all but the last and
        return the last one's plan."""
        env, scheduler = self.env, self.scheduler
        num_seqs = plan.shape.num_decode_seqs
        contexts = plan.shape.decode_context_tokens + num_seqs * np.arange(steps)
        durations = self.latency.decode_step_times(num_seqs, contexts)
        # Each step's end as the step-by-step loop computes it: one addition after another.
        ends = np.cumsum(np.concatenate(([env.now], durations)))[1:]
        self._stretch_ends, self._stretch_steps = ends, steps
        num_waiting = scheduler.num_waiting
        self._stretch_open, self._stretch_submits = num_waiting == 0, []
        while True:
            try:
                yield env.timeout_at(float(ends[self._stretch_steps - 1]))
                break
            except simpy.Interrupt:  # a submit cut the stretch: wait for the new last step
                continue
        done, self._stretch_ends = self._stretch_steps, None
        if done == 1:
            return plan
        silent_ends = ends[:done - 1]
        itl, usage = scheduler.advance_decode(silent_ends, num_waiting)
        # Requests queued behind the blocked head, in time order; one at a step's end counts after.
        waiting = num_waiting + np.searchsorted(self._stretch_submits, silent_ends, side="left")
        self.recorder.append_stretch(StretchRecord(
            self.index, silent_ends, usage, scheduler.capacity, num_seqs, waiting, itl))
        return scheduler.decode_plan(int(contexts[done - 1]))
