"""Models with sliding-window, chunked-local and DSA layers in the simulator: vLLM's hybrid KV
cache manager (sim.kvcache.hybrid) and per-group attention (sim.kv_layout reach, REFERENCE.md 8)."""
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from sim.errors import ConfigError
from sim.kv_layout import LayerGroup, decode_reach, hybrid_layout, prefill_reach
from sim.kvcache.hybrid import HybridBlockAllocator, per_kind_shares
from sim.latency.model import BatchShape, LatencyModel
from sim.latency.profile import load_profile
from sim.models import load_model, model_from_dict
from sim.run import prepare, run_all
from tests.conftest import compose_config

SMALL = ["+experiment=golden", "allocators=[paged]", "scenario.num_sessions=30"]


def brute_force(group, cached, new):
    """Pairs against the cache and within the chunk, query by query."""
    pairs = causal = 0
    for p in range(cached, cached + new):
        if group.kind == "sliding":
            keys = range(max(0, p - group.window + 1), p + 1)
        elif group.kind == "chunked":
            keys = range(p // group.window * group.window, p + 1)
        else:
            keys = range(p + 1)
        for key in keys:
            causal, pairs = (causal + 1, pairs) if key >= cached else (causal, pairs + 1)
    return pairs, causal


@settings(max_examples=300, deadline=None)
@given(kind=st.sampled_from(["sliding", "chunked", "full"]), window=st.integers(1, 50),
       cached=st.integers(0, 150), new=st.integers(1, 70))
def test_what_each_kind_reads_matches_a_query_by_query_count(kind, window, cached, new):
    group = LayerGroup(kind, 1, window=0 if kind == "full" else window)
    assert prefill_reach(group, cached, new)[:2] == brute_force(group, cached, new)
    assert decode_reach(group, cached + 1) == sum(brute_force(group, cached, 1))


def metrics_of(cfg):
    metrics = run_all(cfg)[0].metrics
    metrics.pop("wall_time_s")
    return metrics


@pytest.mark.parametrize("allocator, layers", [
    ("paged", [{"kind": "sliding", "window": 10**6}]),
    ("paged", [{"kind": "chunked", "window": 10**6}]),
    ("paged", [{"kind": "sliding", "window": 10**6, "half": True}, {"kind": "full"}]),
    ("prefix", [{"kind": "sliding", "window": 10**6}]),
    ("prefix", [{"kind": "chunked", "window": 10**6}]),
])
def test_a_window_longer_than_any_sequence_gives_the_full_attention_results(allocator, layers):
    # Memory (the hybrid manager, with or without its prefix cache) and time (per-group reach, no
    # stretches) both reduce exactly to the plain model's when no token ever leaves a window. (With
    # two KV-cache groups a prefix cache evicts each group's blocks on their own, as vLLM's does,
    # so its hits differ from one cache of whole blocks: not an identity.)
    base = compose_config("run", [*SMALL, f"allocators=[{allocator}]"])
    cfg = base.copy()
    OmegaConf.set_struct(cfg, False)
    model = OmegaConf.to_container(cfg.model)
    n = model["num_layers"]
    counts = [n // 2, n - n // 2] if len(layers) == 2 else [n]
    model["layers"] = [{k: v for k, v in g.items() if k != "half"} | {"count": c} for g, c in zip(layers, counts)]
    cfg.model = model
    hybrid = metrics_of(cfg)
    facts = hybrid.pop("hybrid_kv")  # only hybrid layouts report their pages
    assert facts["window_released_pages"] == 0  # no token ever left a window
    plain = metrics_of(base)
    assert hybrid.pop("kv_pool")["bytes_per_replica"] == plain.pop("kv_pool")["bytes_per_replica"]  # pages differ
    hybrid.pop("engine"), plain.pop("engine")  # which loop ran (the hybrid layout: Python's)
    assert hybrid == plain and "hybrid_kv" not in plain


def make_allocator(num_blocks=64, block_size=4, per_kind=None):
    """5 sliding + 2 full layers of 1 B entries: pages of 2 layers x 4 tokens = 8 B (shared), or
    per_kind budgets in bytes."""
    groups = (LayerGroup("sliding", 5, window=6), LayerGroup("full", 2))
    layout = hybrid_layout(groups, [1, 1], block_size)
    return HybridBlockAllocator(per_kind or [num_blocks * 8], block_size, layout, per_kind is not None)


def seq(seq_id, final_len=1000):
    return SimpleNamespace(seq_id=seq_id, final_len=final_len)


def test_the_layout_groups_layers_by_the_smallest_kind_and_pads_the_last_group():
    layout = hybrid_layout((LayerGroup("sliding", 5, window=6), LayerGroup("full", 2)), [1, 1], 4)
    assert layout.group_size == 2 and [k.per_block for k in layout.page_kinds] == [3, 1]  # 5 -> 6, 1 padding
    gemma = load_model("gemma3_27b")
    gemma_layout = hybrid_layout(gemma.layer_groups, [gemma.entry_bytes(g) for g in gemma.layer_groups], 16)
    assert gemma_layout.group_size == 10 and [k.per_block for k in gemma_layout.page_kinds] == [6, 1]  # REFERENCE.md 8


def test_window_blocks_leave_on_time_and_nothing_leaks():
    allocator, s = make_allocator(), seq(1)
    assert allocator.allocate(s, 10) == ()  # 3 blocks per group: 3 sliding groups + 1 full group
    assert allocator.num_free == (64 - 4 * 3) * 8
    for computed in range(10, 40):
        allocator.allocate(s, 1)
        first = max(0, computed - 6 + 1)  # vLLM frees blocks no query from `computed` on reads
        sliding_blocks = computed // 4 - first // 4 + 1
        full_blocks = computed // 4 + 1
        assert allocator.num_free == (64 - 3 * sliding_blocks - full_blocks) * 8
        assert sliding_blocks <= -(-6 // 4) + 1
    usage = allocator.usage()
    assert sum(usage.as_tuple()) == usage.capacity
    allocator.free(s)
    assert allocator.num_free == 64 * 8 and not allocator.seqs


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 4), st.integers(1, 9)), min_size=1, max_size=60),
       per_kind=st.sampled_from([None, [25 * 20, 15 * 8]]))  # bytes: 25 pages of 5 layers, 15 of 2
