"""The command line as a user meets it, in a subprocess, from an unrelated directory."""
import json
import subprocess
import sys

import pandas as pd
import pytest

SMALL = ["+experiment=golden", "scenario.num_sessions=8"]


def sim(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "sim", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)


def assert_one_line_error(result, *fragments):
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    for fragment in fragments:
        assert fragment in lines[0]


def test_kv_text_reproduces_the_reference_table(tmp_path):
    # REFERENCE.md section 1: Llama-2-70B at 4096 tokens is 1.25 GiB; as if MHA, 10.00 GiB.
    out = sim(tmp_path, "kv", "model=llama2_70b", "tokens=4096", "batch=1")
    assert out.returncode == 0
    assert "kv_bytes_per_token: 327,680" in out.stdout and "1.25 GiB" in out.stdout
    out = sim(tmp_path, "kv", "model=llama2_70b_mha", "tokens=4096", "batch=1")
    assert "10.00 GiB" in out.stdout
    assert list(tmp_path.iterdir()) == []               # kv writes no files


def test_kv_json(tmp_path):
    out = sim(tmp_path, "kv", "model=deepseek_v3", "tokens=1000", "batch=2", "format=json")
    data = json.loads(out.stdout)
    assert data["kv_bytes_per_token"] == 70_272
    assert data["kv_stored_bytes"] == 70_272 * 2000
    # what the engine allocates: whole 16-token blocks, 1,000 tokens in 63 of them (issue 11)
    assert data["kv_cache_bytes"] == 70_272 * 63 * 16 * 2
    assert data["kv_cache_gib"] == round(70_272 * 1008 * 2 / 2**30, 2)
    assert [k["kind"] for k in data["kinds"]] == ["mla"]


def test_run_writes_results_comparison_and_plot(tmp_path):
    out = sim(tmp_path, "run", *SMALL, "plots=true", "hydra.run.dir=myrun")
    assert out.returncode == 0, out.stderr
    run_dir = tmp_path / "myrun"
    comparison = pd.read_csv(run_dir / "comparison.csv")
    assert comparison.allocator.tolist() == ["contiguous", "paged", "prefix"]
    for column in ("kv.token_states_frac", "throughput.output_tokens_per_s",
                   "prefix_cache.hit_rate", "latency_s.ttft.p99", "scheduler.num_steps"):
        assert column in comparison.columns
    for name in comparison.allocator:
        metrics = json.loads((run_dir / name / "metrics.json").read_text())
        assert metrics["num_finished"] > 0
        requests = pd.read_parquet(run_dir / name / "requests.parquet")
        assert len(requests) == metrics["num_requests"]
        assert len(pd.read_parquet(run_dir / name / "timeline.parquet")) > metrics["scheduler"]["num_steps"] - 1
    assert (run_dir / "comparison.png").read_bytes()[:4] == b"\x89PNG"
    assert "contiguous" in out.stdout and "prefix" in out.stdout
    report = sim(tmp_path, "report", "run_dir=myrun")
    assert report.returncode == 0, report.stderr
    breakdown = pd.read_csv(run_dir / "memory_breakdown.csv")
    assert breakdown.allocator.tolist() == ["contiguous", "paged", "prefix"]
    assert (run_dir / "kv_usage.png").is_file()


def test_default_run_directory_is_under_results_runs(tmp_path):
    out = sim(tmp_path, "run", *SMALL, "allocators=[paged]", "quiet=true")
    assert out.returncode == 0, out.stderr
    assert len(list((tmp_path / "results" / "runs").glob("*/paged/metrics.json"))) == 1
    assert out.stdout == ""


def test_cfg_job_prints_the_composed_config(tmp_path):
    out = sim(tmp_path, "run", "model=llama3_70b", "gpu=h200", "tensor_parallel_size=4",
              "cluster.num_replicas=4", "seed=7", "--cfg", "job")
    assert out.returncode == 0
    assert "gpu: h200" in out.stdout and "num_replicas: 4" in out.stdout and "seed: 7" in out.stdout


def test_multirun_sweeps(tmp_path):
    out = sim(tmp_path, "run", "-m", *SMALL, "allocators=[paged]", "seed=1,2", "quiet=true",
              "hydra.sweep.dir=sweep")
    assert out.returncode == 0, out.stderr
    found = sorted(p.parent.parent.name for p in (tmp_path / "sweep").glob("*/paged/metrics.json"))
    assert found == ["0", "1"]


