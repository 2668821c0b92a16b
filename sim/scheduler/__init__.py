"""Continuous batching (vLLM v1 style): pure planning over an allocator, no SimPy."""
from sim.scheduler.scheduler import Committed, Scheduler, SchedulerSpec, StepPlan
from sim.scheduler.sequence import Sequence

__all__ = ["Committed", "Scheduler", "SchedulerSpec", "StepPlan", "Sequence"]
