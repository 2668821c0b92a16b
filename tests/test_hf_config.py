"""model=hf:PATH: specs from Hugging Face config.json files (fixtures and their sources in
tests/data/hf/SOURCES.md)."""
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sim.errors import ConfigError
from sim.hf_config import model_from_hf
from sim.models import load_model

HF = Path(__file__).parent / "data" / "hf"

# fixture -> (layer kinds and counts, published total parameters in billions)
EXPECTED = {
    "llama3_70b.json": ({"full": 80}, 70.6),
    "mistral_7b_v0_1.json": ({"sliding": 32}, 7.24),
    "qwen2_5_72b_instruct.json": ({"full": 80}, 72.7),
    "qwen3_8b.json": ({"full": 36}, 8.2),
    "gemma2_9b_it.json": ({"sliding": 21, "full": 21}, 9.24),
    "gemma3_27b_it.json": ({"sliding": 52, "full": 10}, 27.0),  # text part of 27.4B
    "gemma3n_e4b_partial.json": ({"sliding": 16, "full": 4, "shared": 15}, None),
    "gpt_oss_120b.json": ({"sliding": 18, "full": 18}, 116.8),
    "llama4_scout_17b_16e_instruct.json": ({"chunked": 36, "full": 12}, 109.0),  # with vision
    "deepseek_v3.json": ({"mla": 61}, 671.0),
    "deepseek_v3_2.json": ({"dsa": 61}, 671.0),
    "deepseek_v4_pro.json": ({"compressed": 61}, 1600.0),
    "deepseek_v4_flash.json": ({"sliding": 2, "compressed": 41}, 284.0),
    "nemotron_h_8b_partial.json": ({"state": 24, "mlp": 24, "full": 4}, 8.1),  # "8B"; 8.10B by hand
    "nemotron3_nano_30b_partial.json": ({"state": 23, "mlp": 23, "full": 6}, 31.6),  # NVIDIA's report
}


def kinds(model):
    out = {}
    for group in model.layer_groups:
        out[group.kind] = out.get(group.kind, 0) + group.count
    return out


@pytest.mark.parametrize("fixture", sorted(EXPECTED))
def test_every_fixture_parses_into_its_layer_kinds(fixture):
    model = model_from_hf(str(HF / fixture), quiet=True)
    expected_kinds, params_b = EXPECTED[fixture]
    assert kinds(model) == expected_kinds
    if params_b:
        assert model.num_params / 1e9 == pytest.approx(params_b, rel=0.03)


@pytest.mark.parametrize("name, fixture", [
    ("deepseek_v3", "deepseek_v3.json"), ("llama3_70b", "llama3_70b.json"),
    ("deepseek_v32", "deepseek_v3_2.json"), ("deepseek_v4_pro", "deepseek_v4_pro.json"),
    ("deepseek_v4_flash", "deepseek_v4_flash.json"), ("gemma3_27b", "gemma3_27b_it.json"),
    ("gpt_oss_120b", "gpt_oss_120b.json"), ("llama4_scout", "llama4_scout_17b_16e_instruct.json"),
    ("nemotron_h_8b", "nemotron_h_8b_partial.json"), ("nemotron3_nano_30b", "nemotron3_nano_30b_partial.json"),
])
def test_shipped_models_are_what_their_configs_say(name, fixture):
    shipped, parsed = load_model(name), model_from_hf(str(HF / fixture), quiet=True)
    different = {f.name for f in dataclasses.fields(shipped)
                 if getattr(shipped, f.name) != getattr(parsed, f.name)}
    assert different <= {"name", "source", "substituted", "num_params", "weight_block_size", "kv_dtype"}
    assert shipped.kv_bytes_per_token() == parsed.kv_bytes_per_token()
    assert shipped.num_params == pytest.approx(parsed.num_params, rel=0.01)


def write(tmp_path, values):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(values))
    return str(path)


LLAMA = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
         "intermediate_size": 14336, "vocab_size": 128256}


