"""What a replica reports: plain frozen records, one per step or per decode stretch.

The recorder (sim.recorder) only appends them; nothing downstream reads a scheduler or an
allocator. A stretch stands for consecutive decode-only steps of one unchanged batch (see
sim.scheduler.scheduler) as that many step records would, in columns: every sequence of the batch
is running and decodes one token a step, so batch size, batched tokens, running sequences and
output tokens are all batch_size, and nothing is preempted or swapped.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.kvcache.base import KVUsage


@dataclass(frozen=True, slots=True)
class StepRecord:
    replica: int
    time_s: float                   # when the step ended
    usage: KVUsage                  # the pool's breakdown after the step
    batch_size: int                 # sequences scheduled
    num_batched_tokens: int
    num_running: int                # after the step
    num_waiting: int
    num_preempted: int = 0
    num_swapped_tokens: int = 0     # moved over the host link
    num_output_tokens: int = 0      # sampled, forked samples included
    itl: tuple[tuple[float, int], ...] = ()  # (gap_s, count) of the tokens sampled


@dataclass(frozen=True, slots=True)
class StretchRecord:
    """len(times_s) decode steps of batch_size sequences, one token each per step (in arrays)."""
    replica: int
    times_s: np.ndarray     # each step's end
    usage: np.ndarray       # each step's KVUsage.as_tuple(), one row per step
    capacity: int
    batch_size: int
    num_waiting: np.ndarray  # after each step
    itl: np.ndarray         # rows (time_s, gap_s, count) over the steps
