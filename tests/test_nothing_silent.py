"""Every way a request or a key is not served as asked is counted and said; failed runs leave
nothing behind. Each case runs the command line in a subprocess, as a user would."""
import json
import re

import pandas as pd
import pytest

from tests.test_cli import assert_one_line_error, sim

LONG, MAX_LEN = 5000, 4096


def trace_file(folder, rows):
    path = folder / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) if isinstance(r, dict) else r for r in rows) + "\n")
    return path


def six_requests(folder):
    """Six Mooncake requests a second apart; two prompts are longer than MAX_LEN."""
    lengths = [1000, LONG, 800, LONG, 1200, 600]
    return trace_file(folder, [{"timestamp": 1000 * i, "input_length": n, "output_length": 20,
                                "hash_ids": list(range(10 * i, 10 * i + -(-n // 512)))}
                               for i, n in enumerate(lengths)])


def run(folder, *args):
    return sim(folder, "run", "allocators=[paged]", "plots=false", "hydra.run.dir=out", *args)


def metrics(folder, allocator="paged"):
    return json.loads((folder / "out" / allocator / "metrics.json").read_text())


def warnings(result):
    return [line for line in result.stderr.splitlines() if line.startswith("warning: ")]


def test_overlength_prompts_are_rejected_counted_shown_and_announced(tmp_path):
    out = run(tmp_path, "scenario=trace", f"trace.path={six_requests(tmp_path)}", f"max_model_len={MAX_LEN}")
    assert out.returncode == 0, out.stderr
    [line] = warnings(out)
    assert line.startswith(f"warning: 2 of 6 requests (33.3%) rejected: prompt longer than "
                           f"max_model_len={MAX_LEN}; fix: ")
    assert "max_model_len=" in line and "trace.on_overlength=truncate" in line
    m = metrics(tmp_path)
    assert m["num_rejected"] == m["unserved"]["rejected_prompt_too_long"] == 2
    assert m["num_finished"] == 4
    header, row = out.stdout.splitlines()[1:3]
    assert dict(zip(header.split(), row.split()))["rejected"] == "2"


def test_a_run_that_serves_nothing_reports_no_data_not_zeros(tmp_path):
    """Every prompt rejected: latencies, shares of used KV, the hit rate and the mean batch are
    statistics of nothing (null in metrics.json, n/a in the tables), not zeros that read as
    measurements; throughput is a true 0."""
    out = run(tmp_path, "scenario=bench", "model=llama31_8b", "gpu=h100", "tensor_parallel_size=1",
              "scenario.num_prompts=3", "scenario.input_len=4000", "scenario.output_len=4", "max_model_len=2048")
    assert out.returncode == 0, out.stderr
    assert "UserWarning" not in out.stderr
    m = json.loads((tmp_path / "out" / "paged" / "metrics.json").read_text())
    assert m["num_rejected"] == 3 and m["throughput"]["output_tokens_per_s"] == 0.0
    assert m["latency_s"]["ttft"] == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert m["vllm_bench"]["median_ttft_ms"] is None and m["scheduler"]["mean_batch_size"] is None
    assert m["kv"]["waste_of_used"] is None and m["prefix_cache"]["hit_rate"] is None
    header, row = out.stdout.splitlines()[1:3]
    cells = dict(zip(header.split(), row.split()))
    assert cells["ttft_p50_s"] == cells["waste/used"] == cells["batch"] == "n/a" and cells["out_tok/s"] == "0.000"
    assert re.search(r"Median TTFT \(ms\) +n/a", out.stdout)


def test_truncate_keeps_the_last_tokens_and_says_so(tmp_path):
    out = run(tmp_path, "scenario=trace", f"trace.path={six_requests(tmp_path)}",
              f"max_model_len={MAX_LEN}", "trace.on_overlength=truncate")
    assert out.returncode == 0, out.stderr
    [truncated] = warnings(out)   # the kept prompt leaves room for the requested 20 tokens
    assert truncated.startswith(f"warning: 2 of 6 requests (33.3%) truncated: prompt longer than "
                                f"max_model_len={MAX_LEN}, kept its last max_model_len - output tokens")
    m = metrics(tmp_path)
    assert m["unserved"]["truncated_prompt"] == 2 and m["num_finished"] == 6 and m["num_rejected"] == 0
    assert m["unserved"]["truncated_output"] == 0
    requests = pd.read_parquet(tmp_path / "out" / "paged" / "requests.parquet")
    assert sorted(requests.prompt_tokens) == [600, 800, 1000, 1200, MAX_LEN - 20, MAX_LEN - 20]
    assert (requests.output_tokens == 20).all()


def test_output_cut_at_max_model_len_is_counted(tmp_path):
    path = trace_file(tmp_path, [{"timestamp": 0, "input_length": 4000, "output_length": 500,
                                  "hash_ids": list(range(8))}])
    out = run(tmp_path, "scenario=trace", f"trace.path={path}", f"max_model_len={MAX_LEN}")
    assert out.returncode == 0, out.stderr
    [line] = warnings(out)
    assert line.startswith("warning: 1 of 1 requests (100.0%) cut short") and "raise max_model_len=" in line
    m = metrics(tmp_path)
    assert m["unserved"]["truncated_output"] == 1
    requests = pd.read_parquet(tmp_path / "out" / "paged" / "requests.parquet")
    assert requests.output_tokens.tolist() == [MAX_LEN - 4000] and requests.requested_output_tokens.tolist() == [500]


def test_skipped_malformed_records_are_counted_and_announced(tmp_path):
    path = trace_file(tmp_path, [{"timestamp": 0, "input_length": 100, "output_length": 5, "hash_ids": [1]},
                                 '{"timestamp": 10, "input_length": "many"}',
                                 {"timestamp": 20, "input_length": 100, "output_length": 5, "hash_ids": [2]}])
    out = run(tmp_path, f"trace.path={path}", "trace.on_error=skip")
    assert out.returncode == 0, out.stderr
    assert "note: trace.* keys given without a scenario: ran scenario=trace" in out.stderr
    assert [l for l in warnings(out) if "skipped" in l] == [
        "warning: 1 of 3 requests (33.3%) skipped: malformed trace records (trace.on_error=skip); "
        "fix: repair the trace, or trace.on_error=raise to stop at the first bad record"]
    assert metrics(tmp_path)["unserved"]["skipped_malformed_records"] == 1


def test_a_csv_row_short_of_values_is_skipped_like_any_malformed_record(tmp_path):
    """trace.on_error=skip skips a row with too few values too (it stopped the run with exit 2)."""
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
                    "2023-11-16 18:15:50.9951690,abc,35\n2023-11-16 18:15:51.0000000,300\n"
                    "2023-11-16 18:15:52.0000000,200,20\n")
    out = run(tmp_path, f"trace.path={path}", "trace.on_error=skip")
    assert out.returncode == 0, out.stderr
    assert metrics(tmp_path)["unserved"]["skipped_malformed_records"] == 2
    stop = sim(tmp_path, "run", f"trace.path={path}", "trace.on_error=raise", "trace.max_requests=3",
               "hydra.run.dir=raise")
    assert_one_line_error(stop, "ContextTokens is 'abc'", "azure.csv:3")


def test_a_trace_path_without_a_scenario_replays_the_trace(tmp_path):
    out = run(tmp_path, f"trace.path={six_requests(tmp_path)}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("scenario=trace model=llama31_70b")
    assert "note: trace.format=auto read " in out.stderr and " as mooncake" in out.stderr
    m = metrics(tmp_path)
    assert m["num_requests"] == 6 and m["num_rejected"] == 0 and m["max_model_len"] == 131072


def test_the_format_note_names_the_keys_the_trace_scenario_read(tmp_path):
    lengths = tmp_path / "lengths.csv"
    lengths.write_text("num_prefill_tokens,num_decode_tokens\n100,5\n200,7\n")
    stated = run(tmp_path, "scenario=sharegpt", f"scenario.path={lengths}", "scenario.max_requests=null")
    assert stated.returncode == 0, stated.stderr
    assert "format=auto" not in stated.stderr  # sharegpt states format: length_stats
    detected = run(tmp_path, "scenario=sharegpt", f"scenario.path={lengths}", "scenario.format=auto")
    assert detected.returncode == 0, detected.stderr
    assert f"note: scenario.format=auto read {lengths} as length_stats" in detected.stderr


@pytest.mark.parametrize("args, fragments", [
    (["scenario=chat", "trace.path=sample:mooncake"], ["trace.path is set but scenario=chat reads no trace",
                                                        "add scenario=trace"]),
    (["scenario.num_requests=5"], ["scenario.num_requests"]),           # a key of another scenario
    (["+scenario.num_requests=5"], ["unexpected keyword argument 'num_requests'"]),
    (["+bogus=1"], ["bogus is not a key of python -m sim run"]),
    (["+measure.bogus=1"], ["measure.bogus is not a key"]),
    (["+allocator_options.radix.page_size=4"], ["allocator_options.radix.page_size is set but radix is not "
                                               "in allocators=[paged]", "add radix to allocators"]),
])
def test_keys_nothing_reads_are_errors(tmp_path, args, fragments):
    assert_one_line_error(run(tmp_path, *args), *fragments)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, fragment", [
    (["trace.path=missing.jsonl"], "no such file"),
    (["block_size=2000"], "block_size=2000 is out of range"),
    (["+experiment=golden", "measure.warmup_s=1e9"], "leaves no span to measure"),
    (["cluster.num_replicas=100000"], "use at most"),
    (["scenario=trace", "trace.path=sample:mooncake", "trace.format=azure"], "sample"),
])
def test_a_failed_run_leaves_nothing_behind(tmp_path, args, fragment):
    out = sim(tmp_path, "run", *args)
    assert_one_line_error(out, fragment)
    assert list(tmp_path.iterdir()) == []       # no results/, no .hydra/, no partial folder


def test_a_failed_run_keeps_an_existing_folder_as_it_was(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    out = sim(tmp_path, "run", "block_size=2000", "hydra.run.dir=mine")
    assert_one_line_error(out, "block_size=2000")
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]


def test_a_successful_run_keeps_its_resolved_config(tmp_path):
    out = sim(tmp_path, "run", "+experiment=golden", "scenario.num_sessions=4", "allocators=[paged]",
              "hydra.run.dir=out")
    assert out.returncode == 0, out.stderr
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert {".hydra", "comparison.csv", "paged"} <= names
    assert (tmp_path / "out" / "paged" / "config.yaml").read_text().count("max_model_len: 2048") == 1
    assert [p.name for p in tmp_path.iterdir()] == ["out"]           # no staging folder left


def test_a_sweep_says_which_jobs_could_not_run_and_why(tmp_path):
    out = sim(tmp_path, "run", "-m", "+experiment=golden", "scenario.num_sessions=4",
              "allocators=[paged]", "block_size=16,2000", "hydra.sweep.dir=sweep")
    assert out.returncode == 0 and "job 1 infeasible: block_size=2000 is out of range" in out.stderr
    assert "1 jobs ran, 1 infeasible" in out.stderr
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir()) == ["0", "1", "multirun.yaml", "summary.parquet",
                                                                  "sweep.json"]
    assert sorted(p.name for p in (tmp_path / "sweep" / "1").iterdir()) == [".hydra", "status.json"]
    out = sim(tmp_path, "run", "-m", "+experiment=golden", "block_size=2000,3000", "hydra.sweep.dir=none")
    assert out.returncode == 2 and not (tmp_path / "none").exists()


def test_failed_calibration_imports_and_fits_leave_nothing_behind(tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "h100__x.csv").write_text("a,b\n1,2\n")
    for args in (["import-vidur", "path=bad", "name=x"], ["fit", "raw=bad/h100__x.csv", "name=x"]):
        out = __import__("subprocess").run([__import__("sys").executable, "-m", "calibration", *args],
                                           cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert_one_line_error(out)
    assert [p.name for p in tmp_path.iterdir()] == ["bad"]


def test_help_lists_commands_groups_choices_and_keys(tmp_path):
    out = sim(tmp_path, "--help")
    assert out.returncode == 0
    for command in ("run", "kv", "trace-stats", "report"):
        assert re.search(rf"^  {command} +\S", out.stdout, re.M), command
    out = sim(tmp_path, "run", "--help")
    assert out.returncode == 0
    for choice in ("rag_agents", "llama31_70b", "h200", "mi300x", "radix", "least_loaded", "golden"):
        assert re.search(rf"^  {choice} +\S", out.stdout, re.M), choice
    for key in ("scheduler_reserve_full_isl=true", "watermark=0.0", "trace.on_overlength=reject",
                "measure.warmup_s=0.0", "max_model_len=32768", "progress=true"):
        assert re.search(rf"^  {re.escape(key)} +\S", out.stdout, re.M), key
    assert list(tmp_path.iterdir()) == []


def test_the_main_job_serves_everything_quietly_and_shows_the_designs(tmp_path):
    """The rag_agents defaults, a third as long: no warning, every request served, prefix hits
    above 0.2, paged's memory in use nearly all token states, contiguous far below it."""
    out = sim(tmp_path, "run", "scenario=rag_agents", "scenario.num_sessions=210", "plots=false",
              "hydra.run.dir=out")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    m = {name: metrics(tmp_path, name) for name in ("contiguous", "paged", "prefix")}
    for values in m.values():
        assert values["num_finished"] == values["num_requests"] > 700
        assert not any(values["unserved"].values())
    assert m["prefix"]["prefix_cache"]["hit_rate"] > 0.2
    assert m["paged"]["kv"]["token_states_of_used"] >= 0.9
    assert m["contiguous"]["kv"]["token_states_of_used"] <= m["paged"]["kv"]["token_states_of_used"] - 0.2
    assert m["paged"]["measurement"]["excluded_warmup_s"][1] - m["paged"]["measurement"]["excluded_warmup_s"][0] == 300


def test_prefix_caching_switch_says_which_allocators_ran(tmp_path):
    out = sim(tmp_path, "run", "+experiment=golden", "scenario.num_sessions=4", "plots=false",
              "enable_prefix_caching=true", "allocators=[paged,prefix]", "hydra.run.dir=out")
    assert out.returncode == 0, out.stderr
    assert ("note: enable_prefix_caching=true runs paged as prefix: allocators=[paged,prefix] ran prefix"
            in out.stderr)
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.is_dir() and p.name != ".hydra") == ["prefix"]


def test_unusable_output_folders_are_one_line(tmp_path):
    (tmp_path / "afile").write_text("")
    for folder, fragment in (("afile", "is a file"), ("afile/sub", "cannot create")):
        assert_one_line_error(sim(tmp_path, "run", f"hydra.run.dir={folder}"), fragment, "key hydra.run.dir")
    assert [p.name for p in tmp_path.iterdir()] == ["afile"]


def test_a_run_into_an_existing_folder_keeps_the_files_it_does_not_write(tmp_path):
    (tmp_path / "mine" / "paged").mkdir(parents=True)
    (tmp_path / "mine" / "paged" / "notes.txt").write_text("keep")
    out = sim(tmp_path, "run", "+experiment=golden", "scenario.num_sessions=4", "plots=false",
              "allocators=[paged]", "hydra.run.dir=mine")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "mine" / "paged" / "notes.txt").read_text() == "keep"
    assert (tmp_path / "mine" / "paged" / "metrics.json").is_file()


