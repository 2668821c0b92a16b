"""State (Mamba-2) layers: their state's bytes as vLLM's mamba2_state_shape counts them, the block
size and padding vLLM logs for real checkpoints, one page per sequence in the allocator, and
their time (projections, scan) in the step."""
import dataclasses

import pytest

from sim.capacity import size_kv_pool
from sim.kvcache.hybrid import HybridBlockAllocator
from sim.latency.model import BatchShape, LatencyModel
from sim.latency.profile import load_profile
from sim.models import load_model, model_from_dict
from sim.run import run_all
from sim.scheduler.scheduler import _group_attention
from tests.conftest import compose_config
from tests.test_hybrid import seq


def mamba2(count, heads, head_dim, groups, state=128, conv=4, dtype="", mlp=False):
    return {"kind": "state", "count": count, "ssm_heads": heads, "ssm_head_dim": head_dim, "ssm_groups": groups,
            "ssm_state_size": state, "conv_kernel": conv, "ssm_state_dtype": dtype, "mlp": mlp}


def test_the_state_is_vllms_conv_and_ssm_state_shapes():
    # vLLM's mamba2_state_shape on Nemotron-H-8B: conv (4 - 1) x (8,192 + 2 x 8 x 128), SSM
    # 128 x 64 x 128, both BF16 by default (mamba_ssm_cache_dtype auto)
    group = load_model("nemotron_h_8b").layer_groups[0]
    assert group.mamba_state_bytes() == 3 * 10_240 * 2 + 128 * 64 * 128 * 2 == 2_158_592
    fp32 = dataclasses.replace(group, ssm_state_dtype="fp32")
    assert fp32.mamba_state_bytes() == 3 * 10_240 * 2 + 128 * 64 * 128 * 4


def padding_percent(model, kv_dtype=None):
    """vLLM's log line: 'Padding mamba page size by X% to ensure that mamba page size and attention
    page size are exactly equal.'"""
    block = model.engine_block_size(16, kv_dtype)
    by_kind = {g.kind: g for g in model.layer_groups}
    state = model.entry_bytes(by_kind["state"])
    page = block * model.entry_bytes(by_kind["full"], kv_dtype)
    return round(100 * (page - state) / state, 2)


GRANITE_4_H_SMALL = dict(  # ibm-granite/granite-4.0-h-small: 36 Mamba-2 + 4 attention layers, MoE in each
    name="granite_h_small_like", num_layers=40, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
    intermediate_size=768, vocab_size=100352, num_params=32.2e9,
    layers=[mamba2(36, 128, 64, 1, mlp=True), {"kind": "full", "count": 4}])


def test_block_size_and_padding_are_what_vllm_logs_for_real_checkpoints():
    # granite-4.0-h-small, BF16, vLLM 0.11.1 (ROCm/ROCm issue 5590): "Setting attention block size
    # to 528 tokens ..." and "Padding mamba page size by 0.69% ..."
    granite = model_from_dict(GRANITE_4_H_SMALL)
    assert granite.engine_block_size(16) == 528 and padding_percent(granite) == 0.69
    # Nemotron-3-Nano-30B-A3B (FP32 SSM state by its config) with FP8 KV, vLLM 0.19.0: "Setting
    # attention block size to 4176 tokens ..." and "Padding mamba page size by 0.19% ..."
    nano = load_model("nemotron3_nano_30b")
    assert nano.engine_block_size(16, "fp8") == 4176 and padding_percent(nano, "fp8") == 0.19
    # a block size already large enough is kept, as vLLM keeps a user's larger one
    assert granite.engine_block_size(1024) == 1024


def test_a_calculator_that_counts_kv_on_every_layer_would_overstate_nemotron_h_13x():
    # the over-count BLIS issue 1552 reports: KV on all 52 layers instead of the 4 attention ones
    model = load_model("nemotron_h_8b")
    usage = {u.kind: u for u in model.kv_usage(8192, 1, 16)}
    assert usage["full"].stored_bytes == 4 * 8192 * 2 * 8 * 128 * 2
    assert usage["mlp"].allocated_bytes == 0 and usage["state"].state_bytes == 24 * 2_158_592
    assert 52 * 2 * 8 * 128 * 2 / model.kv_bytes_per_token() == 13


def state_allocator(num_blocks=40):
    model = load_model("nemotron_h_8b")
    pool = size_kv_pool(model, load_profile("h100"), tensor_parallel_size=1, kv_dtype="bf16", block_size=16,
                        max_model_len=8192, gpu_memory_utilization=0.9, activation_reserve_bytes=0,
                        kv_cache_memory_bytes=num_blocks * 528 * 4096 * 4)
    return HybridBlockAllocator.from_pool(pool, 8192), pool