def test_missing_fields_take_transformers_defaults_for_the_model_type(tmp_path):
    llama = model_from_hf(write(tmp_path, LLAMA), quiet=True)
    assert (llama.head_dim, llama.num_kv_heads, llama.attention) == (128, 32, "mha")  # hidden / heads
    qwen3 = model_from_hf(write(tmp_path, {**LLAMA, "model_type": "qwen3", "hidden_size": 2048}), quiet=True)
    assert qwen3.head_dim == 128  # Qwen3Config's head_dim default, not 2048 / 32
    mistral = model_from_hf(write(tmp_path, {**LLAMA, "model_type": "mistral"}), quiet=True)
    assert mistral.num_kv_heads == 8 and kinds(mistral) == {"sliding": 32}
    assert mistral.layers[0].window == 4096  # MistralConfig: sliding_window 4096 unless given
    no_window = model_from_hf(write(tmp_path, {**LLAMA, "model_type": "mistral", "sliding_window": None}), quiet=True)
    assert kinds(no_window) == {"full": 32}
    qwen2 = model_from_hf(write(tmp_path, {**LLAMA, "model_type": "qwen2", "sliding_window": 4096,
                                           "use_sliding_window": True, "max_window_layers": 28}), quiet=True)
    assert kinds(qwen2) == {"full": 28, "sliding": 4}


def test_fields_it_cannot_interpret_are_named_and_the_command_still_answers(tmp_path):
    path = write(tmp_path, {**LLAMA, "num_kv_heads_per_expert": 3, "rope_theta": 5e5})
    out = subprocess.run([sys.executable, "-m", "sim", "kv", f"model=hf:{path}", "format=json"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "num_kv_heads_per_expert not interpreted" in out.stderr
    assert "rope_theta" not in out.stderr  # changes neither KV size nor step time
    assert json.loads(out.stdout)["kv_bytes_per_token"] == 32 * 2 * 32 * 128 * 2


@pytest.mark.parametrize("content, message", [
    (None, "no config file"), ("{not json", "not valid JSON"), ("[1, 2]", "not a JSON object"),
    (json.dumps({**LLAMA, "model_type": "rwkv"}), "model_type 'rwkv'"),
    (json.dumps({k: v for k, v in LLAMA.items() if k != "vocab_size"}), "no vocab_size"),
    (json.dumps({**LLAMA, "layer_types": ["linear_attention"] * 32}), "linear_attention"),
    (json.dumps({k: v for k, v in json.loads((HF / "nemotron_h_8b_partial.json").read_text()).items()
                 if k != "ssm_state_size"}), "no ssm_state_size"),  # a Mamba-2 width is never guessed
    (json.dumps({**json.loads((HF / "nemotron_h_8b_partial.json").read_text()), "hybrid_override_pattern": "M*"}),
     "hybrid_override_pattern"),
])
def test_bad_configs_are_one_line_errors(tmp_path, content, message):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        model_from_hf(str(path), quiet=True)
    out = subprocess.run([sys.executable, "-m", "sim", "kv", f"model=hf:{path}"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and message.split("'")[0] in out.stderr


def test_a_run_takes_a_config_json_end_to_end(tmp_path):
    out = subprocess.run([sys.executable, "-m", "sim", "run", "+experiment=golden", "scenario.num_sessions=6",
                          f"model=hf:{HF / 'gemma3n_e4b_partial.json'}", "allocators=[paged,prefix]",
                          "hydra.run.dir=run"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "model=hf:" in out.stdout and "laurel_rank not interpreted" in out.stderr
    assert (tmp_path / "run" / "comparison.csv").is_file()


def test_a_dtype_it_does_not_model_is_said():
    from sim.hf_config import model_fields_from_hf
    fields, notes = model_fields_from_hf({**LLAMA, "torch_dtype": "float32"}, "x")
    assert fields["weight_dtype"] == "bf16" and any("float32 is not modelled" in n for n in notes)
    assert any("no torch_dtype" in n for n in model_fields_from_hf(LLAMA, "x")[1])


def test_a_shipped_model_says_what_it_counts_otherwise(capsys):
    from sim.run import prepare
    from tests.conftest import compose_config
    prepare(compose_config("run", ["model=gpt_oss_120b", "gpu=h200", "tensor_parallel_size=4", "allocators=[paged]",
                                   "max_model_len=8192"]))
    assert "note: model gpt_oss_120b: its MXFP4 experts are counted in BF16" in capsys.readouterr().err
