"""Per-layer KV layouts (sim.kv_layout) against hand computation from REFERENCE.md sections 1, 8."""
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.errors import ConfigError
from sim.models import load_model, model_from_dict

GEMMA3_27B = dict(name="gemma_like", num_layers=62, hidden_size=5376, num_heads=32, num_kv_heads=16,
                  head_dim=128, intermediate_size=21504, vocab_size=262208, num_params=27e9,
                  layers=[{"kind": "sliding", "count": 52, "window": 1024}, {"kind": "full", "count": 10}])
PER_LAYER_TOKEN = 2 * 16 * 128 * 2  # 2 * H_kv * d_h * s, BF16


def by_kind(model, tokens, batch=1, block_size=16, kv_dtype=None):
    return {u.kind: u for u in model.kv_usage(tokens, batch, block_size, kv_dtype)}


def test_sliding_layers_store_the_window_and_pad_the_last_group():
    # REFERENCE.md section 8: Gemma-3-27B's 52 sliding + 10 full layers make groups of 10 in
    # vLLM's hybrid manager; the last sliding group is 2 real layers + 8 padding.
    model = model_from_dict(GEMMA3_27B)
    usage = by_kind(model, 4096)
    assert usage["full"].stored_bytes == 10 * 4096 * PER_LAYER_TOKEN
    assert usage["full"].padding_bytes == 0
    assert usage["sliding"].stored_bytes == 52 * 1024 * PER_LAYER_TOKEN
    live_blocks = 4095 // 16 - (4096 - 1024) // 16 + 1  # blocks holding tokens [3072, 4096)
    assert usage["sliding"].allocated_bytes == 60 * live_blocks * 16 * PER_LAYER_TOKEN
    assert usage["sliding"].padding_bytes == 8 * live_blocks * 16 * PER_LAYER_TOKEN
    assert usage["sliding"].freed_tokens == 4096 - 1024


