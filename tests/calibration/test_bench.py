"""The benchmark harness on the CPU: grids expand from config, each case runs its kernel (under
the interpreter) and becomes one long-format row; the rows fit into a profile."""
import subprocess
import sys

import pandas as pd
import pytest

from tests.calibration.conftest import DEVICE  # sets TRITON_INTERPRET first

from calibration.bench import benchmark, expand
from calibration.gpus import profile_name
from calibration.fit import fit_profile
from calibration.raw import COLUMNS, read_raw, write_raw
from tests.conftest import compose_config

TINY = {
    "gemm": {"m": [1, 16], "nk": [[32, 16]], "dtype": ["fp16"]},
    "paged_decode": {"batch": [2], "context": [9], "heads": [4], "kv_heads": [2], "head_dim": [16],
                     "block_size": [4], "num_splits": [2], "dtype": ["fp16"]},
    "contiguous_decode": {"batch": [2], "context": [9], "heads": [4], "kv_heads": [2], "head_dim": [16], "dtype": ["fp16"]},
    "mla_decode": {"batch": [1], "context": [5], "heads": [2], "block_size": [4], "dtype": ["fp32"]},
    "prefill": {"batch": [1], "num_tokens": [8], "context": [4], "heads": [2], "kv_heads": [1], "head_dim": [16], "dtype": ["fp16"]},
    "kv_copy": {"num_blocks": [2], "block_size": [4], "kv_heads": [1], "head_dim": [8], "dtype": ["fp16"]},
    "stream": {"bytes": [4096], "kind": ["copy", "triad"], "dtype": ["fp16"]},
}


def test_grids_expand_to_their_cartesian_products():
    grid = compose_config("calibration_run", []).grid
    points = expand(dict(grid))
    gemm = [shape for op, shape in points if op == "gemm"]
    assert len(gemm) == len(grid.gemm.m) * len(grid.gemm.nk) * len(grid.gemm.dtype)
    assert {(s["n"], s["k"]) for s in gemm} == {tuple(nk) for nk in grid.gemm.nk}
    full = expand(dict(compose_config("calibration_run", ["grid=full"]).grid))
    assert len(full) > len(points)


def test_each_case_runs_its_kernel_and_becomes_one_row(tmp_path):
    calls = []

    def timer(fn, warmup_ms, rep_ms):
        fn()  # the kernel really runs (interpreter on the CPU)
        calls.append(1)
        return 1e-5, 2e-5, 3e-5
    rows = benchmark(expand(TINY), device=DEVICE, context={"gpu": "test", "source": "measured"},
                     timer=timer, progress=open("/dev/null", "w"))
    assert len(calls) == len(rows) == len(expand(TINY)) + 1     # + launch overhead
    assert {r["op"] for r in rows} == set(TINY) | {"launch"}
    assert all(r["time_s"] == 2e-5 and r["time_s_p20"] == 1e-5 for r in rows)
    stream_rows = [r for r in rows if r["op"] == "stream"]
    assert sorted(r["bytes"] for r in stream_rows) == [4096, 6144]    # copy: 2 arrays, triad: 3
    write_raw(rows, tmp_path / "raw.csv")
    frame = read_raw(tmp_path / "raw.csv")
    assert list(frame.columns) == list(COLUMNS) and len(frame) == len(rows)


def test_profile_names_follow_the_detected_gpu():
    assert profile_name("NVIDIA H200") == "h200"
    assert profile_name("NVIDIA A100-SXM4-80GB") == "a100_80g"
    assert profile_name("Some New GPU 9000") == "some_new_gpu_9000"


def test_measured_rows_fit_per_operator_with_provenance():
    import json
    from importlib import resources
    base = json.loads((resources.files("calibration") / "profiles" / "h200.json").read_text())
    rows = []
    for context in [256, 512, 1024, 2048, 4096, 8192]:
        for batch in [1, 8, 32, 64, 128]:
            nbytes = 2 * batch * context * 8 * 128 * 2
            rows.append({"op": "paged_decode", "batch": batch, "heads": 32, "kv_heads": 8, "head_dim": 128,
                         "block_size": 16, "num_splits": 4, "context": context, "dtype": "bf16",
                         "time_s": 5e-6 + nbytes / (4.8e12 * 0.6)})
    profile, report = fit_profile(pd.DataFrame(rows), base, name="h200", source="measured", origin="t",
                                  date="2026-11-30", versions={})
    decode = profile["operators"]["attention_decode"]
    assert decode["source"] == "measured" and decode["memory_efficiency"] == pytest.approx(0.6, rel=0.05)
    assert profile["operators"]["gemm"]["source"].startswith(("prior:", "imported:"))  # not measured: kept
    # kernel rows are fitted as the catalogue's operator: the simulator's class and size axis
    assert "paged_decode" not in report
    assert report["attention_decode"]["extrapolation"]["mape"] < 0.05


def test_run_without_a_gpu_is_one_line_and_exit_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "calibration", "run"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    if out.returncode == 0:
        pytest.skip("a GPU is present")
    assert out.returncode == 2 and out.stderr.strip().startswith("error: no CUDA GPU found")
    assert len(out.stderr.strip().splitlines()) == 1
