"""Prefix caching over pages of several sizes (sim.kvcache.sized_pages): DeepSeek-V4's compressed
layers, whose pooled entries sit in 256-token pages and raw windows in 64-token pages
(REFERENCE.md section 8: vLLM's `--block-size 256`, a separate window cache of 64-token blocks)."""
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from sim.kv_layout import LayerGroup, hybrid_layout
from sim.kvcache.sized_pages import SizedPrefixAllocator
from sim.models import load_model
from sim.run import prepare, run_all
from tests.conftest import compose_config
from tests.helpers import seq as make_seq


def v4_flash(budget_bytes: int = 10**10) -> SizedPrefixAllocator:
    model = load_model("deepseek_v4_flash")
    groups = model.layer_groups
    return SizedPrefixAllocator(budget_bytes, 256, hybrid_layout(groups, [model.entry_bytes(g) for g in groups], 256))


def prefill(allocator, s, chunk: int = 2048):
    """Admit s with its hit and compute its prompt chunk by chunk, as the scheduler does."""
    hit = allocator.lookup_prefix(s)
    done = hit.num_tokens
    assert allocator.allocate(s, min(chunk, s.num_tokens - done), hit) == ()
    done = min(done + chunk, s.num_tokens)
    while done < s.num_tokens:
        s.num_computed = done
        step = min(chunk, s.num_tokens - done)
        assert allocator.allocate(s, step) == ()
        done += step
    return hit


def test_v4_flash_pages_and_hits_follow_vllms_block_sizes():
    allocator = v4_flash()
    # Page spans: 256 tokens for pooled entries (64 CSA or 2 HCA entries), 64 for windows.
    assert (allocator.unit, allocator.align) == (64, 256)
    # Layers per page: the 2 window-only layers, 21 CSA (entries, indexer keys, window), 20 HCA.
    assert [real for _, real in allocator.groups] == [2, 21, 21, 21, 20, 20]
    first = make_seq(1, [(7, 5000)], output_len=4)
    prefill(allocator, first)
    allocator.free(first)
    # The same prompt: the hit is the largest multiple of 256 below its last token (4999).
    again = make_seq(2, [(7, 5000)], output_len=4)
    hit = allocator.lookup_prefix(again)
    assert hit.num_tokens == 4864
    sliding, csa, csa_index, csa_window, hca, hca_window = hit.blocks
    assert len(csa) == len(csa_index) == len(hca) == 19 and min(csa + hca) >= 0  # pooled: every page
    # A window of 128 needs the tokens from 4864 - 127 = 4737 on: 64-token pages 74 and 75 only.
    for window in (sliding, csa_window, hca_window):
        assert len(window) == 76 and window[:74] == (-1,) * 74 and min(window[74:]) >= 0
    # Sharing only its first 3,000 tokens: 11 pooled pages (2,816 tokens), the window's inside them.
    other = make_seq(3, [(7, 3000), (8, 2000)], output_len=4)
    assert allocator.lookup_prefix(other).num_tokens == 2816
    assert allocator.cached_prefix_tokens(other.request) == 2816


def test_page_bytes_are_vllms_padded_pages():
    allocator = v4_flash()
    # REFERENCE.md 8: 584 B per entry, 132 B per indexer key, pages padded to multiples of 576 B.
    def padded(nbytes):
        return math.ceil(nbytes / 576) * 576
    assert allocator.pool.page_bytes == [
        2 * padded(64 * 584),          # window-only layers: one KV-cache group of 2 layers
        21 * padded(64 * 584), 21 * padded(64 * 132), 21 * padded(64 * 584),  # CSA
        20 * padded(2 * 584), 20 * padded(64 * 584)]                           # HCA: 1,168 -> 1,728 B