def test_a_failed_sweep_into_an_existing_folder_leaves_its_other_folders_alone(tmp_path):
    (tmp_path / "mine" / "notes").mkdir(parents=True)
    out = sim(tmp_path, "run", "-m", "+experiment=golden", "block_size=2000,3000", "hydra.sweep.dir=mine")
    assert out.returncode == 2
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes"]


@pytest.mark.parametrize("args, switch", [
    (["disaggregation.prefill_replicas=3"], "disaggregation.enabled is false"),
    (["kv_offload.eviction=fifo"], "no KV tier is on"),
    (["kv_offload.pool_cpu=true", "kv_offload.shared_gib=1"], "kv_offload.cpu_gib is 0"),
    (["slo.percentile=95"], "no SLO target is set"),
    (["figures=[kv.waste_of_used]"], "figures_dir is not set"),
    (["cluster.router_staleness_s=2", "router=round_robin"], "reads no replica state"),
    (["swap_space=16"], "preemption_mode is recompute"),
    (["router=prefix_aware", "cluster.num_replicas=1"], "cluster.num_replicas is 1"),
])
def test_a_setting_of_something_switched_off_is_an_error_naming_the_switch(tmp_path, args, switch):
    assert_one_line_error(run(tmp_path, "+experiment=golden", *args), "is not read", switch)
    assert not (tmp_path / "out").exists()


