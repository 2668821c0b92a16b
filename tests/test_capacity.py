"""KV pool sizing: the vLLM memory split and the does-not-fit message."""
import pytest

from sim.capacity import size_kv_pool
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
