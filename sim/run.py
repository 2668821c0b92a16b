"""Wires a composed config into components and runs one simulation per allocator.

The only module that knows every other one.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass
from importlib import resources

import pandas as pd
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from sim.capacity import KvPool, size_kv_pool
from sim.config import EngineSpec, engine_spec
from sim.engine.cluster import Cluster
from sim.engine.replica import Replica
from sim.errors import ConfigError, UnknownNameError
from sim.kvcache.block import BlockAllocator
from sim.kvcache.hybrid import HybridBlockAllocator
from sim.kvcache.tiers import Tier, TierChain
from sim.latency import LatencyModel, load_profile
from sim.engine.clock import Environment
from sim.engine.records import StepRecord
from sim.metrics import summarize
from sim.recorder import Recorder
from sim.models import ModelSpec, model_from_config, resolve_kv_dtype
from sim.progress import progress_bar
from sim.scheduler import Scheduler, SchedulerSpec
from sim.workload.overlength import truncate_overlength
from sim.workload.request import Workload

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RunResult:
    allocator: str
    metrics: dict
    requests: pd.DataFrame
    timeline: pd.DataFrame
    allocator_config: dict


@dataclass(frozen=True, slots=True)
class Setup:
    spec: EngineSpec
    model: ModelSpec
    kv_dtype: str
    pool: KvPool
    latency: LatencyModel
    allocator_configs: dict


def takes_tiers(allocator) -> bool:
    """Whether an allocator keeps a prefix cache that KV tiers can extend (the block allocator)."""
    return hasattr(allocator, "attach_tiers") and getattr(allocator, "enable_caching", False)


def stepping_reason(setup: Setup, router) -> str | None:
    """Why the Python loop must step one step at a time (None: decode stretches may jump)."""
    if router.reads_kv_state:
        return "the router reads the replicas' KV pools at every arrival"
    offload = setup.spec.kv_offload
    if offload.enabled and offload.shared_store_gib(setup.spec.num_replicas) and setup.spec.num_replicas > 1:
        return "the replicas share a KV store, whose writes and reads must keep their time order"
    return None


def attach_tiers(setup: Setup, allocators: list) -> list[TierChain]:
    """Each prefix allocator's tier chain: its own CPU and disk tiers, one shared store."""
    spec, pool = setup.spec.kv_offload, setup.pool
    if not spec.enabled:
        return []
    block_bytes = pool.bytes_per_token * pool.block_size
    shared_gib = spec.shared_store_gib(setup.spec.num_replicas)
    shared = Tier("shared", int(shared_gib * 2**30 // block_bytes), spec.eviction) if shared_gib else None
    ranks = setup.spec.tensor_parallel_size * setup.spec.pipeline_parallel_size  # one sequence's GPUs load its KV
    chains = []
    for allocator in allocators:
        if takes_tiers(allocator):
            chain = TierChain(spec, block_bytes, ranks,
                              lambda blocks: setup.latency.swap_time(blocks * pool.block_size), shared)
            allocator.attach_tiers(chain)
            chains.append(chain)
    return chains


def available_allocators() -> list[str]:
    folder = resources.files("scenarios") / "allocator"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def allocator_names(spec: EngineSpec) -> list[str]:
    names = []
    for name in spec.allocators:
        if spec.enable_prefix_caching and name == "paged":
            name = "prefix"
        if name not in names:
            names.append(name)
    return names


def load_allocator_config(name: str) -> DictConfig:
    path = resources.files("scenarios") / "allocator" / f"{name}.yaml"
    if not path.is_file():
        raise UnknownNameError("allocator", name, available_allocators(), "key allocators")
    return OmegaConf.load(str(path))


def _instantiate(cfg, where: str, **kwargs):
    """instantiate(cfg)(**kwargs); runtime objects are passed after composition, untouched.

    A key the target does not take (a typo in a YAML file or a +key override) fails here, as one
    ConfigError naming the config.
    """
    try:
        return instantiate(cfg, _partial_=True)(**kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__ or exc
        if isinstance(cause, ConfigError):
            raise cause from None
        detail = str(cause).splitlines()[0]
        raise ConfigError(f"cannot build {where} ({detail}), {where}, fix or remove the offending key") from None
    except TypeError as exc:
        raise ConfigError(f"cannot build {where} ({exc}), {where}, fix or remove the offending key") from None


def check_fp4_units(weight_dtype: str, profile, key: str, gpu: str) -> None:
    """NVFP4 weights run only where the GPU (chosen by `key`) has FP4 tensor cores."""
    if weight_dtype == "nvfp4" and not profile.fp4_flops_per_s:
        raise ConfigError(f"NVFP4 weights need FP4 tensor cores, which {key}={gpu} ({profile.gpu_name}) lacks, "
                          f"key {key}, use a Blackwell GPU ({key}=b200) or quantization=fp8")


def check_tensor_parallel(model, tensor_parallel_size: int, key: str) -> None:
    """A TP group splits the query heads evenly (vLLM refuses a size that does not divide them), and
    a Mamba-2 layer's heads, and its groups unless there is one (vLLM's MambaMixer2 asserts both)."""
    def refuse(what: str, fits) -> None:
        divisors = [n for n in (1, 2, 4, 8, 16) if fits(n)]
        raise ConfigError(f"{key}={tensor_parallel_size}: a TP group must split {model.name}'s {what} evenly, "
                          f"key {key}, use one of {', '.join(map(str, divisors))}")
    if tensor_parallel_size < 1 or model.num_heads % tensor_parallel_size:
        refuse(f"{model.num_heads} attention heads", lambda n: model.num_heads % n == 0)
    for g in model.layer_groups:
        if g.kind == "state" and g.has_mixer_widths and (
                g.ssm_heads % tensor_parallel_size or (g.ssm_groups > 1 and g.ssm_groups % tensor_parallel_size)):
            refuse(f"{g.ssm_heads} Mamba-2 heads and {g.ssm_groups} groups",
                   lambda n: g.ssm_heads % n == 0 and (g.ssm_groups == 1 or g.ssm_groups % n == 0))


NVLINK_DOMAIN_GPUS = 8  # an HGX/DGX baseboard: the GPUs the profiles' collectives were measured over


def check_data_parallel(model, spec) -> None:
    """data_parallel_size > 1: attention ranks of a MoE replica whose experts span them all (vLLM's
    DP + EP); a dense model's data parallelism is replicas (cluster.num_replicas)."""
    if spec.data_parallel_size == 1:
        return
    where = f"data_parallel_size={spec.data_parallel_size}"
    if not model.num_moe_layers:
        raise ConfigError(f"{where} with {model.name}, which has no experts, key data_parallel_size, "
                          f"use cluster.num_replicas for independent engines (or a MoE model)")
    if not spec.enable_expert_parallel:
        raise ConfigError(f"{where} without expert parallelism, key enable_expert_parallel, set it true "
                          f"(kvsim models data-parallel attention with the experts spread over every rank)")
    if spec.pipeline_parallel_size > 1:
        raise ConfigError(f"{where} with pipeline_parallel_size={spec.pipeline_parallel_size}, key "
                          f"pipeline_parallel_size, use 1 (kvsim does not combine the two)")


def say_busiest_gpu(moe, spec) -> None:
    """What the busiest expert-parallel GPU does beyond the mean, at one token a step and at the
    step's token budget (all attention ranks')."""
    tokens = spec.max_num_batched_tokens * spec.data_parallel_size
    (one_touched, _), (_, copies) = moe.busiest_gpu(1), moe.busiest_gpu(tokens)
    mean_touched = moe.touched_experts(1) / moe.ep
    mean_copies = tokens * moe.model.num_active_experts / moe.ep
    print(f"note: expert parallelism over {moe.ep} GPUs: each MoE layer waits for its busiest GPU, which "
          f"touches {one_touched:.2f} experts where the mean is {mean_touched:.2f} at 1 token a step, and gets "
          f"{copies / mean_copies:.2f}x the mean routed tokens at {tokens:,} (expert_tokens_cv="
          f"{spec.expert_tokens_cv:g}; 0: every GPU alike)", file=sys.stderr)


def say_data_parallel(spec) -> None:
    """What kvsim simplifies in a data-parallel replica, said once its set-up has passed."""
    if spec.data_parallel_size == 1:
        return
    where = f"data_parallel_size={spec.data_parallel_size}"
    print(f"note: {where}: the ranks share one scheduler and one KV pool in kvsim (a rank may hold more than "
          f"its share of the blocks; each sequence's chunk in a step is at most max_num_batched_tokens), a "
          f"step waits for the busiest rank", file=sys.stderr)


def say_beyond_one_node(spec) -> None:
    """A replica wider than one NVLink node: its collectives are still timed on the node's NVLink."""
    tp, pp, dp = spec.tensor_parallel_size, spec.pipeline_parallel_size, spec.data_parallel_size
    if tp * dp > NVLINK_DOMAIN_GPUS:
        what = (f"data_parallel_size={dp} x tensor_parallel_size={tp} spreads the experts over {tp * dp} GPUs"
                if dp > 1 else f"tensor_parallel_size={tp} all-reduces over {tp} GPUs")
    elif tp * pp > NVLINK_DOMAIN_GPUS:
        what = f"pipeline_parallel_size={pp} x tensor_parallel_size={tp} puts {tp * pp} GPUs in a replica"
    else:
        return
    print(f"warning: {what}, more than one {NVLINK_DOMAIN_GPUS}-GPU NVLink node: kvsim times the collectives "
          f"and sends on the node's NVLink and does not model the network between nodes; fix: at most "
          f"{NVLINK_DOMAIN_GPUS} GPUs a replica for timings you can trust", file=sys.stderr)


def prepare(cfg: DictConfig) -> Setup:
    """Validate everything that can fail before any simulation starts."""
    model = model_from_config(cfg.model)
    if model.substituted:
        print(f"note: model {model.name}: {model.substituted}", file=sys.stderr)
    if model.untimed_layers:
        raise ConfigError(f"model {model.name} has {model.untimed_layers}, which the simulator cannot time "
                          f"(python -m sim kv prices them), key model, give their widths")
    spec = engine_spec(cfg, model.max_position_embeddings)
    if spec.quantization:  # weights (and so GEMM inputs) in the quantized type
        model = dataclasses.replace(model, weight_dtype=spec.quantization)
    _check_context_window(model, spec.max_model_len)
    check_tensor_parallel(model, spec.tensor_parallel_size, "tensor_parallel_size")
    profile = load_profile(spec.gpu)
    check_fp4_units(model.weight_dtype, profile, "gpu", spec.gpu)
    kv_dtype = resolve_kv_dtype(model, spec.kv_cache_dtype)
    check_data_parallel(model, spec)
    if spec.num_speculative_tokens and model.attention_groups:
        raise ConfigError(f"speculative decoding with {model.name}'s layer groups (window, compressed or state "
                          f"layers) is not modelled, key speculative_config.method, set it null")
    pool = size_kv_pool(model, profile, tensor_parallel_size=spec.tensor_parallel_size,
                        kv_dtype=kv_dtype, block_size=spec.block_size,
                        max_model_len=spec.max_model_len,
                        gpu_memory_utilization=spec.gpu_memory_utilization,
                        activation_reserve_bytes=spec.activation_reserve_bytes,
                        kv_cache_memory_bytes=spec.kv_cache_memory_bytes,
                        pipeline_parallel_size=spec.pipeline_parallel_size,
                        data_parallel_size=spec.data_parallel_size,
                        draft_layers=1 if spec.num_speculative_tokens else 0)
    if spec.pipeline_parallel_size > model.num_layers:
        raise ConfigError(f"pipeline_parallel_size={spec.pipeline_parallel_size} exceeds {model.name}'s "
                          f"{model.num_layers} layers, key pipeline_parallel_size, use at most {model.num_layers}")
    async_scheduling = spec.async_scheduling and spec.pipeline_parallel_size == 1
    if spec.async_scheduling and not async_scheduling:
        print("warning: async_scheduling=true has no effect with pipeline_parallel_size > 1 (kvsim does not "
              "model it with pipeline stages; vLLM 0.14 excluded them too); fix: leave it false", file=sys.stderr)
    elif async_scheduling and not spec.async_output_processing:
        print("warning: async_output_processing=false has no effect with async_scheduling=true (the whole host "
              "step runs beside the GPU's); fix: leave it true", file=sys.stderr)
    latency = LatencyModel(model, profile, spec.tensor_parallel_size, kv_dtype, spec.cudagraph_capture_sizes,
                           spec.pipeline_parallel_size, spec.enable_expert_parallel, spec.async_output_processing,
                           spec.kv_offload.overlap_load, async_scheduling, spec.data_parallel_size,
                           spec.num_speculative_tokens, spec.expert_tokens_cv, spec.api_server_per_seq_s)
    if latency.expert_parallel:
        say_busiest_gpu(latency.moe, spec)
    if spec.enable_expert_parallel and not latency.expert_parallel:
        why = f"{model.name} has no experts" if not model.num_moe_layers else "tensor_parallel_size=1: one GPU"
        print(f"warning: enable_expert_parallel=true has no effect ({why}); fix: leave it false",
              file=sys.stderr)
    options = OmegaConf.to_container(cfg.allocator_options, resolve=True)
    configs = {name: load_allocator_config(name) for name in allocator_names(spec)}
    for name, values in options.items():
        if name not in available_allocators():
            raise UnknownNameError("allocator", name, available_allocators(), "key allocator_options")
        if name in configs:  # options for allocators not run this time are kept for the next
            configs[name] = OmegaConf.merge(configs[name], values)
    state_bytes, tierless = {}, []
    for name, allocator_cfg in configs.items():  # fail on a bad allocator config up front
        allocator = _instantiate(allocator_cfg, f"allocator config '{name}'", pool=pool,
                                 max_model_len=spec.max_model_len)
        state_bytes[name] = allocator.state_bytes()
        if spec.capacity_scheduler_policy == "guaranteed_no_evict":
            check_no_evict(name, allocator)
        if spec.num_speculative_tokens:
            check_speculative(name, allocator)
        if not takes_tiers(allocator):
            tierless.append(name)
    if spec.num_speculative_tokens:
        print(f"note: speculative_config: {spec.num_speculative_tokens} passes a decode step of a one-layer draft "
              f"(one layer's share of {model.name}, whatever the method), each verification yielding "
              f"{spec.acceptance_length:g} tokens on average, the same for every sequence; the draft layer's "
              f"weights and KV are taken from the pool; drafts after a prefill are not charged", file=sys.stderr)
    if spec.kv_offload.enabled and tierless:
        which = ("is not built for models with window or compressed layers" if getattr(pool, "layout", None)
                 is not None else "applies to the prefix allocator (vLLM's prefix cache) only")
        print(f"note: kv_offload {which}: {', '.join(tierless)} run without KV tiers", file=sys.stderr)
    largest = max(state_bytes, key=state_bytes.get)  # allocators run one after another
    check_host_memory(largest, state_bytes[largest], spec.num_replicas)
    check_tier_memory(spec, pool)
    if pool.block_size != spec.block_size:  # (said once the set-up is valid) vLLM raises it the same way, and logs it
        print(f"note: block_size raised from {spec.block_size} to {pool.block_size} tokens so that an attention page "
              f"holds a state layer's state, as vLLM does for models with Mamba layers", file=sys.stderr)
    say_data_parallel(spec)
    say_beyond_one_node(spec)
    return Setup(spec, model, kv_dtype, pool, latency, configs)


def check_speculative(name: str, allocator) -> None:
    """Speculative decoding's lookahead slots are modelled on the paged allocator (without prefix
    caching); prepare refuses models of several attention kinds before."""
    if not (type(allocator) is BlockAllocator and not allocator.enable_caching):
        raise ConfigError(f"speculative decoding applies to the paged allocator only (without prefix caching), "
                          f"not '{name}', key allocators, use allocators=[paged] with enable_prefix_caching=false, "
                          f"or speculative_config.method=null")


def check_no_evict(name: str, allocator) -> None:
    """guaranteed_no_evict reserves what a request holds to completion, which the paged
    allocators' counts express (TensorRT-LLM's paged KV cache without block reuse; a hybrid
    model's pools). (A max_model_len request fits the pool whole: prepare refuses a pool that
    holds none.)"""
    paged = type(allocator) is BlockAllocator and not allocator.enable_caching
    if not (paged or type(allocator) is HybridBlockAllocator):
        raise ConfigError(f"capacity_scheduler_policy=guaranteed_no_evict applies to the paged allocator only "
                          f"(without prefix caching), not '{name}', key allocators, use allocators=[paged] or "
                          f"capacity_scheduler_policy=max_utilization")


TIER_KEY_BYTES = 100  # one block key in a tier's ordered dict (measured with tracemalloc: ~95 B)


def check_tier_memory(spec: EngineSpec, pool: KvPool) -> None:
    """Refuse KV tiers whose block keys alone would not fit in this machine's memory."""
    offload = spec.kv_offload
    if not offload.enabled:
        return
    block_gib = pool.bytes_per_token * pool.block_size / 2**30
    blocks = ((offload.cpu_gib + offload.disk_gib) * spec.num_replicas + offload.shared_gib) / block_gib
    budget = 0.8 * available_memory_bytes()
    if blocks * TIER_KEY_BYTES > budget:
        raise ConfigError(f"kv_offload tiers of {blocks:,.0f} blocks need about {blocks * TIER_KEY_BYTES / 2**30:,.1f} GiB "
                          f"of host memory for their block keys and {budget / 2**30:.1f} GiB is available, "
                          f"key kv_offload.shared_gib (or cpu_gib, disk_gib), lower it or raise block_size")


REPLICA_OVERHEAD_BYTES = 64 * 1024  # scheduler, SimPy process, recorder rows of an idle replica


def available_memory_bytes() -> int:
    """MemAvailable of /proc/meminfo, else physical memory."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_host_memory(allocator: str, state_bytes: int, num_replicas: int) -> None:
    """Refuse a cluster whose allocator state alone would not fit in this machine's memory."""
    per_replica = state_bytes + REPLICA_OVERHEAD_BYTES
    budget = 0.8 * available_memory_bytes()
    if per_replica * num_replicas > budget:
        fits = max(1, int(budget // per_replica))
        raise ConfigError(
            f"cluster.num_replicas={num_replicas} with the {allocator} allocator needs about "
            f"{per_replica * num_replicas / 2**30:,.1f} GiB of host memory for simulator state "
            f"({per_replica / 2**20:.1f} MiB per replica), and {budget / 2**30:.1f} GiB is available, "
            f"key cluster.num_replicas, use at most {fits} replicas (or a smaller KV pool per replica)")


MAX_EXTENDED_MODEL_LEN = 1_048_576


def _check_context_window(model: ModelSpec, max_model_len: int) -> None:
    """Beyond the model's native window (as with RoPE scaling) up to 1M tokens, with a warning."""
    native = model.max_position_embeddings
    if not native or max_model_len <= native:
        return
    if max_model_len > MAX_EXTENDED_MODEL_LEN:
        raise ConfigError(f"max_model_len={max_model_len} exceeds {model.name}'s native window {native} "
                          f"and the 1,048,576 limit for extended windows, key max_model_len, "
                          f"use at most {max(native, MAX_EXTENDED_MODEL_LEN)}")
    log.warning("max_model_len=%d exceeds %s's native window of %d tokens; simulated as if the "
                "window were extended (RoPE scaling)", max_model_len, model.name, native)


def build_workload(cfg: DictConfig, seed: int) -> Workload:
    scenario = _instantiate(cfg.scenario, "scenario config")
    return scenario.generate(seed)


def simulate(setup: Setup, workload: Workload, allocator_name: str, router_cfg,
             on_progress=None, queue_order_cfg=None) -> RunResult:
    """One allocator's run; on_progress(now) is called once per request served or rejected.
    wall_time_s times the simulation loop (loading the compiled one comes before)."""
    spec = setup.spec
    recorder = Recorder()
    router = _instantiate(router_cfg, "router config")
    queue_order = None if queue_order_cfg is None else _instantiate(queue_order_cfg, "queue_order config")
    compiled_allocator, why_python = choose_engine(setup, workload, allocator_name, router, queue_order)
    started = time.perf_counter()
    if compiled_allocator is not None:
        from sim.engine.compiled.driver import simulate_compiled
        num_events = simulate_compiled(setup, workload, compiled_allocator, router, recorder,
                                       on_progress or (lambda now: None))
        metrics, requests, timeline = summarize_run(setup, workload, recorder, time.perf_counter() - started)
        metrics["engine"] = {"loop": "compiled", "num_events": num_events}
        metrics["kv_pool"] = _pool_facts(setup, compiled_allocator.capacity)
        return RunResult(allocator_name, metrics, requests, timeline, _allocator_config(setup, allocator_name))
    env = Environment()
    cluster = Cluster(env, router, recorder, spec.max_model_len, spec.serving_overhead_s,
                      spec.router_staleness_s)
    # A router that reads the KV pools needs them current at every arrival, and a shared store
    # across replicas needs their writes and reads in time order: no decode stretches (their
    # steps' memory and keys are applied when they end).
    stepping = stepping_reason(setup, router)
    step_exact = spec.step_exact or stepping is not None
    allocators = add_replicas(setup, env, recorder, cluster, allocator_name, queue_order, step_exact,
                              workload, cluster.on_finish)
    chains = attach_tiers(setup, allocators)
    cluster.start(workload)
    if on_progress is not None:
        cluster.on_progress = on_progress
    env.run()
    metrics, requests, timeline = summarize_run(setup, workload, recorder, time.perf_counter() - started)
    # Token slots: the allocator's (contiguous: the pool's bytes over a token's; paged: blocks x
    # block size); a hybrid layout's pages hold different kinds: its smallest page's tokens.
    slots = setup.pool.context_tokens if setup.pool.layout is not None else allocators[0].capacity
    if chains:
        metrics["kv_tiers"] = tier_facts(chains, setup.pool, sum(r.kv_load_wait_s for r in cluster.replicas))
    metrics["engine"] = {"loop": "python", "why": why_python,
                         **({"decode_stretches": f"off: {stepping}"} if stepping else {})}
    metrics["kv_pool"] = _pool_facts(setup, slots)
    if setup.pool.layout is not None:  # window, chunk or compressed layers (sim.kvcache.hybrid)
        metrics["hybrid_kv"] = hybrid_kv_facts(setup.pool.layout, allocators)
    if workload.max_concurrency is not None:
        metrics["client"] = {
            "max_concurrency": workload.max_concurrency,
            "num_held_requests": cluster.num_held_requests,
            "mean_held_s_per_held_request": (cluster.held_time_s / cluster.num_held_requests
                                             if cluster.num_held_requests else 0.0)}
    if spec.num_speculative_tokens:
        metrics["speculative_decoding"] = speculative_facts(spec, [r.scheduler for r in cluster.replicas])
    return RunResult(allocator_name, metrics, requests, timeline, _allocator_config(setup, allocator_name))


def _allocator_config(setup: Setup, allocator_name: str) -> dict:
    return OmegaConf.to_container(setup.allocator_configs[allocator_name], resolve=True)


def _pool_facts(setup: Setup, token_slots: int) -> dict:
    pool = setup.pool
    return {"token_slots_per_replica": token_slots, "bytes_per_replica": pool.pool_bytes,
            "num_blocks_per_replica": pool.num_blocks, "block_size": pool.block_size}


def choose_engine(setup: Setup, workload: Workload, allocator_name: str, router, queue_order):
    """(an allocator for the compiled loop, None) when it covers the run and engine allows it;
    else (None, why the Python engine runs it)."""
    engine = setup.spec.engine
    if engine == "python":
        return None, "engine=python"
    allocator = _instantiate(setup.allocator_configs[allocator_name], f"allocator config '{allocator_name}'",
                             pool=setup.pool, max_model_len=setup.spec.max_model_len)
    from sim.engine.compiled.scope import why_not_compiled
    why = why_not_compiled(setup, workload, allocator, router, queue_order)
    if why is None:
        try:
            from sim.engine.compiled.driver import warm_up  # numba
        except ImportError as error:
            why = f"the compiled loop needs numba ({error})"
        else:
            warm_up()
    if why is not None and engine == "compiled":
        raise ConfigError(f"engine=compiled does not cover this run: {why}, key engine, "
                          f"use engine=auto (the Python engine where it must)")
    return (allocator, None) if why is None else (None, f"the compiled loop does not cover it: {why}")


def add_replicas(setup: Setup, env, recorder, cluster, allocator_name: str, queue_order, step_exact: bool,
                 workload: Workload, on_finish, first_index: int = 0, replica_class=Replica) -> list:
    """setup.spec.num_replicas replicas (indices from first_index) into the cluster; their allocators."""
    spec = setup.spec
    gpus, dp = spec.gpus_per_replica, spec.data_parallel_size
    swap_tokens = int(spec.swap_space_bytes * gpus // setup.pool.bytes_per_token)
    # (limits per data-parallel rank, as vLLM's: the replica schedules its ranks' sequences together)
    scheduler_spec = SchedulerSpec(spec.max_num_seqs * dp, spec.max_num_batched_tokens * dp,
                                   spec.enable_chunked_prefill, spec.max_model_len,
                                   spec.preemption_mode, swap_tokens,
                                   spec.scheduler_reserve_full_isl, spec.watermark,
                                   spec.capacity_scheduler_policy == "guaranteed_no_evict",
                                   setup.model.attention_groups,
                                   spec.max_num_batched_tokens if dp > 1 else 0,
                                   spec.num_speculative_tokens, spec.acceptance_length)
    allocator_cfg = setup.allocator_configs[allocator_name]
    first_arrival = workload.first_arrival_s
    allocators = []
    for index in range(first_index, first_index + spec.num_replicas):
        allocator = _instantiate(allocator_cfg, f"allocator config '{allocator_name}'",
                                 pool=setup.pool, max_model_len=spec.max_model_len)
        allocators.append(allocator)
        scheduler = Scheduler(scheduler_spec, allocator, queue_order)
        recorder.append_step(StepRecord(index, first_arrival, scheduler.usage(), 0, 0, 0, 0))
        cluster.add_replica(replica_class(env, index, scheduler, setup.latency, recorder, on_finish, step_exact))
    return allocators


def summarize_run(setup: Setup, workload: Workload, recorder: Recorder, wall_time_s: float):
    """metrics.json's summary of a finished simulation, and its request and timeline tables."""
    spec = setup.spec
    requests, timeline = recorder.tables()
    counts = {"truncated_prompt": workload.num_truncated_prompts,
              "skipped_malformed_records": workload.num_skipped_records,
              "failed_in_trace": workload.num_failed_requests}
    metrics = summarize(requests, timeline, wall_time_s=wall_time_s,
                        gpu=setup.latency.profile.name, profile_source=setup.latency.profile.source,
                        operator_sources=setup.latency.profile.provenance(),
                        warmup_s=spec.warmup_s, exclude_drain=spec.exclude_drain,
                        itl_samples=recorder.itl_samples(),
                        num_workload_requests=workload.num_requests, workload_counts=counts,
                        last_session_arrival_s=workload.last_arrival_s,
                        max_model_len=spec.max_model_len, slo=spec.slo,
                        workload_facts={"num_skipped_records": workload.num_skipped_records,
                                        "num_failed_requests": workload.num_failed_requests,
                                        "trace_format": workload.trace_format})
    return metrics, requests, timeline


def speculative_facts(spec, schedulers: list) -> dict:
    """What the verifications did, summed over replicas: the tokens each yielded on average (below
    the acceptance length set where sequences end or budgets run short) and the share of draft
    tokens accepted."""
    verifications = sum(s.num_verifications for s in schedulers)
    drafts = sum(s.num_draft_tokens for s in schedulers)
    verified = sum(s.num_verified_tokens for s in schedulers)
    return {"num_speculative_tokens": spec.num_speculative_tokens, "acceptance_length_set": spec.acceptance_length,
            "num_verifications": verifications, "num_draft_tokens": drafts,
            "tokens_per_verification": verified / verifications if verifications else 0.0,
            "accepted_share_of_draft_tokens": (verified - verifications) / drafts if drafts else 0.0}


def tier_facts(chains: list, pool: KvPool, load_wait_s: float) -> dict:
    """Per tier, summed over replicas (the shared store once): capacity in tokens (a local
    tier's also per replica), prefix tokens found there and the bytes loaded, blocks written and
    dropped; the loads' transfer seconds and the part of them steps waited for (all of it
    without overlap)."""
    tokens_per_block, block_bytes = pool.block_size, pool.bytes_per_token * pool.block_size
    tiers = {}
    for chain in chains:
        for tier in chain.tiers:
            entry = tiers.setdefault(tier.name, {"capacity_tokens": 0, "hit_tokens": 0, "loaded_bytes": 0,
                                                 "written_blocks": 0, "dropped_blocks": 0})
            loaded = chain.num_loaded_blocks[tier.name]
            entry["hit_tokens"] += loaded * tokens_per_block
            entry["loaded_bytes"] += int(loaded * block_bytes)
            if tier.name != "shared":
                entry["capacity_tokens_per_replica"] = tier.capacity_blocks * tokens_per_block
                entry["capacity_tokens"] += tier.capacity_blocks * tokens_per_block
                entry["written_blocks"] += tier.num_written_blocks
                entry["dropped_blocks"] += tier.num_dropped_blocks
    shared = chains[0].shared
    if shared is not None:
        tiers["shared"].update(capacity_tokens=shared.capacity_blocks * tokens_per_block,
                               written_blocks=shared.num_written_blocks, dropped_blocks=shared.num_dropped_blocks)
    return {**tiers, "load_transfer_s": sum(c.load_s_total for c in chains), "load_wait_s": load_wait_s}


def hybrid_kv_facts(layout, allocators) -> dict:
    """What a hybrid layout did: its page kinds, the padding layers' share of the layer slots of a
    block index, and the pages released because their tokens left a window (all replicas)."""
    kinds = [f"{k.per_block} x {k.group.kind}{':' + str(k.window) if k.window else ''}{' pooled' if k.pooled else ''}"
             for k in layout.page_kinds]
    per_kind = getattr(allocators[0], "per_kind", False)  # TensorRT-LLM's pools: no layer padding
    grouped = [k for k in layout.page_kinds if not k.pooled and k.group.kind != "compressed"]
    slots = sum(k.per_block * layout.group_size for k in grouped)
    padding = 0 if per_kind else sum(k.per_block * layout.group_size - k.group.count for k in grouped)
    return {"pools": "per_kind" if per_kind else "shared", "page_kinds": "; ".join(kinds),
            "layers_per_kv_cache_group": layout.group_size,
            "padding_layers_of_group_layers": padding / slots if slots else 0.0,
            "window_released_pages": sum(a.num_window_released_pages for a in allocators)}


def run_all(cfg: DictConfig, show_progress: bool = False) -> list[RunResult]:
    if cfg.disaggregation.enabled:
        from sim.disaggregation import run_disaggregated
        return run_disaggregated(cfg, show_progress)
    setup = prepare(cfg)
    workload = build_workload(cfg, setup.spec.seed)
    if setup.spec.on_overlength == "truncate":
        workload = truncate_overlength(workload, setup.spec.max_model_len)
    names = list(setup.allocator_configs)
    for line in queue_order_notes(cfg.queue_order, setup.allocator_configs, workload):
        print(line, file=sys.stderr)
    with progress_bar(show_progress, workload.num_requests * len(names), "+".join(names)) as bar:
        return [simulate(setup, workload, name, cfg.router, bar.advance, cfg.queue_order) for name in names]


def queue_order_notes(queue_order_cfg, allocator_configs: dict, workload: Workload) -> list[str]:
    """Say when a queue order cannot reorder: lpm without a prefix cache, priority without
    priorities (both then serve in arrival order, as fcfs)."""
    target = (queue_order_cfg or {}).get("_target_", "")
    if target.endswith(".LongestPrefixMatch"):
        blind = [name for name, c in allocator_configs.items()
                 if c.get("_target_", "").startswith("sim.kvcache.block.") and not c.get("enable_caching")
                 or c.get("_target_", "").startswith("sim.kvcache.contiguous.")]
        return [f"note: queue_order=lpm orders by cached prefix; {name} caches none, so its queue is in "
                f"arrival order (fcfs)" for name in blind]
    if target.endswith(".Priority") and len({r.priority for s in workload.one_copy for r in s.turns}) < 2:
        return ["note: queue_order=priority: every request has the same priority (scenario=synthetic "
                "scenario.priority_classes=N draws them), so the queue is in arrival order (fcfs)"]
    return []
