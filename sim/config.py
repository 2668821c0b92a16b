"""Config schemas (Hydra ConfigStore) and the frozen runtime spec built after composition.

The schemas give Hydra types and the set of allowed keys (an unknown key or a wrongly typed value
fails composition); the YAML files under `scenarios/` give the defaults. Group configs whose
shape varies (scenario, model, allocator) are validated when they are turned into runtime objects.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from sim.errors import ConfigError
from sim.kvcache.tiers import OffloadSpec
from sim.latency.expert_load import EXPERT_TOKENS_CV, MAX_EXPERT_TOKENS_CV
from sim.slo import SloSpec, slo_spec

PREEMPTION_MODES = ("recompute", "swap")
# TensorRT-LLM's names (CapacitySchedulerPolicy): max_utilization admits what fits now and preempts
# when memory runs out (vLLM's and SGLang's scheduling, kvsim's default); guaranteed_no_evict
# (TensorRT-LLM's default) admits only what can run to completion, and never preempts.
CAPACITY_POLICIES = ("max_utilization", "guaranteed_no_evict")
OVERLENGTH_POLICIES = ("reject", "truncate")


@dataclass
class ClusterConfig:
    num_replicas: int = MISSING
    router_staleness_s: float = 0.0


@dataclass
class CapacityConfig:
    """`python -m sim capacity`: what to search for, and when to stop (sim/capacity_search.py)."""
    search: str = "rate"
    tolerance: float = 0.05
    max_steps: int = 16
    max_replicas: int = 64


@dataclass
class KvOffloadConfig:
    """`kv_offload.*`: KV tiers below HBM (meanings in scenarios/run.yaml, sim/kvcache/tiers.py)."""
    cpu_gib: float = 0.0
    disk_gib: float = 0.0
    shared_gib: float = 0.0
    pool_cpu: bool = False
    local_write_through: bool = False
    shared_write_through: bool = True
    overlap_load: bool = True
    eviction: str = "lru"
    disk_bandwidth_gb_per_s: float = 6.0
    disk_latency_s: float = 1e-4
    network_bandwidth_gb_per_s: float = 50.0
    network_latency_s: float = 2e-5


@dataclass
class DisaggregationConfig:
    """`disaggregation.*`: a prefill pool and a decode pool (sim/disaggregation.py)."""
    enabled: bool = False
    prefill_replicas: int = 1
    decode_replicas: int = 1
    prefill_gpu: Optional[str] = None
    prefill_tensor_parallel_size: Optional[int] = None
    decode_gpu: Optional[str] = None
    decode_tensor_parallel_size: Optional[int] = None
    link_bandwidth_gb_per_s: float = 50.0
    link_latency_s: float = 1e-4


@dataclass
class SpeculativeConfig:
    """`speculative_config.*` (vLLM's --speculative-config): a one-layer draft (DeepSeek's MTP, an
    EAGLE head) proposes num_speculative_tokens tokens a step; each verification yields
    acceptance_length tokens a sequence on average (accepted drafts + 1), a measured figure."""
    method: Optional[str] = None
    num_speculative_tokens: int = 0
    acceptance_length: Optional[float] = None


@dataclass
class SloConfig:
    """Latency targets (null: none) and the percentile each must hold at."""
    ttft_s: Optional[float] = None
    tpot_s: Optional[float] = None
    e2e_s: Optional[float] = None
    percentile: float = 90.0


@dataclass
class TraceConfig:
    """`trace.*` keys of scenario=trace and trace-stats (meanings in scenarios/run.yaml)."""
    path: Optional[str] = None
    format: str = "auto"
    max_requests: Optional[int] = None
    start_s: Optional[float] = None
    end_s: Optional[float] = None
    time_scale: float = 1.0
    target_rate_rps: Optional[float] = None
    repeat: int = 1
    sort: bool = False
    on_error: str = "raise"
    timing: str = "closed"
    share_preamble: bool = False
    arrival_process: str = "poisson"
    arrival_rate_rps: float = 1.0
    on_overlength: str = "reject"
    arrivals: str = "recorded"
    max_total_tokens: Optional[int] = None


@dataclass
class MeasureConfig:
    """The span over which latency, throughput and KV shares are measured."""
    warmup_s: float = 0.0
    exclude_drain: bool = False


@dataclass
class RunConfig:
    scenario: Any = MISSING
    model: Any = MISSING
    scheduler: Any = MISSING
    router: Any = MISSING
    queue_order: Any = MISSING
    gpu: str = MISSING
    seed: int = MISSING
    tensor_parallel_size: int = MISSING
    block_size: int = MISSING
    max_num_seqs: int = MISSING
    max_num_batched_tokens: int = MISSING
    gpu_memory_utilization: float = MISSING
    enable_prefix_caching: bool = MISSING
    enable_chunked_prefill: bool = MISSING
    scheduler_reserve_full_isl: bool = True
    watermark: float = 0.0
    capacity_scheduler_policy: str = "max_utilization"
    kv_cache_dtype: str = MISSING
    max_model_len: Optional[int] = None
    kv_cache_memory_bytes: Optional[int] = None
    activation_reserve_bytes: int = MISSING
    preemption_mode: str = MISSING
    swap_space: float = MISSING
    allocators: List[str] = MISSING
    allocator_options: Dict[str, Any] = field(default_factory=dict)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    task: str = "compare"
    sharing: Any = None
    kv_axes: Any = None  # +experiment=kv_axes: the variants, KV dtypes and workloads
    trace: TraceConfig = field(default_factory=TraceConfig)
    measure: MeasureConfig = field(default_factory=MeasureConfig)
    slo: SloConfig = field(default_factory=SloConfig)
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    capacity: CapacityConfig = field(default_factory=CapacityConfig)
    kv_offload: KvOffloadConfig = field(default_factory=KvOffloadConfig)
    disaggregation: DisaggregationConfig = field(default_factory=DisaggregationConfig)
    plots: bool = True
    quiet: bool = False
    progress: bool = True
    step_exact: bool = False
    engine: str = "auto"
    resume: bool = False
    figures_dir: Optional[str] = None
    figures: List[str] = field(default_factory=list)
    enforce_eager: bool = False
    cudagraph_capture_sizes: Optional[List[int]] = None
    quantization: Optional[str] = None
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    serving_overhead_s: float = 0.0
    api_server_per_seq_s: float = 0.0
    enable_expert_parallel: bool = False
    expert_tokens_cv: float = EXPERT_TOKENS_CV
    async_output_processing: bool = True
    async_scheduling: bool = False


@dataclass
class KvConfig:
    model: Any = MISSING
    tokens: int = MISSING
    batch: int = MISSING
    kv_cache_dtype: str = MISSING
    tensor_parallel_size: int = MISSING
    format: str = MISSING
    block_size: int = 16
    compare: List[str] = field(default_factory=list)


@dataclass
class ValidateConfig:
    path: Optional[str] = None
    out_dir: str = "results/validation"
    rows: Optional[List[str]] = None
    quick: bool = False


@dataclass
class ReportConfig:
    run_dir: str = MISSING


@dataclass
class TraceStatsConfig(RunConfig):
    """A run's keys (a scenario may set engine keys, as rag_agents and long_context do), of which
    trace-stats reads the scenario or the trace, block_size and seed; and the output format."""
    scenario: Any = None
    format: str = MISSING


def register_schemas() -> None:
    """Called by the CLI before composing; nothing is registered at import time."""
    store = ConfigStore.instance()
    store.store(name="run_schema", node=RunConfig)
    store.store(name="kv_schema", node=KvConfig)
    store.store(name="report_schema", node=ReportConfig)
    store.store(name="validate_schema", node=ValidateConfig)
    store.store(name="trace_stats_schema", node=TraceStatsConfig)


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """The runtime knobs every replica shares, after validation."""
    gpu: str
    seed: int
    tensor_parallel_size: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    enable_chunked_prefill: bool
    scheduler_reserve_full_isl: bool
    watermark: float
    capacity_scheduler_policy: str
    kv_cache_dtype: str
    max_model_len: int
    kv_cache_memory_bytes: Optional[int]
    activation_reserve_bytes: int
    num_replicas: int
    allocators: tuple[str, ...]
    preemption_mode: str
    swap_space_bytes: float
    on_overlength: str
    warmup_s: float
    exclude_drain: bool
    step_exact: bool = False
    engine: str = "auto"  # auto | compiled | python (sim.engine.compiled.scope)
    cudagraph_capture_sizes: tuple[int, ...] = ()  # decode batches replayed as CUDA graphs (): eager
    quantization: Optional[str] = None  # fp8 or nvfp4: the weights (and GEMMs) in that type, as vLLM's --quantization
    pipeline_parallel_size: int = 1      # pipeline stages per replica (each a TP group)
    data_parallel_size: int = 1          # attention ranks per replica (each a TP group), experts over all
    serving_overhead_s: float = 0.0      # per request, before the engine (API, tokenisation, detokenisation)
    api_server_per_seq_s: float = 0.0    # per running request per step on the engine's thread (vLLM <= 0.5's HTTP server)
    enable_expert_parallel: bool = False  # MoE experts spread whole over the TP group, tokens by all-to-all
    expert_tokens_cv: float = EXPERT_TOKENS_CV  # the experts' shares' spread (EP: the busiest GPU sets the pace)
    async_output_processing: bool = True  # output processing overlaps the next step's GPU work
    async_scheduling: bool = False        # the host's whole step overlaps the GPU's (vLLM's --async-scheduling)
    router_staleness_s: float = 0.0      # the router's loads are at most this old (0: live)
    slo: SloSpec = SloSpec()             # latency targets the metrics check
    kv_offload: OffloadSpec = OffloadSpec()  # KV tiers below HBM (all off by default)
    num_speculative_tokens: int = 0      # draft tokens a decode step verifies (0: no speculative decoding)
    acceptance_length: float = 1.0       # tokens a verification yields a sequence on average

    @property
    def gpus_per_replica(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size


def vllm_capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """vLLM V1's default CUDA-graph batch sizes (vllm/config/compilation.py, v0.11):
    [1, 2, 4] + range(8, 256, 8) + range(256, max + 1, 16), max = min(2 max_num_seqs, 512)."""
    largest = min(2 * max_num_seqs, 512)
    return tuple(n for n in (1, 2, 4, *range(8, 256, 8), *range(256, largest + 1, 16)) if n <= largest)


VLLM_CAPTURE_SIZES = vllm_capture_sizes(256)
# vLLM's --quantization values kvsim models -> the weights' dtype (modelopt_fp4 is what vLLM calls
# an NVFP4 checkpoint from NVIDIA's ModelOpt; TensorRT-LLM calls it NVFP4).
QUANTIZATIONS = {None: None, "fp8": "fp8", "nvfp4": "nvfp4", "modelopt_fp4": "nvfp4"}


SPECULATIVE_METHODS = ("mtp", "eagle")


def _require(condition: bool, key: str, what: str, fix: str) -> None:
    if not condition:
        raise ConfigError(f"{what}, key {key}, {fix}")


ENGINES = ("auto", "compiled", "python")


def engine_spec(cfg: DictConfig, native_window: int = 0) -> EngineSpec:
    """Validated runtime knobs; a null max_model_len becomes the model's native window."""
    c = OmegaConf.to_container(cfg, resolve=True)
    if c["max_model_len"] is None:
        _require(native_window > 0, "max_model_len", "max_model_len is null and the model states no window",
                 "set max_model_len=<tokens>")
        c["max_model_len"] = native_window
    _require(c["seed"] >= 0, "seed", f"seed={c['seed']} is negative", "use 0 or a positive integer")
    _require(c["serving_overhead_s"] >= 0, "serving_overhead_s",
             f"serving_overhead_s={c['serving_overhead_s']} is negative", "give seconds >= 0 (0: none)")
    _require(c["api_server_per_seq_s"] >= 0, "api_server_per_seq_s",
             f"api_server_per_seq_s={c['api_server_per_seq_s']} is negative", "give seconds >= 0 (0: none)")
    _require(c["pipeline_parallel_size"] >= 1, "pipeline_parallel_size",
             f"pipeline_parallel_size={c['pipeline_parallel_size']} is below 1",
             "use 1 or more stages (at most the model's layers; uneven splits are allowed, as in vLLM)")
    cv = c["expert_tokens_cv"]
    _require(math.isfinite(cv) and 0 <= cv <= MAX_EXPERT_TOKENS_CV, "expert_tokens_cv",
             f"expert_tokens_cv={cv} is outside 0-{MAX_EXPERT_TOKENS_CV:g}",
             f"give the coefficient of variation of the experts' shares of the routed tokens, 0 to "
             f"{MAX_EXPERT_TOKENS_CV:g} (0: every GPU alike; {EXPERT_TOKENS_CV}: DeepSeek-R1 without a load balancer)")
    _require(c["data_parallel_size"] >= 1, "data_parallel_size",
             f"data_parallel_size={c['data_parallel_size']} is below 1",
             "use 1, or the attention ranks of a MoE replica with enable_expert_parallel=true")
    spec_cfg = c["speculative_config"]
    k, accept = spec_cfg["num_speculative_tokens"], spec_cfg["acceptance_length"]
    _require(spec_cfg["method"] in (None, *SPECULATIVE_METHODS), "speculative_config.method",
             f"unknown speculative_config.method '{spec_cfg['method']}'",
             "use mtp or eagle (a one-layer draft), or null (no speculative decoding)")
    _require(k >= 0 and (k == 0) == (spec_cfg["method"] is None), "speculative_config.num_speculative_tokens",
             f"speculative_config.num_speculative_tokens={k} with method={spec_cfg['method']}",
             "give a method and 1 or more tokens, or neither")
    _require(k > 0 or accept is None, "speculative_config.acceptance_length",
             f"speculative_config.acceptance_length={accept} without speculative decoding",
             "give a method and num_speculative_tokens too, or leave acceptance_length null")
    _require(k == 0 or (accept is not None and 1 <= accept <= k + 1), "speculative_config.acceptance_length",
             f"speculative_config.acceptance_length={accept} with num_speculative_tokens={k}",
             f"give the measured mean tokens a verification yields, between 1 and {k + 1}")
    _require(c["tensor_parallel_size"] >= 1, "tensor_parallel_size",
             f"tensor_parallel_size={c['tensor_parallel_size']} is below 1", "use 1, 2, 4 or 8")
    _require(1 <= c["block_size"] <= 1024, "block_size", f"block_size={c['block_size']} is out of range",
             "use 1 to 1024 (vLLM uses 16)")
    _require(c["max_num_seqs"] >= 1, "max_num_seqs", f"max_num_seqs={c['max_num_seqs']} is below 1",
             "use a positive integer")
    _require(c["max_model_len"] >= 1, "max_model_len", f"max_model_len={c['max_model_len']} is below 1",
             "use a positive integer")
    _require(c["max_num_batched_tokens"] >= 1, "max_num_batched_tokens",
             f"max_num_batched_tokens={c['max_num_batched_tokens']} is below 1", "use a positive integer")
    _require(c["enable_chunked_prefill"] or c["max_num_batched_tokens"] >= c["max_model_len"],
             "max_num_batched_tokens",
             f"without chunked prefill max_num_batched_tokens={c['max_num_batched_tokens']} cannot "
             f"hold a max_model_len={c['max_model_len']} prompt",
             "raise it to max_model_len or set enable_chunked_prefill=true")
    _require(0 < c["gpu_memory_utilization"] <= 1, "gpu_memory_utilization",
             f"gpu_memory_utilization={c['gpu_memory_utilization']} is not in (0, 1]", "use e.g. 0.9")
    _require(c["cluster"]["num_replicas"] >= 1, "cluster.num_replicas",
             f"cluster.num_replicas={c['cluster']['num_replicas']} is below 1", "use a positive integer")
    _require(len(c["allocators"]) > 0, "allocators", "allocators is empty", "list at least one, e.g. [paged]")
    _require(c["preemption_mode"] in PREEMPTION_MODES, "preemption_mode",
             f"unknown preemption_mode '{c['preemption_mode']}'", "use recompute or swap")
    _require(c["swap_space"] >= 0, "swap_space", f"swap_space={c['swap_space']} is negative",
             "give GiB of CPU memory per GPU (vLLM's default is 4)")
    _require(0 <= c["watermark"] < 1, "watermark", f"watermark={c['watermark']} is not in [0, 1)",
             "give a share of KV blocks, e.g. 0.01 (vLLM's default is 0)")
    _require(c["capacity_scheduler_policy"] in CAPACITY_POLICIES, "capacity_scheduler_policy",
             f"unknown capacity_scheduler_policy '{c['capacity_scheduler_policy']}'",
             "use max_utilization (vLLM's scheduling) or guaranteed_no_evict (TensorRT-LLM's default)")
    _require(c["trace"]["on_overlength"] in OVERLENGTH_POLICIES, "trace.on_overlength",
             f"unknown trace.on_overlength '{c['trace']['on_overlength']}'", "use reject or truncate")
    _require(c["measure"]["warmup_s"] >= 0, "measure.warmup_s",
             f"measure.warmup_s={c['measure']['warmup_s']} is negative", "give seconds >= 0")
    _require(c["kv_cache_memory_bytes"] is None or c["kv_cache_memory_bytes"] > 0, "kv_cache_memory_bytes",
             "kv_cache_memory_bytes must be positive", "give bytes per GPU or null")
    _require(c["quantization"] in QUANTIZATIONS, "quantization",
             f"unknown quantization '{c['quantization']}'",
             "use fp8, nvfp4 (modelopt_fp4; FP4 GPUs only) or null (the model's own weights)")
    _require(c["cluster"]["router_staleness_s"] >= 0, "cluster.router_staleness_s",
             f"cluster.router_staleness_s={c['cluster']['router_staleness_s']} is negative",
             "give seconds >= 0 (0: the router reads replicas live)")
    _require(c["engine"] in ENGINES, "engine", f"unknown engine '{c['engine']}'",
             "use auto (compiled where it covers the run), compiled or python")
    sizes = c["cudagraph_capture_sizes"] or list(vllm_capture_sizes(c["max_num_seqs"]))
    _require(all(isinstance(n, int) and n >= 1 for n in sizes), "cudagraph_capture_sizes",
             f"cudagraph_capture_sizes={sizes} holds a size below 1", "give batch sizes >= 1, or null for vLLM's")
    return EngineSpec(
        gpu=c["gpu"], seed=c["seed"], tensor_parallel_size=c["tensor_parallel_size"],
        block_size=c["block_size"], max_num_seqs=c["max_num_seqs"],
        max_num_batched_tokens=c["max_num_batched_tokens"],
        gpu_memory_utilization=c["gpu_memory_utilization"],
        enable_prefix_caching=c["enable_prefix_caching"],
        enable_chunked_prefill=c["enable_chunked_prefill"],
        scheduler_reserve_full_isl=c["scheduler_reserve_full_isl"], watermark=c["watermark"],
        capacity_scheduler_policy=c["capacity_scheduler_policy"],
        kv_cache_dtype=c["kv_cache_dtype"],
        max_model_len=c["max_model_len"], kv_cache_memory_bytes=c["kv_cache_memory_bytes"],
        activation_reserve_bytes=c["activation_reserve_bytes"],
        num_replicas=c["cluster"]["num_replicas"], allocators=tuple(c["allocators"]),
        preemption_mode=c["preemption_mode"], swap_space_bytes=c["swap_space"] * 2**30,
        on_overlength=c["trace"]["on_overlength"], warmup_s=c["measure"]["warmup_s"],
        exclude_drain=c["measure"]["exclude_drain"], step_exact=c["step_exact"], engine=c["engine"],
        cudagraph_capture_sizes=() if c["enforce_eager"] else tuple(sorted(set(sizes))),
        quantization=QUANTIZATIONS[c["quantization"]], pipeline_parallel_size=c["pipeline_parallel_size"],
        data_parallel_size=c["data_parallel_size"],
        serving_overhead_s=c["serving_overhead_s"], api_server_per_seq_s=c["api_server_per_seq_s"],
        enable_expert_parallel=c["enable_expert_parallel"],
        expert_tokens_cv=c["expert_tokens_cv"],
        async_output_processing=c["async_output_processing"], async_scheduling=c["async_scheduling"],
        router_staleness_s=c["cluster"]["router_staleness_s"], slo=slo_spec(c["slo"]),
        kv_offload=OffloadSpec(**c["kv_offload"]), num_speculative_tokens=k,
        acceptance_length=float(accept) if k else 1.0)