def test_pages_are_conserved_and_usage_adds_up(ops, per_kind):
    allocator, lengths = make_allocator(num_blocks=40, per_kind=per_kind), {}
    for seq_id, tokens in ops:
        s = seq(seq_id, final_len=30)
        if seq_id in lengths and lengths[seq_id] + tokens > 30:
            allocator.free(s)
            del lengths[seq_id]
            continue
        if allocator.allocate(s, tokens) is not None:
            lengths[seq_id] = lengths.get(seq_id, 0) + tokens
        usage = allocator.usage()
        assert sum(usage.as_tuple()) == usage.capacity and min(usage.as_tuple()) >= 0
        assert usage.free == round(allocator.num_free)
    for seq_id in list(lengths):
        allocator.free(seq(seq_id))
    assert allocator.num_free == (40 * 8 if per_kind is None else sum(per_kind))


def test_per_kind_pools_split_memory_as_tensorrt_llm_does():
    # NVIDIA/TensorRT-LLM, KVCacheManagerTest.BlockManagerTestWindowSizeToShare: windows 1024 (1
    # layer), 4096 (3 layers), 8192 (2 layers) get 3.45%, 41.38% and 55.17% of the memory.
    layout = hybrid_layout((LayerGroup("sliding", 1, window=1024), LayerGroup("sliding", 3, window=4096),
                            LayerGroup("sliding", 2, window=8192)), [1, 1, 1], 16)
    assert per_kind_shares(layout, 8192) == pytest.approx([0.0345, 0.4138, 0.5517], abs=1e-4)


