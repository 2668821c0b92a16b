"""`python -m sim validate`: published rows replayed, compared and explained (quick mode, no timing
or accuracy assertions: those are the suite's output, reported in the README)."""
import subprocess
import sys

import pandas as pd
import pytest

from sim import validation
from sim.errors import ConfigError


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
