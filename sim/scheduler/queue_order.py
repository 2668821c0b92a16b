"""Queue orders within a replica (injected via Hydra `_target_`, scenarios/queue_order/): the
order waiting requests are admitted in, and which running sequence a step preempts.

- fcfs: arrival order, a preempted request back at the front; the newest running sequence is
  preempted (vLLM's default policy).
- priority: lowest `priority` value first, then earliest arrival (vLLM's `--scheduling-policy
  priority`); the running sequence with the highest (priority, arrival) is preempted, as vLLM v1
  does, even one already scheduled in this step (its tokens go back to the budget).
- lpm: longest cached prefix first, ties in arrival order (SGLang's `--schedule-policy lpm`),
  re-sorted before each admission; over 128 waiting requests it falls back to arrival order, as
  SGLang does to bound the cost of matching. Preemption as fcfs.

Orders other than fcfs re-sort the queue as requests arrive or the cache changes, so a replica
with requests waiting steps one step at a time (no decode stretch); `priority` also keeps every
running sequence in its own object (no decode cohort), since its victim can be any of them.
"""
from __future__ import annotations

LPM_MAX_WAITING = 128  # SGLang's schedule_policy: over this many waiting requests, lpm acts as fcfs


class Fcfs:
    reorders = False
    preempts_newest = True

    def order(self, waiting, allocator) -> None:
        pass

    def victim(self, running) -> int:
        return len(running) - 1


class Priority:
    reorders = True
    preempts_newest = False

    def order(self, waiting, allocator) -> None:
        ordered = sorted(waiting, key=_priority_key)
        waiting.clear()
        waiting.extend(ordered)

    def victim(self, running) -> int:
        return max(range(len(running)), key=lambda i: _priority_key(running[i]))


class LongestPrefixMatch:
    reorders = True
    preempts_newest = True

    def order(self, waiting, allocator) -> None:
        if len(waiting) > LPM_MAX_WAITING:
            return
        hits = {seq.seq_id: allocator.lookup_prefix(seq).num_tokens for seq in waiting}
        ordered = sorted(waiting, key=lambda seq: -hits[seq.seq_id])  # stable: arrival order on ties
        waiting.clear()
        waiting.extend(ordered)

    def victim(self, running) -> int:
        return len(running) - 1


def _priority_key(seq) -> tuple:
    return (seq.request.priority, seq.arrival_time_s)
