"""Continuous batching (vLLM v1 style): pure planning over an allocator, no SimPy."""
from sim.scheduler.scheduler import Scheduler, SchedulerSpec, StepPlan
from sim.scheduler.sequence import Sequence

__all__ = ["Scheduler", "SchedulerSpec", "StepPlan", "Sequence"]
