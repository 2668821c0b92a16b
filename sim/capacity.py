"""How many KV token slots a replica has: the vLLM memory split.

    pool = gpu_memory_utilization * memory * GPUs - weights - activation reserve * GPUs

over the replica's TP x PP x DP GPUs (with data-parallel attention every rank stores all but the
routed experts: ModelSpec.stored_weight_bytes), unless `kv_cache_memory_bytes` (per GPU, as in
vLLM) fixes it.
A token's KV is stored `ModelSpec.kv_replication(TP)` times across a TP group (REFERENCE.md
section 1); pipeline stages hold their own layers' KV, and every stage keeps as many blocks as
the one with the most layers can (ceil(layers / PP) of them), as vLLM sizes one pool for all.
"""
from __future__ import annotations

from dataclasses import dataclass

from sim.errors import ConfigError
from sim.kv_layout import HybridLayout, hybrid_layout
from sim.latency.profile import GpuProfile
from sim.models import ModelSpec

GiB = 2**30
TP_DEGREES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True, slots=True)
class KvPool:
    pool_bytes: int
    bytes_per_token: float  # per replica, replicas of a token across ranks included
    block_size: int
    num_blocks: int
    # Models with sliding, chunked, compressed or state layers: vLLM's hybrid layout (a block is
    # then one page of a KV-cache group, and bytes_per_token a token of one such page); with state
    # layers block_size is the raised one (sim.kv_layout.state_block_size).
    layout: HybridLayout | None = None

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def context_tokens(self) -> int:
        """Tokens of context the pool holds, as vLLM logs its 'GPU KV cache size': blocks over
        KV-cache groups x block size (every group takes a block per block_size tokens, a state
        group one per sequence counted alike); pages of several sizes: the pool over each group's
        bytes per token. Without a hybrid layout, num_slots."""
        if self.layout is None:
            return self.num_slots
        groups = self.layout.cache_groups()
        if self.layout.equal_pages:
            return self.num_blocks // len(groups) * self.block_size
        return int(self.pool_bytes // sum(kind.page_bytes / kind.tokens_per_page
                                          for kind, _ in groups))

    @property
    def num_token_slots(self) -> int:
        """Slots when memory is one linear address space (contiguous allocators)."""
        return int(self.pool_bytes // self.bytes_per_token)


def _pool_bytes(model: ModelSpec, profile: GpuProfile, tp: int, utilization: float,
                reserve_per_gpu: float, dp: int = 1, draft_layers: int = 0) -> float:
    gpus = tp * dp
    draft = dp * draft_layers * model.weight_bytes / model.num_layers  # a draft layer on every rank
    return (utilization * profile.memory_bytes * gpus - model.stored_weight_bytes(dp) - draft
            - reserve_per_gpu * gpus)


def size_kv_pool(model: ModelSpec, profile: GpuProfile, *, tensor_parallel_size: int,
                 kv_dtype: str, block_size: int, max_model_len: int,
                 gpu_memory_utilization: float, activation_reserve_bytes: float,
                 kv_cache_memory_bytes: int | None, pipeline_parallel_size: int = 1,
                 data_parallel_size: int = 1, draft_layers: int = 0) -> KvPool:
    """draft_layers: a speculative-decoding draft's layers (its weights and KV besides the model's,
    counted as layers like the model's)."""
    tp, pp, dp = tensor_parallel_size, pipeline_parallel_size, data_parallel_size
    most_layers = -(-(model.num_layers + draft_layers) // pp)  # ceil: the most loaded stage
    scale = model.kv_replication(tp) * (most_layers * pp / model.num_layers)
    if kv_cache_memory_bytes is not None:
        pool = float(kv_cache_memory_bytes) * tp * pp * dp
    else:
        pool = _pool_bytes(model, profile, tp * pp, gpu_memory_utilization, activation_reserve_bytes, dp,
                           draft_layers)
    block_size = model.engine_block_size(block_size, kv_dtype, tp)  # (raised for state layers)
    layout = hybrid_layout(model.layer_groups, [model.entry_bytes(g, kv_dtype) for g in model.layer_groups],
                           block_size, scale, model.kv_replication(tp))
    if layout is None:
        bytes_per_token = model.kv_bytes_per_token(kv_dtype) * scale
        one_sequence = max_model_len * bytes_per_token
    else:  # a "block" is one page of the smallest kind; a whole prompt of max_model_len is admitted at once
        bytes_per_token = min(kind.page_bytes for kind in layout.page_kinds) / block_size
        one_sequence = sum(kind.blocks(0, max_model_len) * kind.per_block * kind.page_bytes
                           for kind in layout.page_kinds)
    num_blocks = int(max(pool, 0) // (bytes_per_token * block_size))
    if num_blocks * block_size * bytes_per_token / dp < one_sequence:  # a sequence lives on one rank
        if dp > 1:
            raise ConfigError(f"model {model.name} does not fit: data_parallel_size={dp} ranks of "
                              f"tensor_parallel_size={tp} on {profile.name} leave {pool / dp / GiB:.2f} GiB of KV "
                              f"pool a rank, less than one max_model_len={max_model_len} sequence "
                              f"({one_sequence / GiB:.2f} GiB), key max_model_len, lower it, or give each rank "
                              f"more GPUs (tensor_parallel_size) or memory (gpu_memory_utilization)")
        raise ConfigError(_does_not_fit(model, profile, tp, pool, one_sequence, max_model_len,
                                        gpu_memory_utilization, activation_reserve_bytes,
                                        kv_cache_memory_bytes is not None))
    return KvPool(int(pool), bytes_per_token, block_size, num_blocks, layout)


def _does_not_fit(model, profile, tp, pool, sequence_bytes, max_model_len, utilization,
                  reserve, pool_fixed) -> str:
    """sequence_bytes: what one max_model_len sequence takes at this tensor_parallel_size (pages
    and the copies TP keeps included)."""
    what = (f"model {model.name} does not fit: tensor_parallel_size={tp} on {profile.name} leaves "
            f"{pool / GiB:.2f} GiB of KV pool, less than one max_model_len={max_model_len} sequence "
            f"({sequence_bytes / GiB:.2f} GiB)")
    if pool_fixed:
        return f"{what}, key kv_cache_memory_bytes, raise it or lower max_model_len"
    for degree in TP_DEGREES:
        need = sequence_bytes / model.kv_replication(tp) * model.kv_replication(degree)
        if _pool_bytes(model, profile, degree, utilization, reserve) >= need:
            return f"{what}, key tensor_parallel_size, use tensor_parallel_size={degree} or more"
    return f"{what}, key gpu, choose a GPU with more memory or a smaller model"
