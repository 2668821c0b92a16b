"""Measure -> fit -> predict -> simulate on this CPU: the torch reference operators timed for real
(not the Triton interpreter). Artefacts are checked, not accuracy (shared machines are noisy)."""
import json
import subprocess
import sys

import pandas as pd


def run(tmp_path, module, *args):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)


def test_a_cpu_calibration_fits_a_profile_that_predict_and_the_simulator_use(tmp_path):
    out = run(tmp_path, "calibration", "run", "device=cpu", "backend=torch", "grid=smoke")
    assert out.returncode == 0, out.stderr
    folder = tmp_path / "results" / "calibration" / "cpu"
    raw = pd.read_csv(folder / "raw.csv")
    assert set(raw.op) >= {"gemm", "paged_decode", "stream", "launch"} and (raw.time_s > 0).all()
    assert set(raw.source) == {"measured"} and raw.gpu.str.startswith("CPU").all()
    profile = json.loads((folder / "profile.json").read_text())
    assert profile["operators"]["gemm"]["source"] == "measured"
    assert profile["operators"]["attention_decode"]["source"] == "measured"
    assert profile["bf16_flops_per_s"] > 0 and profile["gpu_name"].startswith("CPU")
    report = (folder / "fit_report.md").read_text()
    assert "held-out" in report and (folder / "fit.png").is_file()

    (tmp_path / "shapes.csv").write_text("op,m,n,k,dtype\ngemm,16,32,16,fp16\n")
    out = run(tmp_path, "calibration", "predict", "gpu=cpu", "shapes=shapes.csv", "out=times.csv")
    assert out.returncode == 0, out.stderr
    assert pd.read_csv(tmp_path / "times.csv").time_s.iloc[0] > 0

    out = run(tmp_path, "sim", "run", "gpu=cpu", "scenario=bench", "model=llama31_8b", "tensor_parallel_size=1",
              "max_model_len=1024", "scenario.num_prompts=2", "scenario.input_len=32", "scenario.output_len=4",
              "plots=false", "hydra.run.dir=run")
    assert out.returncode == 0, out.stderr
    metrics = json.loads((tmp_path / "run" / "paged" / "metrics.json").read_text())
    assert metrics["latency_profile"]["gpu"] == "cpu" and metrics["latency_profile"]["operators"]["gemm"] == "measured"


def test_an_unknown_backend_is_one_line(tmp_path):
    out = run(tmp_path, "calibration", "run", "device=cpu", "backend=jax", "grid=smoke")
    assert out.returncode == 2 and "unknown backend 'jax'" in out.stderr and "Traceback" not in out.stderr