def test_window_blocks_leave_as_their_tokens_leave_the_window():
    model = model_from_dict({**GEMMA3_27B, "layers": [{"kind": "sliding", "count": 62, "window": 1000}]})
    for tokens in range(1, 5000, 37):
        usage = by_kind(model, tokens)["sliding"]
        blocks = usage.allocated_bytes / (62 * 16 * PER_LAYER_TOKEN)
        assert blocks <= -(-1000 // 16) + 1  # never more than the window's blocks plus one
        assert usage.freed_tokens == max(0, tokens - 1000)
        assert usage.entries == min(tokens, 1000)


def test_chunked_local_layers_restart_at_each_chunk():
    model = model_from_dict({**GEMMA3_27B, "layers": [{"kind": "chunked", "count": 62, "window": 8192}]})
    assert by_kind(model, 8192)["chunked"].entries == 8192
    assert by_kind(model, 8193)["chunked"].entries == 1
    assert by_kind(model, 20000)["chunked"].entries == 20000 - 2 * 8192


def test_deepseek_v4_pro_and_v32_per_token_bytes_and_ratio_at_1m():
    # REFERENCE.md section 8, derived: V3.2 61 x 788 = 48,068 B/token; V4-Pro 30 x (584/4 + 132/4)
    # + 31 x 584/128 = about 5,511 (11.5% of V3.2), plus a fixed 61 x 128 x 584 B window.
    v32, pro = load_model("deepseek_v32"), load_model("deepseek_v4_pro")
    assert v32.kv_bytes_per_token() == 61 * (656 + 132)
    assert pro.kv_bytes_per_token() == pytest.approx(30 * (584 / 4 + 132 / 4) + 31 * 584 / 128)
    tokens = 1 << 20
    stored = {m.name: sum(u.stored_bytes + u.indexer_bytes + u.window_bytes for u in m.kv_usage(tokens))
              for m in (v32, pro)}
    window = sum(u.window_bytes for u in pro.kv_usage(tokens))
    assert window == 61 * 128 * 584
    assert stored["deepseek_v4_pro"] / stored["deepseek_v32"] == pytest.approx(0.115, abs=0.002)
    # with the indexer in FP4 (68 B an entry) the ratio is the official 10%
    fp4 = dataclasses.replace(pro, layers=tuple(dataclasses.replace(g, indexer_entry_bytes=68 if g.indexer_entry_bytes else 0)
                                                 for g in pro.layers))
    fp4_stored = sum(u.stored_bytes + u.indexer_bytes + u.window_bytes for u in fp4.kv_usage(tokens))
    assert fp4_stored / stored["deepseek_v32"] == pytest.approx(0.105, abs=0.002)


def test_deepseek_v4_flash_is_about_8_percent_of_v32():
    flash, v32 = load_model("deepseek_v4_flash"), load_model("deepseek_v32")
    assert flash.kv_bytes_per_token() == pytest.approx(21 * (584 / 4 + 132 / 4) + 20 * 584 / 128)
    assert flash.kv_bytes_per_token() / v32.kv_bytes_per_token() == pytest.approx(0.080, abs=0.002)


def test_v4_pages_are_padded_to_576_byte_multiples():
    # REFERENCE.md section 8: 256-token blocks hold 64 CSA or 2 HCA entries; an HCA page of
    # 1,168 B is padded to 1,728 B; the window cache uses 64-token blocks.
    pro = load_model("deepseek_v4_pro")
    hca = next(g for g in pro.layers if g.ratio == 128)
    usage = dataclasses.replace(pro, layers=(hca,), num_layers=hca.count).kv_usage(256 * 10)[0]
    window_pages = (2560 - 1) // 64 - (2560 - 128) // 64 + 1  # tokens [2432, 2560): 2 blocks
    assert usage.allocated_bytes == hca.count * (10 * 1728 + window_pages * 37440)
    csa = next(g for g in pro.layers if g.ratio == 4)
    usage = dataclasses.replace(pro, layers=(csa,), num_layers=csa.count).kv_usage(256)[0]
    assert usage.allocated_bytes == csa.count * (37440 + 8640 + 2 * 37440)  # entries, indexer, window


def test_shared_layers_allocate_nothing_and_cla2_halves_the_cache():
    base = load_model("llama3_70b")
    cla = model_from_dict({**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                           "name": "cla2", "layers": [{"kind": "full", "count": 40}, {"kind": "shared", "count": 40}]})
    assert cla.kv_bytes_per_token() * 2 == base.kv_bytes_per_token()
    assert by_kind(cla, 4096)["shared"].allocated_bytes == 0


def test_state_layers_are_fixed_per_sequence_in_pages_padded_to_the_attention_page():
    model = model_from_dict({**GEMMA3_27B, "layers": [{"kind": "state", "count": 52, "state_bytes": 1 << 20},
                                                      {"kind": "full", "count": 10}]})
    short, long = by_kind(model, 10, batch=3)["state"], by_kind(model, 100_000, batch=3)["state"]
    assert short.allocated_bytes == long.allocated_bytes and short.state_bytes == 3 * 52 << 20
    # vLLM raises the block to 16 x ceil(1 MiB / (16 x 8,192 B)) = 128 tokens, a page of exactly
    # 1 MiB; the 52 state layers fill groups of 10 (the full layers' count), the last padded by 8
    assert model.engine_block_size(16) == 128 and long.padding_bytes == 3 * 8 << 20
    odd = model_from_dict({**GEMMA3_27B, "layers": [{"kind": "state", "count": 52, "state_bytes": 1_000_000},
                                                    {"kind": "full", "count": 10}]})
    assert odd.engine_block_size(16) == 128  # 1,000,000 B padded to the 1 MiB attention page
    assert by_kind(odd, 10)["state"].padding_bytes == 52 * ((1 << 20) - 1_000_000) + (8 << 20)


@pytest.mark.parametrize("layers, message", [
    ([{"kind": "sliding", "count": 62}], "window"),
    ([{"kind": "wavy", "count": 62}], "unknown"),
    ([{"kind": "full", "count": 61}], "not num_layers"),
    ([{"kind": "full", "count": 62, "stride": 2}], "unknown layer field"),
])
def test_bad_layer_groups_are_one_line_errors(layers, message):
    with pytest.raises(ConfigError, match=message):
        model_from_dict({**GEMMA3_27B, "layers": layers})


@settings(max_examples=60, deadline=None)
@given(window=st.integers(1, 4096), longer=st.integers(0, 4096), tokens=st.integers(0, 20000),
       block=st.sampled_from([1, 16, 64]))
def test_a_longer_window_never_lowers_memory_use(window, longer, tokens, block):
    def allocated(w):
        model = model_from_dict({**GEMMA3_27B, "layers": [{"kind": "sliding", "count": 52, "window": w},
                                                          {"kind": "full", "count": 10}]})
        return sum(u.allocated_bytes for u in model.kv_usage(tokens, 1, block))
    assert allocated(window + longer) >= allocated(window)


@settings(max_examples=60, deadline=None)
@given(kv_heads=st.sampled_from([1, 2, 4, 8, 16]), fewer=st.sampled_from([1, 2, 4]),
       tokens=st.integers(1, 32768), pool_gib=st.integers(1, 80))
def test_fewer_bytes_per_token_never_lowers_the_maximum_concurrency(kv_heads, fewer, tokens, pool_gib):
    def max_sequences(heads):
        model = model_from_dict({**GEMMA3_27B, "num_kv_heads": heads})
        per_sequence = sum(u.allocated_bytes for u in model.kv_usage(tokens))
        return (pool_gib << 30) // per_sequence
    small = max(kv_heads // fewer, 1)
    assert max_sequences(small) >= max_sequences(kv_heads)