def test_per_kind_pools_run_without_layer_padding():
    def run(pools):
        cfg = compose_config("run", ["+experiment=golden", "allocators=[paged]", "scenario.num_sessions=30",
                                     f"+allocator_options.paged.pools={pools}", "kv_cache_memory_bytes=1207959552"])
        OmegaConf.set_struct(cfg, False)
        model = OmegaConf.to_container(cfg.model)
        model["layers"] = [{"kind": "sliding", "count": 22, "window": 512}, {"kind": "full", "count": 10}]
        cfg.model = model
        return metrics_of(cfg)
    shared, per_kind = run("shared"), run("per_kind")
    assert shared["unserved"]["unfinished"] == per_kind["unserved"]["unfinished"] == 0
    assert shared["hybrid_kv"]["window_released_pages"] > 0  # 512-token windows on longer sequences
    assert shared["hybrid_kv"]["padding_layers_of_group_layers"] == pytest.approx(8 / 40)  # 22 -> 30, 10
    assert per_kind["hybrid_kv"]["padding_layers_of_group_layers"] == 0
    assert shared["kv"]["internal_frag_frac"] > per_kind["kv"]["internal_frag_frac"]  # 8 padding layers
    small = compose_config("run", [*SMALL, "+allocator_options.paged.pools=per_kind", "model=gemma3_27b",
                                   "gpu=h200", "max_model_len=32768", "kv_cache_memory_bytes=20000000000"])
    with pytest.raises(ConfigError, match="pools=per_kind leaves the sliding pool smaller than one"):
        prepare(small)  # a static split can starve a kind of the blocks one whole prompt needs
    with pytest.raises(ConfigError, match="pools=per_kind applies to models with sliding"):
        prepare(compose_config("run", [*SMALL, "+allocator_options.paged.pools=per_kind"]))


def test_a_shorter_window_fits_more_and_reads_less():
    def run(window):
        cfg = compose_config("run", [*SMALL, "model=llama3_8b"])
        OmegaConf.set_struct(cfg, False)
        model = OmegaConf.to_container(cfg.model)
        model["layers"] = [{"kind": "sliding", "count": 24, "window": window}, {"kind": "full", "count": 8}]
        cfg.model = model
        return metrics_of(cfg)
    short, long = run(256), run(10**6)
    assert short["scheduler"]["mean_batch_size"] >= long["scheduler"]["mean_batch_size"]
    assert short["kv"]["token_states_of_capacity"] < long["kv"]["token_states_of_capacity"]
    base = load_model("llama3_8b")
    fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
    for window, expected in ((256, 256), (10**6, 8000)):
        model = model_from_dict({**fields, "layers": [{"kind": "sliding", "count": 24, "window": window},
                                                      {"kind": "full", "count": 8}]})
        latency = LatencyModel(model, load_profile("h100"), 1, "bf16")
        shape = BatchShape(num_decode_seqs=1, decode_context_tokens=8000, num_sampled=1,
                           group_attention=((min(8000, window), 0, 0, 0, 0, 0), (8000, 0, 0, 0, 0, 0)))
        reads = latency.decode_op.time(latency.attention_class, expected, lambda t: (0.0, t * latency.group_kv_bytes[0], 1, 0.0))
        assert latency.breakdown(shape)["attention_decode"] >= 24 * reads  # a window's layers read its keys only
        if window == 256:
            windowed = latency.breakdown(shape)["attention_decode"]
        else:
            assert windowed < 0.5 * latency.breakdown(shape)["attention_decode"]


def test_dsa_reads_its_top_k_and_pays_its_indexer():
    model = load_model("deepseek_v32")
    latency = LatencyModel(model, load_profile("h200"), 8, "fp8")
    groups = model.layer_groups

    def decode(context):
        keys = tuple((decode_reach(g, context) * 4, 0, 0, 0, context * 4, 0) for g in groups)
        shape = BatchShape(num_decode_seqs=4, decode_context_tokens=4 * context, num_sampled=4, group_attention=keys)
        return latency.breakdown(shape)
    short, long = decode(2048), decode(64000)
    assert long["attention_decode"] == pytest.approx(short["attention_decode"], rel=0.05)  # top-2,048 both
    assert long["attention_indexer"] > 2.5 * short["attention_indexer"]  # the indexer scores every key


