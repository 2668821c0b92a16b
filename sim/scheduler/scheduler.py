"""vLLM-style continuous batching planner.

Each step has one token budget (max_num_batched_tokens) and at most max_num_seqs sequences.
Running sequences are served first, in admission order; one that cannot get memory preempts the
newest running sequence, possibly itself. With preemption_mode=recompute (vLLM v1) its KV is
freed and it goes to the front of the waiting queue; with swap (vLLM v0) its KV moves to a CPU
pool over the host link, if that pool has room, and comes back before any waiting request is
admitted. Waiting sequences are admitted in queue order (sim.scheduler.queue_order: FCFS by
default, or priority, or longest prefix match) only in steps without a preemption; the head of
the queue blocks the rest when it does not fit. Admission follows vLLM v1 as of 0.11+
(SchedulerConfig.scheduler_reserve_full_isl, default true): a waiting request is admitted only
when its whole current sequence fits (after its prefix hit), even if only a first chunk is
scheduled; `watermark` keeps that share of the pool free when admitting while others run
(vLLM v1: applied to waiting and preempted requests when any request runs; default 0).
With reserve_full_isl=false, a first chunk that fits admits (vLLM v1 before the option).
With guaranteed_no_evict (TensorRT-LLM's default capacity policy, GUARANTEED_NO_EVICT) a request
is admitted only when the blocks of every admitted sequence's whole length (prompt plus
output, to max_model_len) and its own fit in the pool, so that no sequence is ever preempted:
TensorRT-LLM's capacity scheduler reserves each running request's blocks to completion
(tensorrt_llm SchedulerConfig.capacity_scheduler_policy). With chunked prefill a prompt is split
across steps to fit the budget; without it a prompt is scheduled whole. A request with n > 1
forks its other samples once its prompt is computed (they share the prompt's KV).

Decode stretches: when a plan only decodes every running sequence and nothing can join (no
waiting request, or a head of queue that stays blocked while the batch only grows), the next
steps repeat it with one more token each until the first sequence finishes or memory for a next
token runs out. `decode_stretch` says how many steps that is; `advance_decode` commits all but
the last of them at once (the allocator's `decode_rounds` allocating their tokens; the last is
committed as usual), with the same effects, token by token, as committing them one by one.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from sim.kv_layout import decode_reach, indexer_keys, indexer_pairs, prefill_reach
from sim.kvcache.base import NO_HIT, PrefixHit
from sim.latency.model import BatchShape
from sim.scheduler.cohort import DecodeCohort, stretch_gap_rows
from sim.scheduler.queue_order import Fcfs
from sim.scheduler.reservations import Reservations
from sim.scheduler.sequence import Sequence

FIRST_SIBLING_ID = 1 << 40  # sibling sequence ids never meet request ids
# A decode cohort forms from this many running sequences and dissolves below half of it: over
# fewer, numpy's cost per call exceeds Python's per sequence (benchmarks/README.md).
COHORT_MIN_SEQS = 32


@dataclass(frozen=True, slots=True)
class SchedulerSpec:
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    max_model_len: int
    preemption_mode: str = "recompute"
    swap_space_tokens: int = 0
    reserve_full_isl: bool = True
    watermark: float = 0.0
    guaranteed_no_evict: bool = False
    # A model whose layers read different parts of the context (sliding, chunked-local, DSA): its
    # layer groups, so that each step's shape carries what each group reads (BatchShape.
    # group_attention); such a batch is planned sequence by sequence (no decode cohort).
    attention_groups: tuple = ()
    # Data-parallel attention: a sequence lives on one rank, so its chunk in a step is at most one
    # rank's token budget (max_num_batched_tokens is the ranks' together). 0: the step's budget.
    max_chunk_tokens: int = 0
    # Speculative decoding: a decode step verifies this many draft tokens a sequence (its chunk
    # is 1 + k tokens) and yields acceptance_length tokens a sequence on average.
    num_speculative_tokens: int = 0
    acceptance_length: float = 1.0


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step's batch: the decode cohort's members (one token each, first in the batch), then
    the sequences scheduled one by one with their new tokens."""
    tail: tuple[tuple[Sequence, int], ...]
    shape: BatchShape
    num_preempted: int
    cohort: tuple[Sequence, ...] = ()

    @property
    def batch_size(self) -> int:
        return len(self.cohort) + len(self.tail)

    @property
    def scheduled(self) -> tuple[tuple[Sequence, int], ...]:
        """Every scheduled sequence with its new tokens, in batch order."""
        return tuple((seq, 1) for seq in self.cohort) + self.tail


