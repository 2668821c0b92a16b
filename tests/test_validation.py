"""`python -m sim validate`: published rows replayed, compared and explained (quick mode, no timing
or accuracy assertions: those are the suite's output, reported in the README)."""
import math
import subprocess
import sys

import pandas as pd
import pytest

from sim import validation
from sim.errors import ConfigError
from sim.latency.profile import load_profile
from sim.models import load_model


def test_the_published_file_has_at_least_30_rows_each_cited_and_every_row_not_run_says_why():
    frame = validation.read_published(validation.DEFAULT_PATH)
    assert len(frame) >= 30
    assert frame.source_url.str.startswith("http").all()
    assert set(frame.engine) >= {"vLLM", "SGLang", "TensorRT-LLM", "NVIDIA NIM"}
    assert set(frame.gpu) >= {"a100_80g", "h100", "h200", "b200"}
    assert (frame[frame.run == "no"].not_run_reason != "").all()
    assert (frame.model == "deepseek_v3").any() and (frame.metric.str.startswith(("ttft", "itl"))).any()


def test_each_row_becomes_the_run_keys_of_its_benchmark():
    frame = validation.read_published(validation.DEFAULT_PATH)
    row = frame[frame.id == "R012"].iloc[0].to_dict()  # TRT-LLM, Llama-2-70B FP8, TP 2, 1024 x 128/128
    keys = validation.overrides(row, native_window=4096)
    assert {"scenario=bench", "model=llama2_70b", "gpu=h100", "tensor_parallel_size=2", "quantization=fp8",
            "kv_cache_dtype=fp8", "scenario.input_len=128", "scenario.output_len=128",
            "scenario.num_prompts=1024", "scenario.max_concurrency=1024"} <= set(keys)
    assert "serving_overhead_s=0" in keys  # gptSessionBenchmark drives the engine in-process: no HTTP
    metrics = {"vllm_bench": {"output_throughput": 1000.0}}
    assert validation.metric_value(metrics, row) == 500.0  # per GPU: over the TP group
    served = frame[frame.id == "R041"].iloc[0].to_dict()  # NIM, over HTTP
    assert not any(key.startswith("serving_overhead_s") for key in validation.overrides(served, 131072))


def test_a_system_of_several_engines_runs_them_as_replicas_and_reports_the_systems_figure():
    frame = validation.read_published(validation.DEFAULT_PATH)
    row = frame[frame.id == "R046"].iloc[0].to_dict()  # MLPerf Offline: 8 H100s as 4 TP-2 engines
    keys = validation.overrides(row, native_window=4096)
    assert {"cluster.num_replicas=4", "router=round_robin", "tensor_parallel_size=2",
            "scenario.request_rate=inf", "scenario.input_len=222"} <= set(keys)
    metrics = {"vllm_bench": {"output_throughput": 8000.0}}
    assert validation.metric_value(metrics, row) == 8000.0  # the system's tokens per second
    assert validation.metric_value(metrics, {**row, "metric": "output_throughput_per_gpu"}) == 1000.0
    single = frame[frame.id == "R012"].iloc[0].to_dict()
    assert "cluster.num_replicas=1" in validation.overrides(single, 4096)
    assert not any(key.startswith("router=") for key in validation.overrides(single, 4096))


def test_a_miss_carries_the_rows_caveat_and_a_row_not_run_its_reason():
    assert validation.status({"caveat": "static batching", "not_run_reason": ""}, 0.5) == ("miss", "static batching")
    assert validation.status({"caveat": "", "not_run_reason": ""}, -0.1) == ("within", "")
    assert validation.status({"caveat": "", "not_run_reason": "FP4"}, None) == ("not run", "FP4")


def test_a_row_whose_run_measured_nothing_is_the_worst_miss_and_counts_in_the_median():
    """kvsim's metric NaN (no request served in the window): a miss that says so, never left out."""
    state, why = validation.status({"caveat": "static batching", "not_run_reason": ""}, float("nan"))
    assert state == "miss" and why.startswith("kvsim's run measured nothing") and why.endswith("static batching")
    table = pd.DataFrame({"id": ["R1", "R2", "R3"], "metric": ["ttft_mean"] * 3, "status": ["within", "within", "miss"],
                          "error": [0.01, -0.05, float("nan")], "ratio": [1.01, 0.95, float("nan")],
                          "set_by_load": [False] * 3})
    summary = validation.summarize(table)
    assert summary.num_run == 3 and summary.num_within == 2 and summary.worst.startswith("R3")
    assert summary.median_abs_error == pytest.approx(0.05)


