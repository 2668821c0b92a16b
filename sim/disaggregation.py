"""`disaggregation.*`: runs with a prefill pool and a decode pool (sim.engine.disaggregated).

Each pool is prepared as a run of its own (its GPU, TP, replicas and KV pool; the other keys
shared), then both are simulated in one cluster. Only the block allocators (paged, prefix) take
KV that arrives computed; KV tiers are not combined with disaggregation yet.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from sim.config import QUANTIZATIONS
from sim.engine.clock import Environment
from sim.engine.disaggregated import DisaggregatedCluster, LinkSpec, PrefillReplica, ttft_split
from sim.errors import ConfigError
from sim.kvcache.block import BlockAllocator
from sim.kvcache.tiers import tiers_enabled
from sim.recorder import Recorder
from sim.latency.profile import load_profile
from sim.metrics import busiest_over_mean, measured_requests
from sim.models import model_from_config
from sim.run import (RunResult, Setup, _instantiate, add_replicas, check_fp4_units, check_tensor_parallel, prepare,
                     summarize_run)


@dataclass(frozen=True, slots=True)
class Pools:
    prefill: Setup
    decode: Setup
    link_bandwidth_bytes_per_s: float
    link_latency_s: float


def prepare_pools(cfg: DictConfig) -> Pools:
    d = OmegaConf.to_container(cfg.disaggregation, resolve=True)
    for key in ("prefill_replicas", "decode_replicas"):
        if d[key] < 1:
            raise ConfigError(f"disaggregation.{key}={d[key]} is below 1, key disaggregation.{key}, use 1 or more")
    if not d["link_bandwidth_gb_per_s"] > 0 or d["link_latency_s"] < 0:
        raise ConfigError("disaggregation.link_bandwidth_gb_per_s must be > 0 and link_latency_s >= 0, "
                          "key disaggregation.link_bandwidth_gb_per_s, fix the values")
    if cfg.data_parallel_size > 1:
        raise ConfigError(f"data_parallel_size={cfg.data_parallel_size} with disaggregation is not modelled (a "
                          f"sequence's KV would cross from one rank's GPUs), key data_parallel_size, use 1 or "
                          f"disaggregation.enabled=false")
    if cfg.speculative_config.num_speculative_tokens:
        raise ConfigError("speculative decoding with disaggregation is not modelled, key "
                          "speculative_config.method, set it null or disaggregation.enabled=false")
    if tiers_enabled(cfg.kv_offload):
        raise ConfigError("kv_offload with disaggregation is not modelled yet, key kv_offload, "
                          "set the tier sizes to 0 or disaggregation.enabled=false")
    setups, model = {}, model_from_config(cfg.model)
    for role in ("prefill", "decode"):
        gpu, tp = d[f"{role}_gpu"], d[f"{role}_tensor_parallel_size"]
        if gpu is not None:
            profile = load_profile(gpu, f"key disaggregation.{role}_gpu")
            check_fp4_units(QUANTIZATIONS.get(cfg.quantization) or model.weight_dtype, profile,
                            f"disaggregation.{role}_gpu", gpu)
        if tp is not None:
            check_tensor_parallel(model, tp, f"disaggregation.{role}_tensor_parallel_size")
        overrides = {"gpu": cfg.gpu if gpu is None else gpu,
                     "tensor_parallel_size": cfg.tensor_parallel_size if tp is None else tp,
                     "cluster": {"num_replicas": d[f"{role}_replicas"]}}
        setups[role] = prepare(OmegaConf.merge(cfg, overrides))
    for name in setups["prefill"].allocator_configs:
        probe = _instantiate(setups["prefill"].allocator_configs[name], f"allocator config '{name}'",
                             pool=setups["prefill"].pool, max_model_len=setups["prefill"].spec.max_model_len)
        if type(probe) is not BlockAllocator:
            raise ConfigError(f"disaggregation takes the paged and prefix allocators (KV arriving computed), "
                              f"not {name}, key allocators, use allocators=[paged,prefix]")
    return Pools(setups["prefill"], setups["decode"], d["link_bandwidth_gb_per_s"] * 1e9, d["link_latency_s"])


def simulate_disaggregated(pools: Pools, workload, allocator_name: str, router_cfg, on_progress=None,
                           queue_order_cfg=None) -> RunResult:
    started = time.perf_counter()
    prefill, decode = pools.prefill, pools.decode
    env, recorder = Environment(), Recorder()
    router = _instantiate(router_cfg, "router config")
    queue_order = None if queue_order_cfg is None else _instantiate(queue_order_cfg, "queue_order config")
    ranks = prefill.spec.tensor_parallel_size * prefill.spec.pipeline_parallel_size
    link = LinkSpec(pools.link_bandwidth_bytes_per_s, pools.link_latency_s, prefill.pool.bytes_per_token, ranks)
    cluster = DisaggregatedCluster(env, router, recorder, prefill.spec.max_model_len, link,
                                   prefill.spec.num_replicas, prefill.spec.serving_overhead_s,
                                   prefill.spec.router_staleness_s)
    step_exact = prefill.spec.step_exact or router.reads_kv_state
    add_replicas(prefill, env, recorder, cluster, allocator_name, queue_order, step_exact, workload,
                 cluster.on_prefill_done, replica_class=PrefillReplica)
    add_replicas(decode, env, recorder, cluster, allocator_name, queue_order, decode.spec.step_exact, workload,
                 cluster.on_finish, first_index=prefill.spec.num_replicas)
    cluster.start(workload)
    if on_progress is not None:
        cluster.on_progress = on_progress
    env.run()
    metrics, requests, timeline = summarize_run(decode, workload, recorder, time.perf_counter() - started)
    metrics["routing"] = pool_routing(cluster.prefilled_tokens, requests.replica[requests.status == "finished"],
                                      decode.spec.num_replicas)
    metrics["engine"] = {"loop": "python", "why": "the compiled loop does not cover disaggregated pools"}
    metrics["kv_pool"] = {"token_slots_per_replica": decode.pool.num_slots, "bytes_per_replica": decode.pool.pool_bytes,
                          "num_blocks_per_replica": decode.pool.num_blocks, "block_size": decode.pool.block_size}
    metrics["disaggregation"] = {
        "prefill": pool_facts(prefill), "decode": pool_facts(decode),
        "link_bandwidth_gb_per_s": pools.link_bandwidth_bytes_per_s / 1e9, "link_latency_s": pools.link_latency_s,
        "transferred_bytes": cluster.transferred_bytes,
        "ttft_split": ttft_split(cluster.stages, measured_requests(requests, *metrics["measurement"]["window_s"]).request_id)}
    return RunResult(allocator_name, metrics, requests, timeline,
                     OmegaConf.to_container(prefill.allocator_configs[allocator_name], resolve=True))


def pool_routing(prefilled_tokens: list[int], finished_replicas, num_decode: int) -> dict:
    """metrics.json's routing for two pools (replica indices: prefill first, then decode): the
    prompt tokens each replica computed (a prefill replica its requests' prompts less their
    prefix hits, a decode replica one token per request) and the requests each finished (decode
    replicas only); the busiest over the mean within the pool doing that work."""
    num_prefill = len(prefilled_tokens)
    finished = [0] * (num_prefill + num_decode)
    for replica in finished_replicas:
        finished[int(replica)] += 1
    return {"finished_requests_per_replica": finished,
            "prefilled_tokens_per_replica": [*prefilled_tokens, *finished[num_prefill:]],
            "busiest_over_mean_finished_requests": busiest_over_mean(finished[num_prefill:]),
            "busiest_over_mean_prefilled_tokens": busiest_over_mean(prefilled_tokens)}


def pool_facts(setup: Setup) -> dict:
    """A pool's replicas and their KV pool (replica indices: prefill first, then decode)."""
    spec = setup.spec
    profile = setup.latency.profile
    return {"num_replicas": spec.num_replicas, "gpu": profile.name,
            "latency_profile": {"gpu": profile.name, "source": profile.source, "operators": profile.provenance()},
            "tensor_parallel_size": spec.tensor_parallel_size,
            "kv_pool_token_slots_per_replica": setup.pool.num_slots,
            "kv_pool_bytes_per_replica": setup.pool.pool_bytes}


def run_disaggregated(cfg: DictConfig, show_progress: bool = False) -> list[RunResult]:
    from sim.progress import progress_bar
    from sim.run import build_workload
    from sim.workload.overlength import truncate_overlength
    pools = prepare_pools(cfg)
    workload = build_workload(cfg, pools.prefill.spec.seed)
    if pools.prefill.spec.on_overlength == "truncate":
        workload = truncate_overlength(workload, pools.prefill.spec.max_model_len)
    names = list(pools.prefill.allocator_configs)
    with progress_bar(show_progress, workload.num_requests * len(names), "+".join(names)) as bar:
        return [simulate_disaggregated(pools, workload, name, cfg.router, bar.advance, cfg.queue_order)
                for name in names]