def test_burstiness_needs_a_request_rate_to_shape(tmp_path):
    bench = ["scenario=bench", "model=llama31_8b", "gpu=h100", "tensor_parallel_size=1", "scenario.num_prompts=8",
             "scenario.input_len=32", "scenario.output_len=4", "scenario.burstiness=0.5"]
    assert_one_line_error(run(tmp_path, *bench), "scenario.burstiness is not read", "scenario.request_rate is inf")
    assert run(tmp_path, *bench, "scenario.request_rate=20").returncode == 0


def test_a_replica_wider_than_one_nvlink_node_is_said(tmp_path):
    """Collectives are timed on one 8-GPU node's NVLink: a wider replica is warned about."""
    base = ["scenario=bench", "model=llama31_70b", "gpu=h100", "scenario.num_prompts=4", "scenario.input_len=32",
            "scenario.output_len=4"]
    within = run(tmp_path, *base, "tensor_parallel_size=8", "hydra.run.dir=a")
    tp16 = run(tmp_path, *base, "tensor_parallel_size=16", "hydra.run.dir=b")
    stages = run(tmp_path, *base, "tensor_parallel_size=8", "pipeline_parallel_size=2", "hydra.run.dir=c")
    assert within.returncode == tp16.returncode == stages.returncode == 0, (tp16.stderr, stages.stderr)
    assert "NVLink node" not in within.stderr
    assert "warning: tensor_parallel_size=16 all-reduces over 16 GPUs, more than one 8-GPU NVLink node" in tp16.stderr
    assert "pipeline_parallel_size=2 x tensor_parallel_size=8 puts 16 GPUs in a replica" in stages.stderr


def test_a_sweep_may_set_what_a_swept_switch_reads(tmp_path):
    out = sim(tmp_path, "run", "-m", "+experiment=golden", "allocators=[paged]", "quiet=true",
              "disaggregation.enabled=false,true", "disaggregation.decode_replicas=2", "hydra.sweep.dir=sweep")
    assert out.returncode == 0 and "2 jobs ran, 0 infeasible" in out.stderr, out.stderr


def test_queue_orders_that_cannot_reorder_are_said(tmp_path):
    lpm = run(tmp_path, "+experiment=golden", "queue_order=lpm", "allocators=[paged,prefix]")
    assert lpm.returncode == 0, lpm.stderr
    notes = [line for line in lpm.stderr.splitlines() if line.startswith("note: queue_order=lpm")]
    assert len(notes) == 1 and "paged caches none" in notes[0]
    priority = sim(tmp_path, "run", "+experiment=golden", "queue_order=priority", "allocators=[paged]",
                   "hydra.run.dir=p")
    assert "every request has the same priority" in priority.stderr