def test_a_sequence_holds_one_state_page_per_group_whatever_its_length():
    allocator, pool = state_allocator()
    assert pool.block_size == 528 and pool.layout.group_size == 4
    state_kind = next(k for k in pool.layout.page_kinds if k.per_sequence)
    assert state_kind.per_block == 6  # 24 state layers in groups of 4
    first = seq(1, final_len=5000)
    allocator.allocate(first, 100)
    assert allocator.num_free == pool.pool_bytes - (6 + 1) * pool.layout.page_kinds[0].page_bytes
    for _ in range(10):
        allocator.allocate(first, 400)  # 4,100 tokens: 8 attention blocks, still 6 state pages
    assert allocator.num_free == pool.pool_bytes - (6 + 8) * pool.layout.page_kinds[0].page_bytes
    usage = allocator.usage()
    assert usage.token_states == 24 * 2_158_592 + 4100 * 4 * 4096  # states live whole
    allocator.free(first)
    assert allocator.num_free == pool.pool_bytes and not allocator.seqs


def test_a_larger_state_never_fits_more_sequences():
    bf16 = load_model("nemotron_h_8b")
    fp32 = dataclasses.replace(bf16, layers=(dataclasses.replace(bf16.layers[0], ssm_state_dtype="fp32"),
                                             *bf16.layers[1:]))

    def sequences_that_fit(model, tokens=2000):
        pool = size_kv_pool(model, load_profile("h100"), tensor_parallel_size=1, kv_dtype="bf16", block_size=16,
                            max_model_len=8192, gpu_memory_utilization=0.9, activation_reserve_bytes=0,
                            kv_cache_memory_bytes=None)
        per_seq = sum(k.blocks(0, tokens) * k.per_block * k.page_bytes for k in pool.layout.page_kinds)
        return pool.pool_bytes // per_seq

    assert sequences_that_fit(fp32) < sequences_that_fit(bf16)


def decode_step(latency, model, batch, context):
    groups = _group_attention([context] * batch, [], model.layer_groups)
    return latency.breakdown(BatchShape(num_decode_seqs=batch, decode_context_tokens=batch * context,
                                        num_sampled=batch, group_attention=groups))


def test_state_layers_pay_per_sequence_and_attention_per_cached_token():
    model = load_model("nemotron_h_8b")
    latency = LatencyModel(model, load_profile("h100"), 1, "bf16")
    base, longer, wider = (decode_step(latency, model, 64, 2000), decode_step(latency, model, 64, 8000),
                           decode_step(latency, model, 128, 2000))
    assert longer["ssm_scan"] == base["ssm_scan"]  # a state does not grow with the context
    assert longer["attention_decode"] > 3 * base["attention_decode"]
    assert 1.8 < wider["ssm_scan"] / base["ssm_scan"] < 2.0  # states read and written per sequence
    # 64 sequences' states read and written in 24 layers: at least those bytes at HBM bandwidth
    assert base["ssm_scan"] >= 64 * 2 * 2_158_592 * 24 / load_profile("h100").hbm_bandwidth_bytes_per_s


def test_layers_without_an_mlp_run_none_and_every_block_all_reduces():
    model = load_model("nemotron_h_8b")
    with_mlps = dataclasses.replace(model, layers=tuple(dataclasses.replace(g, mlp=True) if g.kind != "mlp" else g
                                                        for g in model.layers))
    assert (model.num_mlp_layers, with_mlps.num_mlp_layers) == (24, 52)
    plain, fuller = (LatencyModel(m, load_profile("h100"), 2, "bf16") for m in (model, with_mlps))
    assert fuller._token_ops(256)[1] == pytest.approx(plain._token_ops(256)[1] * 52 / 24)
    activations = 256 * model.hidden_size * 2
    assert plain._token_ops(256)[2] == pytest.approx((24 + 4 + 24) * plain._allreduce(activations))


def test_a_state_model_runs_end_to_end_and_says_its_block_size(capsys):
    cfg = compose_config("run", ["model=nemotron_h_8b", "gpu=h100", "tensor_parallel_size=1", "allocators=[paged]",
                                 "scenario=sharegpt", "scenario.max_requests=60", "max_model_len=8192",
                                 "cluster.num_replicas=1", "measure.warmup_s=0"])
    (result,) = run_all(cfg)
    assert "block_size raised from 16 to 528 tokens" in capsys.readouterr().err
    assert result.metrics["kv_pool"]["block_size"] == 528
    assert (result.requests.status == "finished").sum() == 60
    assert "6 x state" in result.metrics["hybrid_kv"]["page_kinds"]


def test_the_calculator_prices_states_at_the_raised_block_and_says_so():
    from sim.kv_report import kv_report
    report = kv_report(load_model("nemotron_h_8b"), 4096, 8, 16, 1, "bf16")
    assert report["block_size"] == 528 and any("raised from 16 to 528" in note for note in report["notes"])
    state = next(k for k in report["kinds"] if k["kind"] == "state")
    assert state["state_bytes"] == 8 * 24 * 2_158_592
    assert state["padding_bytes"] == 8 * 24 * (528 * 4096 - 2_158_592)  # each state page padded to 528 tokens
    # 4,096 tokens in 528-token blocks: 8 blocks of 4 layers, per sequence
    assert report["kv_cache_bytes"] == 8 * (24 * 528 * 4096 + 4 * 8 * 528 * 4096)