@pytest.mark.parametrize("args, fragments", [
    (["run", "scenario=nope"], ["unknown scenario 'nope'", "rag_agents"]),
    (["run", "model=gpt5"], ["unknown model 'gpt5'", "llama3_70b"]),
    (["run", "block_size=abc"], ["block_size=abc"]),
    (["run", "seed"], ["malformed override", "'seed'"]),
    (["run", "no_such_key=1"], ["no_such_key"]),
    (["run", "gpu=tpu9"], ["unknown gpu profile 'tpu9'", "h100"]),
    (["run", "allocators=[paged,magic]"], ["unknown allocator 'magic'", "prefix"]),
    (["run", "-m", "seed=1,2", "scenario=a,b"], ["unknown scenario"]),
    (["run", "model=llama31_405b", "tensor_parallel_size=2"],
     ["does not fit", "tensor_parallel_size=16"]),
    (["fly"], ["unknown command 'fly'"]),
    (["run", "+scenario.bogus=1"], ["scenario config", "bogus"]),
    (["run", "+allocator_options={paged: {bogus: 1}}", "allocators=[paged]"], ["allocator config 'paged'", "bogus"]),
    (["kv", "model=nope"], ["unknown model 'nope'"]),
    (["report", "run_dir=missing"], ["comparison.csv", "missing"]),
    (["trace-stats", "trace.path=missing.jsonl"], ["no such file", "missing.jsonl"]),
    (["trace-stats", "trace.path=sample:mooncake", "trace.format=xml"], ["unknown trace format 'xml'"]),
    (["trace-stats"], ["trace.path is not set"]),
    (["trace-stats", "scenario=chat", "gpu=h200"], ["trace-stats does not read gpu"]),
    (["trace-stats", "scenario=chat", "trace.path=sample:mooncake"], ["trace-stats describes scenario=chat"]),
    (["run", "scenario=trace", "trace.path=sample:nope"], ["unknown sample 'nope'"]),
    (["run", "scenario=bench", "scenario.request_rate=0"], ["request_rate must be > 0", "scenario bench"]),
    (["run", "scenario=bench", "scenario.num_prompts=20", "enforce_eager=maybe"], ["override 'enforce_eager=maybe'"]),
    (["run", "scenario.num_sessions=20", "router=nonexistent"], ["unknown router", "override 'router=nonexistent'"]),
    (["run", "tensor_parallel_size=3"], ["tensor_parallel_size=3", "64 attention heads", "use one of 1, 2, 4, 8"]),
    (["run", "disaggregation.enabled=true", "disaggregation.decode_gpu=h900"], ["key disaggregation.decode_gpu"]),
    (["run", "disaggregation.enabled=true", "disaggregation.decode_tensor_parallel_size=0"],
     ["key disaggregation.decode_tensor_parallel_size"]),
    (["run", "-m", "seed=1,2", "--cfg", "job"], ["-m runs a sweep and --cfg only prints"]),
    (["run", "capacity_scheduler_policy=no_evict"], ["unknown capacity_scheduler_policy 'no_evict'", "guaranteed_no_evict"]),
    (["run", "capacity_scheduler_policy=guaranteed_no_evict"], ["paged allocator only", "not 'contiguous'",
                                                                "allocators=[paged]"]),
    (["run", "serving_overhead_s=-1"], ["serving_overhead_s=-1.0 is negative", "give seconds >= 0"]),
    (["run", "api_server_per_seq_s=-1"], ["api_server_per_seq_s=-1.0 is negative", "give seconds >= 0"]),
])
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, args, fragments):
    assert_one_line_error(sim(tmp_path, *args), *fragments)


def test_an_impossible_config_leaves_no_result_that_looks_complete(tmp_path):
    out = sim(tmp_path, "run", "model=llama31_405b", "tensor_parallel_size=2", "hydra.run.dir=bad")
    assert out.returncode == 2
    assert not list((tmp_path / "bad").rglob("metrics.json"))
    assert not list((tmp_path / "bad").rglob("comparison.csv"))


def test_trace_stats_json_has_the_documented_keys(tmp_path):
    out = sim(tmp_path, "trace-stats", "trace.path=sample:agentic", "trace.format=agentic", "format=json")
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    for key in ("num_requests", "num_sessions", "duration_s", "mean_input_tokens",
                "mean_output_tokens", "p99_input_tokens", "ideal_prefix_hit_rate"):
        assert key in stats
    assert stats["num_sessions"] == 4 and stats["block_size"] == 64
    scenario = json.loads(sim(tmp_path, "trace-stats", "scenario=chat", "format=json").stdout)
    assert scenario["num_sessions"] == 400 and scenario["ideal_prefix_hit_rate"] > 0.5


def test_malformed_trace_through_the_cli(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
                                        '{"timestamp": 1, "input_length": "x", "output_length": 1, "hash_ids": [1]}\n')
    result = sim(tmp_path, "run", "scenario=trace", "trace.path=bad.jsonl", "hydra.run.dir=r")
    assert_one_line_error(result, "bad.jsonl:2 field input_length")
    assert not list((tmp_path / "r").rglob("metrics.json"))
    skipped = sim(tmp_path, "trace-stats", "trace.path=bad.jsonl", "trace.on_error=skip", "format=json")
    assert json.loads(skipped.stdout)["num_skipped_records"] == 1


def test_replaying_a_shipped_trace(tmp_path):
    out = sim(tmp_path, "run", "scenario=trace", "trace.path=sample:agentic", "trace.format=agentic",
              "trace.share_preamble=true", "allocators=[prefix]", "hydra.run.dir=t", "plots=false")
    assert out.returncode == 0, out.stderr
    metrics = json.loads((tmp_path / "t" / "prefix" / "metrics.json").read_text())
    assert metrics["num_finished"] + metrics["num_rejected"] == metrics["num_requests"] == 38
    assert metrics["prefix_cache"]["hit_rate"] > 0.5


@pytest.mark.parametrize("scenario", ["rag_agents", "long_context"])
def test_trace_stats_of_scenarios_that_choose_their_model(tmp_path, scenario):
    out = sim(tmp_path, "trace-stats", f"scenario={scenario}", "format=json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["num_requests"] > 0


def test_sweep_job_count_takes_the_configs_sweeper_params_and_the_command_line():
    from sim.cli import num_sweep_jobs
    assert num_sweep_jobs(["seed=0,1", "plots=false"], {"block_size": "1,8,16"}) == 6
    assert num_sweep_jobs(["block_size=1,2"], {"block_size": "1,8,16"}) == 2   # the command line wins
    assert num_sweep_jobs(["seed=range(0,4)"]) == 4