class Committed(NamedTuple):
    """What a step's commit did: the sequences that finished, the output tokens sampled (forked
    samples included) and the inter-token gaps of those tokens as (gap_s, count) pairs."""
    finished: list
    num_sampled: int
    itl: tuple[tuple[float, int], ...]


# Why the head of the waiting queue was not admitted by the last plan's _admit (stale after a
# plan that skipped it: one that preempted or had swapped sequences, never a stretch's start).
# The first two hold for as long as a batch only decodes (its size and token count are fixed);
# memory holds only where the allocator says so (admission_stays_blocked).
BLOCKED_BY_SEQS, BLOCKED_BY_BUDGET, BLOCKED_BY_MEMORY = "max_num_seqs", "budget", "memory"
BLOCKED_BY_RESERVATION = "reservation"  # guaranteed_no_evict: lifts only when a sequence finishes


class Scheduler:
    def __init__(self, spec: SchedulerSpec, allocator, queue_order=None):
        self.spec, self.allocator = spec, allocator
        self.queue_order = queue_order or Fcfs()
        self.waiting: deque[Sequence] = deque()
        self.swapped: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swap_used_tokens = 0
        self._swap_tokens = 0  # moved over the host link in the step being planned
        self._copied_tokens = 0  # the allocator's KV copies already in a plan
        self._next_sibling_id = FIRST_SIBLING_ID
        self.admission_blocked_by: str | None = None
        # Speculative decoding, summed over the run: verifications, draft tokens verified, tokens
        # the verifications yielded (metrics.json's speculative_decoding block)
        self.num_verifications = self.num_draft_tokens = self.num_verified_tokens = 0
        self._chunk_cap = spec.max_chunk_tokens or spec.max_num_batched_tokens
        step_tokens = spec.max_num_batched_tokens if spec.enable_chunked_prefill else spec.max_model_len
        self._reservations = Reservations(allocator, step_tokens) if spec.guaranteed_no_evict else None
        self._consume_load_s = getattr(allocator, "consume_load_s", None)  # KV tier loads (prefix allocator)
        new_cohort = getattr(allocator, "decode_cohort", None)  # allocators that keep one in arrays
        if spec.attention_groups or not self.queue_order.preempts_newest or spec.num_speculative_tokens:
            new_cohort = None  # per-group reach needs every sequence's context; any may be preempted
        self._cohort = DecodeCohort(new_cohort(), spec.max_model_len) if new_cohort else None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.swapped)

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.swapped)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def queued_tokens(self) -> int:
        """Tokens not yet computed: whole waiting sequences, the rest of prefills, one per
        decoding sequence (exact for cohort members too: their counters lag together)."""
        return sum(seq.num_tokens - seq.num_computed for seq in (*self.waiting, *self.running))

    @property
    def capacity(self) -> int:
        """Token slots of the pool."""
        return self.allocator.capacity

    def usage(self):
        """The pool's memory breakdown, as the next request to get memory sees it."""
        first = self.swapped[0] if self.swapped else (self.waiting[0] if self.waiting else None)
        return self.allocator.usage(first)

    def schedule(self) -> StepPlan:
        budget = self.spec.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        num_preempted = 0
        self._swap_tokens = 0
        running, allocate, victim_of = self.running, self.allocator.allocate, self.queue_order.victim
        cohort = self._step_cohort(budget)
        index = len(cohort)
        budget -= index
        while index < len(running) and budget > 0:
            seq = running[index]
            num_new = min(seq.num_tokens - seq.num_computed, budget, self._chunk_cap)
            if self.spec.num_speculative_tokens and num_new == 1 and seq.num_output:
                num_new += self._drafts(seq, budget)
            while allocate(seq, num_new) is None:
                at = victim_of(running)
                victim = running.pop(at)
                if at < index:  # scheduled earlier in this step (priority order): tokens back
                    position = next(i for i, (other, _) in enumerate(scheduled) if other is victim)
                    budget += scheduled.pop(position)[1]
                    index -= 1
                self._preempt(victim)
                num_preempted += 1
                if victim is seq:
                    break
            else:
                scheduled.append((seq, num_new))
                budget -= num_new
                index += 1
                continue
            break
        if not num_preempted or not (scheduled or cohort):
            budget = self._swap_in(scheduled, budget)
            if not self.swapped:
                if self.queue_order.reorders and self.waiting:
                    self.queue_order.order(self.waiting, self.allocator)
                budget = self._admit(scheduled, budget)
        copied = getattr(self.allocator, "num_copied_tokens", 0)  # forks at the last commit, copy-on-write now
        copy_tokens, self._copied_tokens = copied - self._copied_tokens, copied
        kv_load_s = self._consume_load_s() if self._consume_load_s is not None else 0.0
        shape = _shape(scheduled, self._swap_tokens, copy_tokens, len(cohort), cohort.context_tokens if cohort else 0,
                       self.spec.attention_groups, kv_load_s)
        return StepPlan(tuple(scheduled), shape, num_preempted, tuple(running[:len(cohort)]))

    def _drafts(self, seq: Sequence, budget: int) -> int:
        """Draft tokens a decoding sequence verifies this step: k, fewer near its end (no more
        than the tokens it has left after this step's one, as vLLM caps them) or when the step's
        budget is short."""
        return max(0, min(self.spec.num_speculative_tokens, seq.final_len - seq.num_tokens - 1, budget - 1))

    def accepted(self, seq: Sequence, drafts: int) -> int:
        """Tokens a verification yields: acceptance_length on average, deterministically (the
        n-th verification yields floor(n L) - floor((n - 1) L)), at most drafts + 1 and what the
        sequence may still produce."""
        n, mean = seq.num_verifications, self.spec.acceptance_length
        tokens = math.floor((n + 1) * mean + 1e-9) - math.floor(n * mean + 1e-9)
        left = seq.final_len - seq.num_tokens  # (its output_len and max_model_len both)
        return max(1, min(tokens, drafts + 1, left))

    def _step_cohort(self, budget: int):
        """The decode cohort with this step's tokens allocated, or () when the step goes sequence
        by sequence (after bringing any members' Sequence objects up to date)."""
        cohort = self._cohort
        if cohort is None:
            return ()
        num_running = len(self.running)
        if not cohort and num_running < COHORT_MIN_SEQS:
            return ()
        if cohort.memory.usable() and num_running >= COHORT_MIN_SEQS // 2:
            cohort.extend_from(self.running)
            if len(cohort) and len(cohort) <= budget and cohort.memory.allocate():
                return cohort
        cohort.flush()
        return ()

    def flush(self) -> None:
        """Bring the decode cohort's Sequence objects (and the allocator's records) up to date."""
        if self._cohort is not None:
            self._cohort.flush()

    def _swap_in(self, scheduled: list, budget: int) -> int:
        swapped, running = self.swapped, self.running
        while swapped and budget > 0 and len(running) < self.spec.max_num_seqs:
            seq = swapped[0]
            num_new = min(seq.num_tokens - seq.num_computed, budget, self._chunk_cap)
            if self._reservations is not None and not self._reservations.fits(seq):
                break
            if self.allocator.allocate(seq, seq.num_swapped_tokens + num_new, NO_HIT) is None:
                break
            self._reserve(seq)
            swapped.popleft()
            self._swap_tokens += seq.num_swapped_tokens
            self.swap_used_tokens -= seq.num_swapped_tokens
            seq.num_swapped_tokens = 0
            running.append(seq)
            scheduled.append((seq, num_new))
            budget -= num_new
        return budget

    def _admit(self, scheduled: list, budget: int) -> int:
        waiting, running, allocator = self.waiting, self.running, self.allocator
        self.admission_blocked_by = None
        while waiting:
            if len(running) >= self.spec.max_num_seqs:
                self.admission_blocked_by = BLOCKED_BY_SEQS
                break
            if budget <= 0:
                self.admission_blocked_by = BLOCKED_BY_BUDGET
                break
            seq = waiting[0]
            # KV received from a prefill replica counts as computed, without blocks yet.
            hit = PrefixHit(seq.transferred_tokens) if seq.transferred_tokens else allocator.lookup_prefix(seq)
            num_new = seq.num_tokens - hit.num_tokens
            if num_new > budget:
                if not self.spec.enable_chunked_prefill:
                    # Over the budget after its prefix hit, which evictions may shrink: as memory.
                    self.admission_blocked_by = BLOCKED_BY_MEMORY
                    break
                num_new = budget
            num_new = min(num_new, self._chunk_cap)
            if self._reservations is not None and not self._reservations.fits(seq):
                self.admission_blocked_by = BLOCKED_BY_RESERVATION
                break
            # vLLM v1 admission: the whole current sequence must fit, not only this chunk
            # (scheduler_reserve_full_isl), and the watermark applies once something runs.
            full_tokens = seq.num_tokens if self.spec.reserve_full_isl else 0
            watermark = self.spec.watermark if running else 0.0
            if allocator.allocate(seq, num_new, hit, full_tokens, watermark) is None:
                self.admission_blocked_by = BLOCKED_BY_MEMORY
                break
            self._reserve(seq)
            waiting.popleft()
            seq.num_computed, seq.transferred_tokens = hit.num_tokens, 0
            if not seq.admitted:
                seq.admitted = True
                seq.prefix_hit_tokens = hit.num_tokens
            running.append(seq)
            scheduled.append((seq, num_new))
            budget -= num_new
        return budget

    def _reserve(self, seq: Sequence) -> None:
        if self._reservations is not None:
            self._reservations.take(seq)

    def _free(self, seq: Sequence) -> None:
        """The allocator frees the sequence's blocks, and its reservation ends."""
        self.allocator.free(seq)
        if self._reservations is not None:
            self._reservations.release(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._free(seq)
        seq.num_preemptions += 1
        room = self.spec.swap_space_tokens - self.swap_used_tokens
        if self.spec.preemption_mode == "swap" and 0 < seq.num_computed <= room:
            seq.num_swapped_tokens = seq.num_computed
            self.swap_used_tokens += seq.num_computed
            self._swap_tokens += seq.num_computed
            self.swapped.append(seq)
            return
        seq.num_computed = 0  # recompute (also when the CPU pool is full)
        self.waiting.appendleft(seq)

    def commit(self, plan: StepPlan, now: float) -> Committed:
        """Apply a step that ended at `now`."""
        finished, forked = [], []
        max_model_len = self.spec.max_model_len
        gaps: dict[float, int] = {}
        num_sampled = len(plan.cohort)
        if plan.cohort:
            first_gaps, finished = self._cohort.commit(now)
            gaps.update(first_gaps)
            for seq in finished:
                self._free(seq)
        for seq, num_new in plan.tail:
            new_tokens = 1
            if num_new > seq.num_tokens - seq.num_computed:  # a verification (speculative decoding)
                new_tokens = self.accepted(seq, num_new - 1)
                seq.num_verifications += 1
                self.num_verifications += 1
                self.num_draft_tokens += num_new - 1
                self.num_verified_tokens += new_tokens
                seq.num_computed += new_tokens
                self.allocator.rewind(seq, seq.num_computed)  # the rejected drafts' slots are slack
            else:
                seq.num_computed += num_new
                if seq.num_computed < seq.num_tokens:
                    continue
            seq.num_tokens += new_tokens
            seq.num_output += new_tokens
            num_sampled += new_tokens
            if seq.num_output > 1:
                gap = now - seq.last_token_time_s
                gaps[gap] = gaps.get(gap, 0) + 1
            seq.last_token_time_s = now
            if seq.num_output == 1:
                seq.first_token_time_s = now
                if seq.request.n > 1 and seq.sample_index == 0:
                    self.flush()  # forked blocks: the cohort gives way to sequence-by-sequence steps
                    forked.extend(self._fork_samples(seq, now))
                    num_sampled += seq.request.n - 1  # each sample drew its own first token
            if seq.num_output >= seq.request.output_len or seq.num_tokens >= max_model_len:
                seq.finish_time_s = now
                self._free(seq)
                finished.append(seq)
        if finished:
            done = {id(s) for s in finished}
            self.running = [s for s in self.running if id(s) not in done]
        self.running.extend(s for s in forked if s.finish_time_s != s.finish_time_s)
        finished.extend(s for s in forked if s.finish_time_s == s.finish_time_s)
        return Committed(finished, num_sampled, tuple(gaps.items()))

    # -- decode stretches ------------------------------------------------------------------------
    def decode_stretch(self, plan: StepPlan) -> int:
        """Steps, this plan's included, that would each schedule exactly this batch with one more
        token per sequence: 1 unless the plan decodes every running sequence and nothing can
        join; at most until the first sequence finishes or a next token finds no memory."""
        running, shape = self.running, plan.shape
        num_seqs = len(running)
        if self.spec.attention_groups or self.spec.num_speculative_tokens:  # not one token a step
            return 1
        if (plan.num_preempted or self.swapped or shape.num_prefill_tokens or shape.swap_tokens
                or shape.copy_tokens or shape.num_decode_seqs != num_seqs or plan.batch_size != num_seqs):
            return 1
        blocked = self.admission_blocked_by
        if self.waiting and self.queue_order.reorders:  # an arrival or the cache may reorder the queue
            return 1
        if self.waiting and not (blocked in (BLOCKED_BY_SEQS, BLOCKED_BY_BUDGET, BLOCKED_BY_RESERVATION) or (
                blocked == BLOCKED_BY_MEMORY
                and self.allocator.admission_stays_blocked(self.spec.reserve_full_isl))):
            return 1
        if self._cohort:  # the members' objects lag: stretch only a batch that is all cohort
            if len(plan.cohort) != num_seqs:
                return 1  # (one admitted with all but its last token cached: it joins next step)
            steps = int(self._cohort.left.min())
            return 1 if steps < 3 else self._cohort.memory.steps_that_fit(steps)
        max_model_len = self.spec.max_model_len
        steps = min(min(seq.request.output_len - seq.num_output, max_model_len - seq.num_tokens)
                    for seq in running)
        if steps < 3:  # a stretch of two steps saves nothing
            return 1
        return self.allocator.decode_steps_that_fit(running, steps)

    def advance_decode(self, step_ends: np.ndarray, num_waiting: int) -> tuple[np.ndarray, np.ndarray]:
        """Commit len(step_ends) decode steps of the running batch, each ending at its time, and
        allocate the next step's tokens. No sequence finishes; num_waiting requests waited
        throughout (requests queued since came after the last of these steps, or behind them).
        Returns the steps' inter-token gaps as rows (time_s, gap_s, count) and the memory
        breakdown after each step (rows of KVUsage.as_tuple())."""
        running, num_steps = self.running, len(step_ends)
        if self._batch_is_cohort():
            usage_rows = self._cohort.memory.rounds(num_steps)
            return self._cohort.advance(step_ends), usage_rows
        head = self.waiting[0] if num_waiting else None  # a stretch has nothing swapped
        usage_rows = self.allocator.decode_rounds(running, num_steps, head)
        rows = stretch_gap_rows(step_ends, np.array([seq.last_token_time_s for seq in running]))
        last_end = float(step_ends[-1])
        for seq in running:
            seq.num_computed += num_steps
            seq.num_tokens += num_steps
            seq.num_output += num_steps
            seq.last_token_time_s = last_end
        return rows, usage_rows

    def _batch_is_cohort(self) -> bool:
        """Whether every running sequence is a member of the decode cohort."""
        return self._cohort is not None and len(self._cohort) == len(self.running)

    def decode_plan(self, decode_context_tokens: int) -> StepPlan:
        """The plan of a decode stretch's step: every running sequence, one token each."""
        num_seqs = len(self.running)
        shape = BatchShape(num_decode_seqs=num_seqs, decode_context_tokens=decode_context_tokens,
                           num_sampled=num_seqs)
        if self._batch_is_cohort():
            return StepPlan((), shape, 0, tuple(self.running))
        return StepPlan(tuple((seq, 1) for seq in self.running), shape, 0)

    def _fork_samples(self, parent: Sequence, now: float) -> list[Sequence]:
        """The other n - 1 samples, each having sampled its own first token with the parent."""
        siblings = []
        for index in range(1, parent.request.n):
            sibling = parent.sibling(self._next_sibling_id, index)
            self._next_sibling_id += 1
            if parent.num_output >= parent.request.output_len or parent.num_tokens >= self.spec.max_model_len:
                sibling.finish_time_s = now  # a one-token request: finished with its parent
                siblings.append(sibling)
                forked = False
            elif self.allocator.fork(parent, sibling):
                siblings.append(sibling)
                forked = True
            else:  # no memory for a copy (contiguous): recompute its prompt later
                sibling.num_computed = 0
                self.waiting.appendleft(sibling)
                forked = False
            if self._reservations is not None:
                self._reservations.fork(parent, sibling, forked)
        return siblings


def _shape(scheduled, swap_tokens: int = 0, copy_tokens: int = 0, cohort_seqs: int = 0,
           cohort_context: int = 0, attention_groups: tuple = (), kv_load_s: float = 0.0) -> BatchShape:
    """The batch of `scheduled` plus a decode cohort of cohort_seqs sequences whose contexts
    (new tokens included) sum to cohort_context; with attention_groups, what each group reads."""
    prefill_tokens = prefill_seqs = prefill_kv = 0
    decode_seqs, decode_context, sampled = cohort_seqs, cohort_context, cohort_seqs
    context_pairs = causal_pairs = 0
    verifications = verify_queries = 0  # speculative decoding: verifications and their 1 + k queries
    largest = ()  # the chunk of the most new tokens (BatchShape.largest_chunk)
    decodes, prefills = [], []  # (context, new tokens) of each, for attention_groups only
    for seq, num_new in scheduled:
        context = seq.num_computed
        if context + num_new > seq.num_tokens:  # a verification: 1 + k queries against the context
            decode_seqs += 1
            verifications += 1
            verify_queries += num_new
            decode_context += context + 1
            sampled += num_new
            continue
        if context + num_new == seq.num_tokens:
            sampled += 1
            if num_new == 1 and seq.num_output:
                decode_seqs += 1
                decode_context += context + 1
                if attention_groups:
                    decodes.append(context + 1)
                continue
        prefill_tokens += num_new
        prefill_seqs += 1
        prefill_kv += context + num_new
        context_pairs += num_new * context
        causal_pairs += num_new * (num_new + 1) // 2
        if not largest or num_new > largest[0]:
            largest = (num_new, num_new * context, num_new * (num_new + 1) // 2, context + num_new)
        if attention_groups:
            prefills.append((context, num_new))
    groups = _group_attention(decodes, prefills, attention_groups) if attention_groups else ()
    queries = verify_queries + decode_seqs - verifications if verifications else 0
    return BatchShape(prefill_tokens, prefill_seqs, context_pairs, causal_pairs, prefill_kv, decode_seqs,
                      decode_context, sampled, swap_tokens, copy_tokens, kv_load_s, queries,
                      group_attention=groups, largest_chunk=largest)


def _group_attention(decodes, prefills, groups) -> tuple[tuple[int, ...], ...]:
    """Per layer group: (decode keys, prefill pairs against the cache, causal pairs, prefill KV
    tokens, indexer keys of decodes, indexer pairs of prefills) summed over the batch's decodes
    (their contexts) and prefill chunks ((cached, new) tokens), as _shape split them."""
    out = []
    for group in groups:
        decode = sum(decode_reach(group, context) for context in decodes)
        index_decode = sum(indexer_keys(group, context) for context in decodes)
        context_pairs = causal = kv = index_pairs = 0
        for cached, new in prefills:
            pairs, within, read = prefill_reach(group, cached, new)
            context_pairs, causal, kv = context_pairs + pairs, causal + within, kv + read
            index_pairs += indexer_pairs(group, cached, new)
        out.append((decode, context_pairs, causal, kv, index_decode, index_pairs))
    return tuple(out)