def test_step_exact_and_the_default_loop_agree_on_a_state_model():
    def metrics(step_exact):
        cfg = compose_config("run", ["model=nemotron_h_8b", "gpu=h100", "tensor_parallel_size=1", "allocators=[paged]",
                                     "scenario=sharegpt", "scenario.max_requests=80", "max_model_len=8192",
                                     "cluster.num_replicas=1", "measure.warmup_s=0", f"step_exact={step_exact}"])
        (result,) = run_all(cfg)
        return {k: v for k, v in result.metrics.items() if k not in ("wall_time_s", "engine")}
    assert metrics("false") == metrics("true")


def test_beyond_one_kv_head_a_rank_states_split_and_kv_is_copied_as_vllm_sizes_them():
    from sim.kv_report import kv_report
    nano = load_model("nemotron3_nano_30b")  # 2 KV heads: TP 4 keeps one per rank, copied twice
    # vLLM compares one rank's state (2,134,016 / 4 B) with one rank's token page (1 head x 128 x 2 x 2 B)
    assert [nano.engine_block_size(16, None, tp) for tp in (1, 2, 4, 8)] == [2096, 2096, 1056, 528]
    report = kv_report(nano, 8192, 16, 16, 4, "bf16")
    # per rank: 6 attention layers x 8 blocks of 1,056 tokens x 512 B, and 23 states in 4 groups of 6
    # (24 pages, one padding layer) of 1,056 x 512 B each, for 16 sequences, on 4 ranks
    per_rank = 16 * (6 * 8 * 1056 * 512 + 24 * 1056 * 512)
    assert report["kv_cache_bytes_stored_across_tp"] == 4 * per_rank
    pool = size_kv_pool(nano, load_profile("h100"), tensor_parallel_size=4, kv_dtype="bf16", block_size=16,
                        max_model_len=8192, gpu_memory_utilization=0.9, activation_reserve_bytes=0,
                        kv_cache_memory_bytes=None)
    state = next(k for k in pool.layout.page_kinds if k.per_sequence)
    assert pool.block_size == 1056 and state.entry_bytes == 2_134_016  # the whole state, not copied
    assert state.page_bytes == 6 * 1056 * 512 * 4  # a group's page on every rank


def test_a_tp_size_that_splits_no_mamba_groups_is_refused_as_vllm_refuses_it():
    from sim.errors import ConfigError
    from sim.run import prepare
    cfg = compose_config("run", ["model=nemotron_h_8b", "gpu=h100", "tensor_parallel_size=16", "allocators=[paged]",
                                 "max_model_len=8192"])
    with pytest.raises(ConfigError, match="128 Mamba-2 heads and 8 groups evenly.*use one of 1, 2, 4, 8$"):
        prepare(cfg)


def test_a_decode_runs_three_kernels_a_state_layer():
    model = load_model("nemotron_h_8b")
    latency = LatencyModel(model, load_profile("h100"), 1, "bf16")
    one = decode_step(latency, model, 1, 100)["ssm_scan"]
    t0 = load_profile("h100").op("elementwise").t0_s
    assert one >= 24 * 3 * t0  # each kernel's fixed cost, in each of the 24 layers


def test_a_plain_activation_moves_two_intermediate_widths_a_gated_one_three():
    from sim.latency.model import elementwise_kernels
    relu2 = load_model("nemotron_h_8b")  # squared ReLU: up read, its activation written
    gated = dataclasses.replace(relu2, gated_mlp=True)
    last = {m.gated_mlp: elementwise_kernels(m, 1, 1, 0.0)[-1] for m in (relu2, gated)}
    assert last[False] == (24, 2.0 * 21504 * 2) and last[True] == (24, 3.0 * 21504 * 2)


def test_the_pool_reports_context_tokens_as_vllm_logs_its_kv_cache_size():
    # vLLM's "GPU KV cache size: N tokens" for a hybrid: blocks // KV-cache groups x block size
    nemotron = size_kv_pool(load_model("nemotron_h_8b"), load_profile("h100"), tensor_parallel_size=1,
                            kv_dtype="bf16", block_size=16, max_model_len=8192, gpu_memory_utilization=0.9,
                            activation_reserve_bytes=0, kv_cache_memory_bytes=None)
    assert len(nemotron.layout.cache_groups()) == 7  # 1 attention group + 6 state groups of 4 layers
    assert nemotron.context_tokens == nemotron.num_blocks // 7 * 528 < nemotron.num_slots
    plain = size_kv_pool(load_model("llama3_8b"), load_profile("h100"), tensor_parallel_size=1, kv_dtype="bf16",
                         block_size=16, max_model_len=8192, gpu_memory_utilization=0.9, activation_reserve_bytes=0,
                         kv_cache_memory_bytes=None)
    assert plain.context_tokens == plain.num_slots