@pytest.mark.parametrize("overrides, message", [
    (["model=gemma3_27b", "allocators=[contiguous]"], "contiguous allocator does not take a model with window"),
    (["model=deepseek_v4_flash", "allocators=[prefix]", "+allocator_options.prefix.eviction=lfu"],
     "eviction=lfu for pages of several sizes"),
    (["model=deepseek_v4_flash", "allocators=[radix]"], "radix allocator does not take"),
    (["model=deepseek_v4_flash", "allocators=[paged]", "+allocator_options.paged.pools=per_kind"],
     "per_kind for compressed or state layers"),
    (["model=gemma3_27b", "allocators=[paged]",
      "+model.layers=[{kind: state, count: 52, state_bytes: 1000}, {kind: full, count: 10}]"],
     "state layers without their Mamba-2 widths"),
    (["model=nemotron_h_8b", "allocators=[prefix]"], "prefix caching over state"),
    (["model=nemotron_h_8b", "allocators=[paged]", "+allocator_options.paged.pools=per_kind"],
     "per_kind for compressed or state layers"),
])
def test_what_the_simulator_cannot_run_yet_is_one_line(overrides, message):
    cfg = compose_config("run", [*overrides, "gpu=h200", "tensor_parallel_size=8", "max_model_len=8192"])
    with pytest.raises(ConfigError, match=message):
        prepare(cfg)


def test_layer_kinds_of_different_entry_sizes_are_refused():
    base = load_model("gemma3_27b")
    fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
    with pytest.raises(ConfigError, match="entry sizes"):
        from sim.capacity import size_kv_pool
        odd = model_from_dict({**fields, "layers": [{"kind": "sliding", "count": 52, "window": 1024, "entry_bytes": 100},
                                                     {"kind": "full", "count": 10}]})
        size_kv_pool(odd, load_profile("h200"), tensor_parallel_size=1, kv_dtype="bf16", block_size=16,
                     max_model_len=4096, gpu_memory_utilization=0.9, activation_reserve_bytes=0,
                     kv_cache_memory_bytes=None)


def test_a_window_group_shortens_a_hit_from_the_right():
    # vLLM's rule: full-attention groups match left to right; a window group needs only the blocks
    # its last query reads (the last w - 1 tokens) to be cached, and shortens the hit until it has them.
    from sim.kvcache.hybrid_prefix import HybridPrefixAllocator
    from tests.helpers import seq as make_seq
    layout = hybrid_layout((LayerGroup("sliding", 1, window=8), LayerGroup("full", 1)), [1, 1], 4)
    allocator = HybridPrefixAllocator(40, 4, layout)
    first = make_seq(101, [(7, 41)], output_len=1)
    assert allocator.allocate(first, 41) == ()  # 11 blocks in each group, 10 of them keyed
    allocator.free(first)  # freed deepest first: the window group's blocks 10, 9, ... then the full group's
    again = make_seq(102, [(7, 41)], output_len=1)
    assert allocator.lookup_prefix(again).num_tokens == 40  # 10 blocks, never the last known token
    filler = make_seq(103, [(8, 40)], output_len=1)
    assert allocator.allocate(filler, 40) == ()  # 18 never-used blocks, then the window group's 10 and 9
    hit = allocator.lookup_prefix(again)
    assert hit.num_tokens == 36  # the window needs blocks 8-9 for a 40-token hit; 7-8 serve 36
    sliding, full = hit.blocks
    assert sliding[:7] == (-1,) * 7 and min(sliding[7:]) >= 0 and min(full) >= 0 and len(full) == 9
    assert allocator.allocate(again, 5, hit) == ()
    allocator.free(again)
    allocator.free(filler)
    assert allocator.pool.num_free == 40 and sum(allocator.used_per_group) == 0


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 12), st.integers(0, 2)), min_size=1, max_size=50))
def test_the_hybrid_prefix_cache_conserves_blocks_and_usage_adds_up(ops):
    from sim.kvcache.hybrid_prefix import HybridPrefixAllocator
    from tests.helpers import seq as make_seq
    layout = hybrid_layout((LayerGroup("sliding", 3, window=6), LayerGroup("full", 2)), [1, 1], 4)
    allocator, live = HybridPrefixAllocator(60, 4, layout), {}
    for seq_id, tokens, content in ops:
        if seq_id in live:
            s = live.pop(seq_id)
            allocator.free(s)
        else:
            s = make_seq(1000 + seq_id, [(content, 8), (50 + seq_id, tokens)], output_len=4)
            hit = allocator.lookup_prefix(s)
            if allocator.allocate(s, s.num_tokens - hit.num_tokens, hit) is not None:
                live[seq_id] = s
        usage = allocator.usage()
        assert sum(usage.as_tuple()) == usage.capacity and min(usage.as_tuple()) >= 0
    for s in live.values():
        allocator.free(s)
    assert allocator.pool.num_free == 60 and sum(allocator.used_per_group) == 0


