"""NVFP4 weights (quantization=nvfp4, vLLM's modelopt_fp4): 4-bit values with an FP8 scale per 16,
timed on a Blackwell GPU's FP4 tensor cores, refused on a GPU without them."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from importlib import resources

import pytest

from sim.errors import ConfigError
from sim.hf_config import model_from_hf
from sim.latency.calibrated import calibrated_gemm
from sim.latency.model import BatchShape, LatencyModel
from sim.latency.profile import load_profile
from sim.models import load_model
from sim.run import prepare
from tests.helpers import predicted
from tests.test_latency import bare


def nvfp4(name: str):
    return dataclasses.replace(load_model(name), weight_dtype="nvfp4")


def test_weights_take_four_and_a_half_bits_but_the_embeddings_and_lm_head_sixteen():
    """As vLLM and ModelOpt quantize: linear layers only (and not MLA attention in NVFP4)."""
    llama = load_model("llama31_70b")
    kept = 2 * llama.vocab_size * llama.hidden_size  # embedding and LM head, untied
    expected = kept * 2 + (llama.num_params - kept) * (0.5 + 1 / 16)
    assert nvfp4("llama31_70b").weight_bytes == pytest.approx(expected, rel=1e-12)
    fp8 = kept * 2 + (llama.num_params - kept) * 1  # FP8 checkpoints keep them 16-bit as well
    assert dataclasses.replace(llama, weight_dtype="fp8").weight_bytes == pytest.approx(fp8, rel=1e-12)
    assert llama.weight_bytes == llama.num_params * 2
    # 70.6 B parameters: about 41.6 GB against 70.6 GB in FP8
    assert 0.55 < nvfp4("llama31_70b").weight_bytes / dataclasses.replace(llama, weight_dtype="fp8").weight_bytes < 0.62
    v3 = load_model("deepseek_v3")  # MLA attention stays 16-bit too
    attention = v3.num_attention_layers * v3.attention_params_per_layer
    assert nvfp4("deepseek_v3").unquantized_params == pytest.approx(
        2 * v3.vocab_size * v3.hidden_size + attention)
    gemma = load_model("gemma3_27b")  # tied: one 16-bit copy of the embedding matrix
    tied = gemma.vocab_size * gemma.hidden_size
    assert dataclasses.replace(gemma, weight_dtype="nvfp4").weight_bytes == pytest.approx(
        tied * 2 + (gemma.num_params - tied) * (0.5 + 1 / 16), rel=1e-12)


def test_gemms_run_on_the_fp4_peak_and_read_4_5_bits_per_weight():
    b200 = bare(load_profile("b200"))  # the roofline alone (no fixed cost, no correction table)
    gemm, fp4 = calibrated_gemm(b200), b200.op("gemm_fp4")
    n, k = 57344, 8192  # Llama-3.1-70B's gate and up projections
    big = 2 * 8192 * n * k / (b200.fp4_flops_per_s * fp4.compute_efficiency) + fp4.t0_s
    assert gemm.time(8192, n, k, "nvfp4") == pytest.approx(big, rel=0.02)  # compute-bound
    fp8 = b200.fp8_flops_per_s * b200.op("gemm_fp8").compute_efficiency  # 3.4 PFLOP/s against FP4's 5.2
    assert gemm.time(8192, n, k, "nvfp4") / gemm.time(8192, n, k, "fp8") == pytest.approx(
        fp8 / (b200.fp4_flops_per_s * fp4.compute_efficiency), rel=0.02)
    weights = n * k * (0.5 + 1 / 16) / (b200.hbm_bandwidth_bytes_per_s * fp4.memory_efficiency)
    assert gemm.time(1, n, k, "nvfp4") == pytest.approx(weights + fp4.t0_s, rel=0.01)  # weight-bound decode


def test_simulator_and_predict_time_quantized_gemms_alike(tmp_path):
    """qkv/o, MLP and LM head of a step against predict's op=gemm rows with each part's dtype:
    nvfp4 on a B200 and fp8 on an H100 (gemm_fp8's own efficiencies), the LM head in bf16."""
    for gpu, dtype, head in (("b200", "nvfp4", "bf16"), ("h100", "fp8", "bf16")):
        model = dataclasses.replace(load_model("llama31_8b"), weight_dtype=dtype)
        latency = LatencyModel(model, load_profile(gpu), 1, "bf16")
        tokens = 96
        times = latency.breakdown(BatchShape(num_decode_seqs=tokens, decode_context_tokens=tokens * 500,
                                             num_sampled=tokens))
        h, inter, heads, kv = model.hidden_size, model.intermediate_size, model.num_heads, model.num_kv_heads
        shapes = [((heads + 2 * kv) * 128, h, dtype), (h, heads * 128, dtype), (2 * inter, h, dtype),
                  (h, inter, dtype), (model.vocab_size, h, head)]
        rows = [{"op": "gemm", "m": tokens, "n": n, "k": k, "dtype": d} for n, k, d in shapes]
        t = predicted(tmp_path, rows, gpu).time_s.tolist()
        layers = model.num_layers
        assert times["qkv_o_proj"] == pytest.approx(layers * (t[0] + t[1]), rel=1e-12)
        assert times["mlp"] == pytest.approx(layers * (t[2] + t[3]), rel=1e-12)
        assert times["lm_head"] == pytest.approx(t[4], rel=1e-12)


def test_mla_attention_stays_sixteen_bit_and_each_fp4_gemm_input_gets_a_quantize_kernel():
    """TensorRT-LLM's B200 trace of DeepSeek-R1 NVFP4 runs quantize_with_block_size before each FP4
    GEMM input (validation/SOURCES.md, "Kernel times that check the model"): the routed experts'
    input once, the shared experts' gate/up and down inputs; MLA attention is 16-bit, so none
    there. 16-bit values read, 4-bit values and an FP8 scale per 16 written."""
    b200 = load_profile("b200")
    shape = BatchShape(num_decode_seqs=64, decode_context_tokens=64 * 2000, num_sampled=64)
    fp4 = LatencyModel(nvfp4("deepseek_v3"), b200, 8, "bf16")
    bf16 = LatencyModel(dataclasses.replace(load_model("deepseek_v3"), weight_dtype="bf16"), b200, 8, "bf16")
    assert fp4.breakdown(shape)["qkv_o_proj"] == bf16.breakdown(shape)["qkv_o_proj"]
    assert fp4.breakdown(shape)["mlp"] < 0.5 * bf16.breakdown(shape)["mlp"]
    m, per_value = fp4.model, 2 + 0.5 + 1 / 16
    dense, moe, h = m.num_dense_mlp_layers, m.num_moe_layers, m.hidden_size
    shared = m.expert_intermediate_size * m.num_shared_experts / 8
    assert fp4.elementwise_kernels == bf16.elementwise_kernels + [
        (dense, h * per_value), (dense, m.intermediate_size / 8 * per_value),
        (moe, h * per_value), (moe, h * per_value), (moe, shared * per_value)]
    added_time = fp4.breakdown(shape)["elementwise"] - bf16.breakdown(shape)["elementwise"]
    assert added_time >= (2 * dense + 3 * moe) * 3e-6  # each at least the elementwise kernel's 3 us
    # A dense model quantizes the inputs of its gate/up and down GEMMs, then of its QKV and output
    # projections (heads x head_dim wide); a model without dense MLP layers lists none for them
    llama = LatencyModel(nvfp4("llama31_70b"), b200, 1, "bf16")
    plain = LatencyModel(load_model("llama31_70b"), b200, 1, "bf16")
    added = llama.elementwise_kernels[len(plain.elementwise_kernels):]
    lm = llama.model
    assert added == [(lm.num_layers, lm.hidden_size * per_value), (lm.num_layers, lm.intermediate_size * per_value),
                     (lm.num_layers, lm.hidden_size * per_value),
                     (lm.num_layers, lm.num_heads * lm.head_dim * per_value)]
    hybrid = LatencyModel(nvfp4("nemotron3_nano_30b"), b200, 2, "bf16")
    assert hybrid.model.num_dense_mlp_layers == 0 and all(layers for layers, _ in hybrid.elementwise_kernels)
    block = LatencyModel(load_model("deepseek_v3"), b200, 8, "bf16")  # block-scaled FP8: its own quant kernels
    assert len(block.elementwise_kernels) > len(bf16.elementwise_kernels)


def test_nvfp4_needs_fp4_tensor_cores_and_modelopt_fp4_is_its_vllm_name(run_config, tmp_path):
    with pytest.raises(ConfigError, match="FP4 tensor cores, which gpu=h100"):
        prepare(run_config("model=llama31_8b", "gpu=h100", "quantization=nvfp4"))
    a = prepare(run_config("model=llama31_8b", "gpu=b200", "quantization=nvfp4", "kv_cache_memory_bytes=null"))
    b = prepare(run_config("model=llama31_8b", "gpu=b200", "quantization=modelopt_fp4", "kv_cache_memory_bytes=null"))
    fp8 = prepare(run_config("model=llama31_8b", "gpu=b200", "quantization=fp8", "kv_cache_memory_bytes=null"))
    assert a.pool.num_blocks == b.pool.num_blocks > fp8.pool.num_blocks  # 4.5-bit weights leave more KV
    assert a.latency.model.weight_dtype == "nvfp4"
    out = subprocess.run([sys.executable, "-m", "sim", "run", "+experiment=golden", "gpu=a100_80g",
                          "quantization=nvfp4", "hydra.run.dir=run"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "use a Blackwell GPU" in out.stderr
    assert not (tmp_path / "run").exists()  # nothing half-written


def test_predict_refuses_nvfp4_gemms_without_fp4_units_and_nvfp4_kv(tmp_path):
    shapes = tmp_path / "shapes.csv"
    cases = (("h100", "op,m,n,k,dtype\ngemm,16,4096,4096,nvfp4\n", "FP4 tensor cores"),
             ("b200", "op,batch_size,context_len,num_q_heads,num_kv_heads,head_dim,dtype\n"
                      "attention_decode,8,2048,32,8,128,nvfp4\n", "NVFP4 is a weight type"))
    for gpu, text, message in cases:
        shapes.write_text(text)
        out = subprocess.run([sys.executable, "-m", "calibration", "predict", f"gpu={gpu}", f"shapes={shapes}",
                              f"out={tmp_path / 'out.csv'}"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and message in out.stderr, out.stderr
        assert not (tmp_path / "out.csv").exists()


def test_a_modelopt_nvfp4_config_json_reads_as_nvfp4_weights(tmp_path):
    config = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
              "torch_dtype": "bfloat16",
              "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                      "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    model = model_from_hf(str(path), quiet=True)
    assert model.weight_dtype == "nvfp4" and model.kv_dtype == "bf16"  # KV: kv_cache_dtype decides


def test_a_measured_b200_gemm_carries_its_fit_into_fp4_at_the_priors_ratio():
    """As gemm_fp8 does: once a B200's 16-bit GEMM is fitted (calibration/device_run.sh), its FP4
    GEMM is the fit at the priors' FP4/BF16 efficiency ratio, not the bare prior."""
    from calibration.priors import PRIORS, with_priors
    profile = json.loads((resources.files("calibration") / "profiles" / "b200.json").read_text())
    fitted = {**profile["operators"]["gemm"], "compute_efficiency": 0.6, "source": "measured"}
    ops = with_priors({**profile, "operators": {**profile["operators"], "gemm": fitted}})["operators"]
    ratio = PRIORS["b200"].fp4[1].value / PRIORS["b200"].gemm.value
    assert ops["gemm_fp4"]["compute_efficiency"] == pytest.approx(0.6 * ratio, rel=1e-5)
    assert "fitted 16-bit GEMM" in ops["gemm_fp4"]["source"]


def test_disaggregation_names_the_decode_gpu_that_lacks_fp4(run_config):
    from sim.disaggregation import prepare_pools
    cfg = run_config("model=llama31_8b", "gpu=b200", "quantization=nvfp4", "kv_cache_memory_bytes=null",
                     "disaggregation.enabled=true", "disaggregation.decode_gpu=h100")
    with pytest.raises(ConfigError, match="disaggregation.decode_gpu=h100"):
        prepare_pools(cfg)


def test_calibration_show_gives_each_tensor_core_peak_the_profile_has(tmp_path):
    def shown(gpu):
        out = subprocess.run([sys.executable, "-m", "calibration", "show", f"gpu={gpu}"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()[1]
    assert "fp8 4500 TFLOP/s  fp4 9000 TFLOP/s" in shown("b200")
    assert "fp8" in shown("h100") and "fp4" not in shown("h100") and "fp8" not in shown("a100_80g")
