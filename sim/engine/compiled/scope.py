"""Which runs the compiled loop takes (sim.engine.compiled.core), and why not the others.

It covers what its arrays hold: the paged allocator, with or without prefix caching (LRU, no KV
tiers), FCFS with recompute
preemption, one attention kind (full, GQA or MQA; not MLA, windows or compressed layers), up to
two pipeline stages, sessions of requests of one sample with no client cap, routing by load
(least loaded by requests, waiting or queued tokens, live) or round robin (any router with one
replica). Every other run takes the Python engine, and says why.
"""
from __future__ import annotations

from sim.kvcache.block import BlockAllocator
from sim.router.least_loaded import LeastLoaded
from sim.router.round_robin import RoundRobin
from sim.scheduler.queue_order import Fcfs

COMPILED_LOAD_METRICS = ("requests", "waiting", "queued_tokens")


def why_not_compiled(setup, workload, allocator, router, queue_order) -> str | None:
    """None when the compiled loop runs this exactly as the Python engine would; else why not."""
    spec, model = setup.spec, setup.model
    if spec.step_exact:
        return "step_exact=true keeps the plain loop"
    if model.is_mla or model.attention_groups or getattr(setup.pool, "layout", None) is not None:
        return "it covers models of one full-attention kind (not MLA, window, compressed or state layers)"
    if type(allocator) is not BlockAllocator:
        return "it covers the paged and prefix allocators"
    if allocator.enable_caching and allocator.pool.eviction != "lru":
        return "it covers the prefix cache's LRU eviction"
    if allocator.enable_caching and spec.kv_offload.enabled:
        return "it does not model KV tiers (kv_offload)"
    if queue_order is not None and type(queue_order) is not Fcfs:
        return "it covers queue_order=fcfs"
    if spec.preemption_mode != "recompute":
        return "it covers preemption_mode=recompute"
    if spec.pipeline_parallel_size > 2:
        return "it covers pipeline_parallel_size up to 2"
    if spec.data_parallel_size > 1:
        return "it covers data_parallel_size=1"
    if spec.num_speculative_tokens:
        return "it does not model speculative decoding"
    if workload.max_concurrency is not None:
        return "it does not model a client's cap on requests in flight (scenario.max_concurrency)"
    if any(request.n != 1 for session in workload.one_copy for request in session.turns):
        return "it covers requests of one sample (n = 1)"
    if not spec.serving_overhead_s and any(request.think_time_s == 0 for session in workload.one_copy
                                           for request in session.turns[1:]):
        # A turn sent at the instant its previous one finished: SimPy's order of events created
        # at one instant decides which step sees it (sim.engine.replica), which the loop does not keep.
        return "it covers zero think times only with a serving overhead (serving_overhead_s > 0)"
    if spec.num_replicas > 1:
        if spec.router_staleness_s:
            return "it routes on live loads (cluster.router_staleness_s=0)"
        if not (type(router) is RoundRobin or (type(router) is LeastLoaded
                                                and router.metric in COMPILED_LOAD_METRICS)):
            return "it covers router=least_loaded (requests, waiting, queued_tokens) and round_robin"
    return None
