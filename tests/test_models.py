"""KV-cache sizes against REFERENCE.md section 1 and the model configs of section 5."""
import dataclasses

import pytest

from sim.errors import ConfigError
from sim.models import available_models, load_model, resolve_kv_dtype

GiB = 2**30


@pytest.mark.parametrize("name, per_token", [
    # REFERENCE.md section 1, "Per token": 80 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes.
    ("llama2_70b", 327_680), ("llama3_70b", 327_680), ("qwen25_72b", 327_680),
    ("llama31_70b", 327_680),    # Llama-3.1-70B keeps Llama-3-70B's attention shape
    ("llama31_8b", 131_072),     # 32 layers x 8 KV heads x 128 x 2 x 2 bytes
    ("llama31_405b", 516_096),   # 126 layers
    ("deepseek_v3", 70_272),     # MLA: 61 layers x 576 elements x 2 bytes
    ("opt_13b", 819_200),        # MHA: 40 layers x 40 heads x 128
])
def test_kv_bytes_per_token_matches_reference(name, per_token):
    assert load_model(name).kv_bytes_per_token() == per_token


@pytest.mark.parametrize("name, gib", [("llama2_70b", 1.25), ("llama2_70b_mha", 10.00)])
def test_cache_size_at_4096_tokens_matches_reference_table(name, gib):
    # REFERENCE.md section 1 worked numbers: B = 1, t = 4096, bf16.
    assert load_model(name).kv_bytes_per_token() * 4096 / GiB == gib


def test_every_shipped_model_loads():
    names = available_models()
    for required in ("llama2_70b", "llama2_70b_mha", "llama3_8b", "llama3_70b", "llama31_405b",
                     "llama31_8b", "llama31_70b",
                     "qwen25_72b", "mistral_7b", "opt_13b", "deepseek_v3"):
        assert required in names
    for name in names:
        assert load_model(name).kv_bytes_per_token() > 0


def test_llama31_is_llama3_with_a_131072_token_window():
    # Meta-Llama-3.1-8B/70B config.json (meta-llama on Hugging Face): max_position_embeddings
    # 131072 with rope_scaling type llama3; layers, heads, KV heads, widths and vocabulary are
    # those of Llama-3 (REFERENCE.md section 5, 8.03B and 70.55B parameters).
    for size in ("8b", "70b"):
        old, new = load_model(f"llama3_{size}"), load_model(f"llama31_{size}")
        assert old.max_position_embeddings == 8192 and new.max_position_embeddings == 131_072
        assert dataclasses.replace(new, name=old.name, max_position_embeddings=8192) == old


def test_shrinking_axes_each_scale_their_factor():
    base = load_model("llama2_70b")
    mha = load_model("llama2_70b_mha")
    assert mha.kv_bytes_per_token() == 8 * base.kv_bytes_per_token()          # GQA: H_kv 64 -> 8
    mqa = dataclasses.replace(base, num_kv_heads=1, attention="mqa")
    assert mqa.kv_bytes_per_token() * 8 == base.kv_bytes_per_token()          # MQA: one head
    cla2 = dataclasses.replace(base, attention="cla", cla_share_factor=2)
    assert cla2.kv_bytes_per_token() * 2 == base.kv_bytes_per_token()         # CLA2 halves
    assert base.kv_bytes_per_token("fp8") * 2 == base.kv_bytes_per_token()    # FP8 halves


def test_mla_is_about_one_57th_of_a_128_head_mha_cache():
    # REFERENCE.md section 1: 576 elements versus 128 x 128 x 2 = 32,768.
    mla = load_model("deepseek_v3")
    mha_like = dataclasses.replace(mla, attention="mha", num_kv_heads=128)
    assert round(mha_like.kv_bytes_per_token() / mla.kv_bytes_per_token()) == 57


def test_tensor_parallel_replication():
    llama = load_model("llama3_70b")
    assert llama.kv_replication(8) == 1.0        # heads split: no copies
    assert llama.kv_replication(16) == 2.0       # TP > H_kv: each head on two ranks
    assert load_model("deepseek_v3").kv_replication(8) == 8.0   # MLA latent on every rank


def test_moe_active_parameters_near_published_37b():
    # DeepSeek-V3: 671B parameters, 37B activated per token (REFERENCE.md section 5).
    active = load_model("deepseek_v3").active_linear_params_per_token
    assert 33e9 < active < 38e9


def test_kv_cache_dtype_names_follow_vllm():
    model = load_model("llama3_8b")
    assert resolve_kv_dtype(model, "auto") == "bf16"
    assert resolve_kv_dtype(model, "fp8_e4m3") == "fp8"
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        resolve_kv_dtype(model, "int3")
