"""SimPy's environment with one addition: a timeout at an absolute time.

A decode stretch knows each step's end as the step-by-step loop computes it (one addition after
another). A relative delay added to the stretch's start cannot reach every such float (with the
start's low bits, some sums round past it), so the stretch's wake-up is queued at the exact time,
as SimPy's own schedule() queues an event (time, priority, id, event). SimPy has no public call
for that, so this writes the queue entry and the triggered state as Timeout.__init__ and
schedule() do (simpy 4's internals; pyproject pins simpy below 5, and tests/test_stretch.py
checks the exact time is reached).
"""
from __future__ import annotations

from heapq import heappush

import simpy
from simpy.core import NORMAL


class Environment(simpy.Environment):
    def timeout_at(self, time_s: float) -> simpy.Event:
        if time_s < self.now:
            raise ValueError(f"time {time_s!r} is before now ({self.now!r})")
        event = simpy.Event(self)
        event._ok, event._value = True, None  # triggered, as Timeout.__init__ leaves it
        heappush(self._queue, (time_s, NORMAL, next(self._eid), event))
        return event