def test_a_file_without_the_columns_is_one_clear_error(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("id,value\nR1,3\n")
    with pytest.raises(ConfigError, match="missing column"):
        validation.read_published(bad)


def test_quick_validation_writes_table_markdown_and_plot(tmp_path):
    out = subprocess.run([sys.executable, "-m", "sim", "validate", "quick=true", f"out_dir={tmp_path}/v"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    table = pd.read_csv(tmp_path / "v" / "validation.csv")
    assert list(table.id) == list(validation.QUICK_ROWS)
    assert (table.kvsim > 0).all() and (table.ratio == table.kvsim / table.published).all()
    assert (tmp_path / "v" / "validation.png").stat().st_size > 1000
    assert "not its figures" in (tmp_path / "v" / "validation.md").read_text()
    assert "within 20%" in out.stdout and "target" not in out.stdout  # quick mode claims no targets


def test_unknown_row_ids_are_refused_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "sim", "validate", "rows=[R999]", f"out_dir={tmp_path}/v"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "R999" in out.stderr
    assert not (tmp_path / "v" / "validation.csv").exists()


def test_rows_whose_metric_the_load_sets_are_counted_apart_in_the_summary():
    table = pd.DataFrame({"id": ["R1", "R2", "R3"], "metric": ["output_throughput"] * 3, "status": ["within"] * 3,
                          "error": [0.01, -0.05, 0.3], "ratio": [1.01, 0.95, 1.3], "set_by_load": [True, False, False]})
    summary = validation.summarize(table)
    assert (summary.num_within, summary.within_set_by_load) == (2, ("R1",))
    assert "1 without the 1 whose metric the offered load sets while the engines keep up, R1" in summary.lines()[0]
    frame = validation.read_published(validation.DEFAULT_PATH)
    assert set(frame[frame.set_by_load == "true"].id) == {"R047", "R051", "R055"}  # MLPerf Server throughputs


def _trtllm_bench_limits(row: dict) -> tuple[int, int]:
    """trtllm-bench's max_batch_size and max_num_tokens when its command gives neither, as
    TensorRT-LLM computes them (tensorrt_llm/bench/build/tuning.py: calc_engine_setting and
    finetune_setting; tensorrt_llm/bench/benchmark/utils/general.py: get_settings, which without
    chunked prefill raises the token budget to the longest prompt plus the batch). The KV cache is
    the memory left after the weights, at the 0.95 fraction the source says it passes in many
    cases (the rows' gpu_memory_utilization); the heuristic counts every layer's KV heads (at
    least one per GPU) at the KV dtype's bytes (the rows' FP8, validation/SOURCES.md section 1)."""
    model = load_model(row["model"])
    tp, isl, osl = int(row["tensor_parallel_size"]), int(row["input_len"]), int(row["output_len"])
    weight_bytes = {"fp8": 1.0, "nvfp4": 0.5}[row["quantization"]]
    gib = 1024 ** 3
    memory = load_profile(row["gpu"]).memory_bytes / gib * tp
    kv_bytes = {"fp8": 1.0}.get(row["kv_cache_dtype"], 2.0)
    kv_per_token = 2 * model.num_layers * max(tp, model.num_kv_heads) * model.head_dim * kv_bytes / gib
    fraction = float(row["gpu_memory_utilization"])
    requests = (memory - model.num_params * weight_bytes / gib) * fraction / (kv_per_token * (isl + osl))
    batch = min(requests, 4096)
    tokens = min(batch * (1 + isl / osl), 32768)
    step = 32 if batch < 256 else 128 if batch < 1024 else 256
    max_batch = max(64, step * math.ceil(batch / step))  # the minimum of 64 binds only below 256
    step = 256 if tokens < 4096 else 512 if tokens < 8192 else 1024
    max_tokens = max(2048, step * math.ceil(tokens / step))  # the minimum of 2,048 binds only below 4,096
    return max_batch, max(max_tokens, isl + max_batch)


def test_tensorrt_llm_1_rows_run_the_limits_trtllm_bench_sets_itself():
    frame = validation.read_published(validation.DEFAULT_PATH)
    rows = frame[frame.source_url.str.contains("00f37686")]  # perf-overview v1.0: no --max_batch_size
    assert len(rows) == 14
    for row in rows.to_dict("records"):
        assert (int(row["max_num_seqs"]), int(row["max_num_batched_tokens"])) == _trtllm_bench_limits(row), row["id"]
        keys = validation.overrides(row, native_window=131072)
        assert f"max_num_seqs={row['max_num_seqs']}" in keys
        chunked = "enable_chunked_prefill=false" not in keys
        # trtllm-bench runs without chunking; kvsim chunks only where its check (the budget must hold
        # max_model_len) refuses, and there every prompt fits the budget whole beside the decodes
        assert chunked == (int(row["max_num_batched_tokens"]) < int(row["input_len"]) + int(row["output_len"]))
        assert int(row["input_len"]) + int(row["max_num_seqs"]) <= int(row["max_num_batched_tokens"])
    assert _trtllm_bench_limits(rows[rows.id == "R001"].iloc[0].to_dict()) == (4096, 8192)  # by hand: 4,409 fit


def test_a_bad_chunked_prefill_cell_and_a_row_kvsim_refuses_are_one_line_naming_the_row(tmp_path):
    frame = validation.read_published(validation.DEFAULT_PATH)
    row = frame[frame.id == "R006"]  # 128/2048: a 2,048-token budget holds its prompts, not max_model_len
    bad = tmp_path / "bad.csv"
    row.assign(enable_chunked_prefill="no").to_csv(bad, index=False)
    with pytest.raises(ConfigError, match=r"enable_chunked_prefill 'no', .*bad.csv:2, use true, false"):
        validation.read_published(bad)
    refused = tmp_path / "refused.csv"
    row.assign(enable_chunked_prefill="false").to_csv(refused, index=False)
    out = subprocess.run([sys.executable, "-m", "sim", "validate", f"path={refused}", f"out_dir={tmp_path}/v"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "row R006 of the published file" in out.stderr and "max_num_batched_tokens" in out.stderr
    assert not (tmp_path / "v").exists()


def test_sharegpt_rows_replay_vllms_own_sample_and_vllm_05_http_rows_pay_its_in_process_api_server():
    frame = validation.read_published(validation.DEFAULT_PATH)
    rows = frame[frame.dataset == "sharegpt"].to_dict("records")
    assert len(rows) == 8
    for row in rows:
        keys = validation.overrides(row, native_window=131072)
        assert "scenario.path=sample:sharegpt_v3" in keys
        assert f"scenario.max_requests={min(int(row['num_prompts']), 200)}" in keys
        if int(row["num_prompts"]) > 200:  # the published sample stops at 200: said in the row
            assert "first 200" in row["caveat"], row["id"]
        api = f"api_server_per_seq_s={validation.VLLM05_API_SERVER_PER_SEQ_S}"
        assert (api in keys) == (row["harness"] == "http" and row["async_output_processing"] == "false")
    served_today = frame[frame.id == "R041"].iloc[0].to_dict()  # NIM over HTTP: its own server process
    assert not any(k.startswith("api_server_per_seq_s") for k in validation.overrides(served_today, 131072))


def test_vllm_05s_api_server_cost_is_its_blogs_share_of_kvsims_gpu_step():
    """vLLM's v0.6.0 blog: in 0.5.3, Llama-3-8B on one H100, the API server took 33% of the time and
    the GPU 38%; at 256 running sequences (max_num_seqs) of 450 tokens kvsim's GPU step sets the
    per-sequence cost."""
    from sim.latency.model import BatchShape, LatencyModel

    latency = LatencyModel(load_model("llama31_8b"), load_profile("h100"), 1, "bf16", (256,))
    shape = BatchShape(num_decode_seqs=256, decode_context_tokens=256 * 450, num_sampled=256)
    gpu = sum(v for k, v in latency.breakdown(shape).items() if k not in ("launch", "cpu", "cpu_output"))
    assert validation.VLLM05_API_SERVER_PER_SEQ_S == pytest.approx(0.33 / 0.38 * gpu / 256, rel=0.02)


def test_the_shipped_sharegpt_sample_holds_vllms_published_token_totals():
    from sim.workload.trace import TraceSpec, read_requests

    _, requests, skipped, failed = read_requests(TraceSpec(path="sample:sharegpt_v3"))
    assert (len(requests), skipped, failed) == (200, 0, 0)
    assert sum(r.input_len for r in requests) == 42659  # the 200-prompt input total vLLM prints
    assert sum(r.output_len for r in requests) == 42398 <= 43545  # that run's outputs, at most the completions'
    assert all(4 <= r.input_len <= 1024 and r.input_len + r.output_len <= 2048 for r in requests)


def test_asking_a_trace_for_more_requests_than_it_holds_says_so(caplog):
    from sim.workload.trace import TraceSpec, read_requests

    _, requests, _, _ = read_requests(TraceSpec(path="sample:sharegpt_v3", max_requests=320))
    assert len(requests) == 200
    assert "max_requests=320" in caplog.text and "holds 200 valid requests" in caplog.text
