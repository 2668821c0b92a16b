"""Prefill/decode disaggregation: a prefill pool and a decode pool of replicas, KV moved between.

    arrival ─► router ─► prefill replica: queue, prompt computed (its own KV pool), then freed
                             │ the prompt's KV over the link: latency + bytes / (bandwidth x ranks)
                             ▼
                         decode replica (least loaded): admitted when its whole sequence fits
                         (back-pressure: it waits in the decode queue otherwise), computes the
                         last prompt token and samples the first output token, then decodes

As vLLM's disaggregated prefill with a KV connector: the prefill instance runs the request with
one output token; the decode instance receives every prompt token's KV but the last, computes
that one and samples the first token (the prefill's is discarded), so TTFT = queueing + prefill
+ transfer + decode wait (admission and its first step). Each prefill rank sends its shard over
its own link. The prefill replica frees its blocks when the transfer starts (it does not hold
them while the decode pool refuses). Replicas 0..P-1 are the prefill pool, P.. the decode pool.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from sim.engine.cluster import Cluster
from sim.engine.replica import Replica
from sim.scheduler import Sequence


@dataclasses.dataclass(frozen=True, slots=True)
class LinkSpec:
    bandwidth_bytes_per_s: float   # per rank pair
    latency_s: float
    kv_bytes_per_token: float      # the prefill pool's, per replica
    ranks: int                     # prefill GPUs sending in parallel

    def transfer_s(self, num_tokens: int) -> float:
        return self.latency_s + num_tokens * self.kv_bytes_per_token / (self.bandwidth_bytes_per_s * self.ranks)


class DisaggregatedCluster(Cluster):
    """The router picks a prefill replica; the least loaded decode replica takes the request on."""

    def __init__(self, env, router, recorder, max_model_len: int, link: LinkSpec, num_prefill: int,
                 serving_overhead_s: float = 0.0, router_staleness_s: float = 0.0):
        super().__init__(env, router, recorder, max_model_len, serving_overhead_s, router_staleness_s)
        self.link, self.num_prefill = link, num_prefill
        self.decode_replicas = []
        self.stages: dict[int, tuple[float, float, float, float, float]] = {}  # request id -> see ttft_split
        self._pending: dict[int, tuple[float, float, float]] = {}  # seq id -> (arrival, prefill start, end)
        self.transferred_bytes = 0.0
        self.prefilled_tokens = [0] * num_prefill  # per prefill replica: prompt tokens it computed

    def add_replica(self, replica) -> None:
        if len(self.replicas) < self.num_prefill:
            super().add_replica(replica)  # the router sees the prefill pool only
        else:
            self.decode_replicas.append(replica)

    def _route(self, seq: Sequence) -> None:
        prefill = Sequence(dataclasses.replace(seq.request, output_len=1), seq.arrival_time_s, self.max_model_len)
        prefill.decode_twin = seq  # the decode side's sequence, waiting for the KV
        super()._route(prefill)

    def on_prefill_done(self, prefill: Sequence) -> None:
        """The prompt is computed: send its KV to the least loaded decode replica."""
        seq, now = prefill.decode_twin, self.env.now
        seq.prefix_hit_tokens, seq.num_preemptions, seq.admitted = prefill.prefix_hit_tokens, prefill.num_preemptions, True
        sent = seq.request.prompt_len - 1  # the decode side computes the last prompt token
        seq.transferred_tokens = sent
        self.prefilled_tokens[prefill.replica] += prefill.request.prompt_len - prefill.prefix_hit_tokens
        self.transferred_bytes += sent * self.link.kv_bytes_per_token
        transfer = self.env.timeout(self.link.transfer_s(sent))
        self._pending[seq.seq_id] = (seq.arrival_time_s, prefill.first_scheduled_s, now)
        transfer.callbacks.append(lambda _event: self._to_decode(seq))

    def _to_decode(self, seq: Sequence) -> None:
        arrival, started, prefilled = self._pending.pop(seq.seq_id)
        self._pending[seq.seq_id] = (arrival, started, prefilled, self.env.now)
        loads = [replica.scheduler.load for replica in self.decode_replicas]
        self.decode_replicas[loads.index(min(loads))].submit(seq)

    def on_finish(self, seq: Sequence) -> None:
        stages = self._pending.pop(seq.seq_id, None)
        if stages is not None:
            arrival, started, prefilled, landed = stages
            self.stages[seq.request.request_id] = (started - arrival, prefilled - started, landed - prefilled,
                                                   seq.first_token_time_s - landed, seq.first_token_time_s - arrival)
        super().on_finish(seq)


class PrefillReplica(Replica):
    """A prefill pool replica: stamps when each sequence is first scheduled (queueing ends)."""

    def _commit(self, plan) -> None:
        for seq, _ in plan.scheduled:
            if seq.first_scheduled_s != seq.first_scheduled_s:  # NaN: not stamped yet
                seq.first_scheduled_s = self.step_started_s
        super()._commit(plan)


def ttft_split(stages: dict, request_ids) -> dict:
    """Mean and p90 of TTFT's parts over the given requests (the measured ones, as latency_s):
    queueing (arrival to the prefill's first step), prefill (its steps), transfer (the link),
    decode_wait (queued on the decode replica and its first step); the parts' means sum to the
    mean TTFT, and p90 is numpy's percentile, as latency_s's."""
    rows = np.array([stages[i] for i in request_ids if i in stages], dtype=float).reshape(-1, 5)
    names = ("queueing_s", "prefill_s", "transfer_s", "decode_wait_s", "ttft_s")
    return {name: {"mean": float(rows[:, index].mean()) if len(rows) else 0.0,
                   "p90": float(np.percentile(rows[:, index], 90)) if len(rows) else 0.0}
            for index, name in enumerate(names)}