def test_shared_layers_read_their_sources_reach():
    # Gemma 3n: the last num_kv_shared_layers layers read the last earlier layer of their own type
    # (tests/data/hf/SOURCES.md), so a shared layer behind a sliding one reads a window.
    from sim.hf_config import model_from_hf
    from tests.test_hf_config import HF
    model = model_from_hf(str(HF / "gemma3n_e4b_partial.json"), quiet=True)
    shared = [g for g in model.layer_groups if g.kind == "shared"]
    assert sorted((g.count, g.window) for g in shared) == [(3, 0), (12, 512)]
    for group in shared:
        assert decode_reach(group, 4000) == (512 if group.window else 4000)
        assert prefill_reach(group, 3000, 100) == prefill_reach(
            LayerGroup("sliding", 1, window=512) if group.window else LayerGroup("full", 1), 3000, 100)
    usage = {u.kind: u for u in model.kv_usage(4000)}
    assert usage["shared"].allocated_bytes == 0


def decode_flops_per_token(name, context):
    """One decode token's FLOPs at `context` through the time model's own work: each layer group's
    attention over what it reads (decode_reach), its indexer over every key it scores, the linear
    layers (2 x active parameters) and the LM head."""
    from sim.kv_layout import NO_ATTENTION, indexer_keys
    from sim.latency.operators import attention_decode_work
    model = load_model(name)
    qk, v = model.attention_dims(decode=True)
    total = 2.0 * model.active_linear_params_per_token + 2.0 * model.hidden_size * model.vocab_size
    for group in model.layer_groups:
        if group.kind in NO_ATTENTION:
            continue
        total += group.count * attention_decode_work(1, decode_reach(group, context), model.num_heads, qk, v, 0)[0]
        if group.indexer_heads:
            total += group.count * 2.0 * group.indexer_heads * group.indexer_head_dim * indexer_keys(group, context)
    return total


def test_deepseek_v4_decode_flops_at_1m_against_deepseeks_published_share():
    # DeepSeek-V4's model card (REFERENCE.md section 8): at 1M tokens V4-Pro needs 27% of V3.2's
    # single-token inference FLOPs, V4-Flash 10%. kvsim's time model gives 0.30 and 0.13: the
    # indexer over every key dominates V3.2 (about 1 TFLOP a token), as it should.
    v32 = decode_flops_per_token("deepseek_v32", 1_000_000)
    assert decode_flops_per_token("deepseek_v4_pro", 1_000_000) / v32 == pytest.approx(0.27, abs=0.04)
    assert decode_flops_per_token("deepseek_v4_flash", 1_000_000) / v32 == pytest.approx(0.10, abs=0.04)
    # at 8K tokens the indexer matters little: the compressed layers' saving is mostly gone
    assert decode_flops_per_token("deepseek_v4_pro", 8192) / decode_flops_per_token("deepseek_v32", 8192) > 0.8


def test_guaranteed_no_evict_reserves_a_windows_pages_under_chunked_prefill():
    """Gemma-3's sliding layers hold, during a prefill chunk, the window's last tokens and the
    chunk's: guaranteed_no_evict reserves that much per sliding kind, so a load that preempts
    over a hundred times under vLLM's scheduling (first-chunk admission) preempts never."""
    from sim.run import run_all
    from tests.conftest import compose_config
    load = ["scenario=synthetic", "model=gemma3_27b", "gpu=h100", "tensor_parallel_size=1",
            "kv_cache_memory_bytes=10000000000", "max_model_len=16384", "scenario.num_requests=60",
            "scenario.request_rate_per_s=30", "scenario.input_tokens_mean=12000",
            "scenario.output_tokens_mean=200", "scheduler_reserve_full_isl=false", "allocators=[paged]",
            "plots=false", "progress=false"]
    preempted = {}
    for policy in ("max_utilization", "guaranteed_no_evict"):
        [result] = run_all(compose_config("run", [*load, f"capacity_scheduler_policy={policy}"]))
        preempted[policy] = int(result.requests.num_preemptions.sum())
        assert (result.requests.status != "finished").sum() == (result.requests.status == "rejected").sum()
    assert preempted["max_utilization"] > 20 and preempted["guaranteed_no_evict"] == 0