def test_eviction_takes_the_oldest_cached_pages_and_uncached_pages_never_wait():
    allocator = v4_flash()
    first = make_seq(1, [(7, 5000)], output_len=4)
    prefill(allocator, first)
    pool = allocator.pool
    # The windows' dropped pages are keyed, so they stay cached; partial pages hold no key.
    dropped = pool.cached_free_bytes
    assert dropped > 0 and allocator.num_window_released_pages == 3 * 62  # pages below 3969 // 64
    allocator.free(first)
    held_before = pool.budget_bytes - pool.free_bytes
    assert held_before == 0 and pool.untouched_bytes + pool.cached_free_bytes == pool.budget_bytes
    # A budget that holds the cached pages and a little more: a new prompt evicts the oldest.
    tight = v4_flash(budget_bytes=pool.cached_free_bytes + pool.page_bytes[1] * 3)
    again = make_seq(1, [(7, 5000)], output_len=4)
    prefill(tight, again)
    tight.free(again)
    assert tight.lookup_prefix(make_seq(2, [(7, 5000)], output_len=4)).num_tokens == 4864
    filler = make_seq(3, [(9, 1200)], output_len=4)
    prefill(tight, filler)
    assert tight.pool.num_evicted > 0
    # The oldest cached pages were the windows' first dropped ones; the hit's window pages, freed
    # last, are still there, so the same 4,864 tokens hit.
    assert tight.lookup_prefix(make_seq(2, [(7, 5000)], output_len=4)).num_tokens == 4864


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 4), st.integers(1, 40), st.integers(0, 2)), min_size=1, max_size=40))
def test_pages_are_conserved_and_usage_adds_up(ops):
    layout = hybrid_layout((LayerGroup("sliding", 1, window=6, block_tokens=4),
                            LayerGroup("compressed", 2, window=6, ratio=4, block_tokens=16, window_block_tokens=4)),
                           [10, 10], 16)
    allocator, live = SizedPrefixAllocator(4000, 16, layout), {}
    for seq_id, tokens, content in ops:
        if seq_id in live:
            allocator.free(live.pop(seq_id))
        else:
            s = make_seq(1000 + seq_id, [(content, 20), (50 + seq_id, tokens)], output_len=4)
            hit = allocator.lookup_prefix(s)
            assert hit.num_tokens % allocator.align == 0 and hit.num_tokens < s.num_tokens
            if allocator.allocate(s, s.num_tokens - hit.num_tokens, hit) is not None:
                live[seq_id] = s
        usage, pool = allocator.usage(), allocator.pool
        assert sum(usage.as_tuple()) == usage.capacity and min(usage.as_tuple()) >= 0
        held = sum(n * b for n, b in zip(pool.held_pages, pool.page_bytes))
        assert held + pool.cached_free_bytes + pool.untouched_bytes == pool.budget_bytes
    for s in live.values():
        allocator.free(s)
    assert sum(allocator.pool.held_pages) == 0 and allocator.pool.free_bytes == 4000


def test_v4_runs_with_prefix_caching_end_to_end():
    cfg = compose_config("run", ["+experiment=golden", "model=deepseek_v4_flash", "gpu=h200", "tensor_parallel_size=8",
                                 "allocators=[paged,prefix]", "scenario.num_sessions=20", "max_model_len=16384",
                                 "kv_cache_memory_bytes=8000000000"])
    paged, prefix = (r.metrics for r in run_all(cfg))
    assert prefix["num_finished"] == paged["num_finished"] == paged["num_requests"] > 0
    assert prefix["prefix_cache"]["hit_rate"] > 0.3
    assert prefix["latency_s"]["ttft"]["p50"] < paged["latency_s"]["ttft"]["p50"]


def test_window_churn_does_not_flush_a_shared_prefix():
    # vLLM PR 43447 (REFERENCE.md 8): window pages freed during prefill had pushed cached prefix
    # blocks out; with uncached blocks returned first, a 16K shared prefix hits ~99%. Here requests
    # share 16,384 tokens, each with its own 512-token question, one after another, in a budget of
    # a little over one request's pages: every request after the first finds the whole prefix.
    probe = v4_flash()
    first = make_seq(0, [(1, 16384), (100, 512)], output_len=4)
    prefill(probe, first)
    one_request = probe.pool.budget_bytes - probe.pool.untouched_bytes
    allocator = v4_flash(budget_bytes=one_request * 11 // 10)
    hits = []
    for i in range(20):
        s = make_seq(i, [(1, 16384), (100 + i, 512)], output_len=4)
        hits.append(prefill(allocator, s).num_tokens)
        allocator.free(s)
    assert allocator.pool.num_evicted > 0  # the budget was tight: pages were evicted
    assert hits == [0] + [16384] * 19


def test_kv_tiers_skipped_on_compressed_layers_are_said(capsys):
    cfg = compose_config("run", ["+experiment=golden", "model=deepseek_v4_flash", "gpu=h200", "tensor_parallel_size=8",
                                 "allocators=[prefix]", "max_model_len=16384", "kv_cache_memory_bytes=8000000000",
                                 "kv_offload.cpu_gib=4"])
    prepare(cfg)
    assert "kv_offload is not built for models with window or compressed layers: prefix run without KV tiers" \
        in capsys.readouterr().err
