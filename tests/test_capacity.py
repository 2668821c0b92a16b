"""KV pool sizing: the vLLM memory split and the does-not-fit message; host memory."""
import re
import tracemalloc

import pytest

import sim.run as run_module
from sim.capacity import size_kv_pool
from sim.kvcache.block import BlockAllocator
from sim.kvcache.contiguous import ContiguousAllocator
from sim.kvcache.radix import RadixAllocator
from sim.errors import ConfigError
from sim.latency import load_profile
from sim.models import load_model

GiB = 2**30


def pool(model, gpu, tp, **kw):
    args = dict(tensor_parallel_size=tp, kv_dtype="bf16", block_size=16, max_model_len=4096,
                gpu_memory_utilization=0.9, activation_reserve_bytes=2 * GiB,
                kv_cache_memory_bytes=None)
    args.update(kw)
    return size_kv_pool(load_model(model), load_profile(gpu), **args)


def test_pool_is_utilization_times_memory_minus_weights_and_reserve():
    profile, model = load_profile("h100"), load_model("llama3_70b")
    result = pool("llama3_70b", "h100", 4)
    expected = 0.9 * profile.memory_bytes * 4 - model.weight_bytes - 2 * GiB * 4
    assert result.pool_bytes == int(expected)
    assert result.num_blocks == int(expected // (327_680 * 16))


def test_fixed_pool_reproduces_the_papers_opt13b_slot_count():
    # PagedAttention (Kwon et al., SOSP 2023) Table 1: OPT-13B on an A100-40GB, 12 GiB of KV
    # cache = 15.7K token slots.
    result = pool("opt_13b", "a100_40g", 1, kv_cache_memory_bytes=12 * GiB, kv_dtype="fp16")
    assert result.num_token_slots == 15_728


def test_model_that_does_not_fit_names_the_smallest_tp_degree():
    # Llama-3-70B in bf16 (about 141 GB) needs TP >= 2 on 80 GB GPUs (REFERENCE.md section 5).
    with pytest.raises(ConfigError, match=r"use tensor_parallel_size=2 or more") as err:
        pool("llama3_70b", "h100", 1)
    assert "\n" not in str(err.value)


def test_tp_beyond_kv_heads_replicates_kv():
    tp8, tp16 = pool("llama3_70b", "h100", 8), pool("llama3_70b", "h100", 16)
    assert tp16.bytes_per_token == 2 * tp8.bytes_per_token


@pytest.mark.parametrize("make", [
    lambda: BlockAllocator(20_000, 16), lambda: BlockAllocator(20_000, 16, enable_caching=True),
    lambda: BlockAllocator(20_000, 16, enable_caching=True, eviction="lfu"),
    lambda: ContiguousAllocator(320_000, 32768), lambda: RadixAllocator(320_000)])
def test_state_estimate_covers_what_an_allocator_takes_when_built(make):
    tracemalloc.start()
    allocator = make()
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert used <= allocator.state_bytes()
    if isinstance(allocator, BlockAllocator) and not allocator.enable_caching:
        assert allocator.state_bytes() <= 2 * used   # all there from the start (caching grows keys)


def test_a_cluster_too_large_for_host_memory_is_refused_with_what_fits(monkeypatch):
    monkeypatch.setattr(run_module, "available_memory_bytes", lambda: 10 * 2**30)
    with pytest.raises(ConfigError, match=r"cluster.num_replicas=5000 with the paged allocator needs about "
                                          r"[\d.,]+ GiB .* 8.0 GiB is available, key cluster.num_replicas, "
                                          r"use at most (\d+) replicas") as error:
        run_module.check_host_memory("paged", 10 * 2**20, 5000)
    fits = int(re.search(r"at most (\d+)", str(error.value)).group(1))
    assert fits == int(8 * 2**30 // (10 * 2**20 + run_module.REPLICA_OVERHEAD_BYTES))
    run_module.check_host_memory("paged", 10 * 2**20, fits)   # that many do fit
