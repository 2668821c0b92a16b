"""The torch-free fit: recovers a known model, imports Vidur's files, predicts in order."""
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calibration.fit import fit_profile, fit_roofline, prepare
from calibration.vidur import import_directory
from sim.latency.calibrated import CalibratedOp, CorrectionTable, Roofline, gemm_work
from sim.errors import KvsimError
from sim.latency.profile import load_profile

SAMPLE = Path(__file__).parent.parent / "data" / "vidur_a100_sample"


def h100():
    from importlib import resources
    return json.loads((resources.files("calibration") / "profiles" / "h100.json").read_text())


def synthetic(profile, ec, em, t0, noise, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for n, k in [(4096, 4096), (14336, 4096), (4096, 14336), (1024, 8192), (8192, 1024), (6144, 4096)]:
        for m in [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]:
            flops, nbytes = gemm_work(m, n, k, "bf16")
            t = t0 + max(flops / (profile["bf16_flops_per_s"] * ec), nbytes / (profile["hbm_bandwidth_bytes_per_s"] * em))
            rows.append({"op": "gemm", "m": m, "n": n, "k": k, "dtype": "bf16",
                         "time_s": t * (1 + noise * rng.standard_normal())})
    return pd.DataFrame(rows)


def test_fit_recovers_known_efficiencies_from_noisy_synthetic_data():
    profile = h100()
    frame = synthetic(profile, ec=0.62, em=0.81, t0=7e-6, noise=0.02)
    rows = prepare(frame, "gemm", profile)
    fitted = fit_roofline(rows.tc.to_numpy(), rows.tm.to_numpy(), rows.t.to_numpy())
    ec, em, t0 = (fitted[k] for k in ("compute_efficiency", "memory_efficiency", "t0_s"))
    assert ec == pytest.approx(0.62, rel=0.05)
    assert em == pytest.approx(0.81, rel=0.05)
    assert t0 == pytest.approx(7e-6, abs=2e-6)


def test_report_holds_out_whole_classes_and_beats_the_bare_roofline():
    profile = h100()
    fitted, report = fit_profile(synthetic(profile, 0.55, 0.7, 5e-6, 0.01), profile, name="x", source="measured",
                                 origin="synthetic", date="2026-11-30", versions={})
    gemm = report["gemm"]
    assert gemm["held_out_classes"]["mape"] < 0.03
    assert gemm["extrapolation"]["mape"] < 0.05
    assert gemm["held_out_classes_roofline"]["mape"] > 0.2
    assert fitted["operators"]["gemm"]["source"] == "measured"
    assert fitted["operators"]["attention_decode"]["source"].startswith("prior:")   # not measured: kept


def test_import_vidur_sample_turns_gemm_timings_into_raw_rows():
    rows = import_directory(SAMPLE)
    frame = pd.DataFrame(rows)
    assert set(frame.op) == {"gemm"} and set(frame.dtype) == {"fp16"}
    # Llama-3-8B at TP 1: attn_pre_proj is (32 + 2 * 8) * 128 = 6144 wide over K = 4096.
    qkv = frame[frame.source.str.endswith("Meta-Llama-3-8B:attn_pre_proj") & (frame.tp == 1)]
    assert set(zip(qkv.n, qkv.k)) == {(6144, 4096)}
    up = frame[frame.source.str.endswith("Llama-2-7b-hf:mlp_up_proj") & (frame.tp == 2)]
    assert set(zip(up.n, up.k)) == {(2 * 11008 // 2, 4096)}
    assert (frame.time_s > 0).all() and (frame.time_s_min <= frame.time_s).all()


def test_predictions_are_monotone_in_tokens_and_never_below_the_datasheet_roofline():
    profile = load_profile("a100_80g")
    from sim.latency.calibrated import calibrated_gemm
    gemm = calibrated_gemm(profile)
    for n, k in [(6144, 4096), (4096, 4096), (28672, 8192), (12345, 777)]:
        times = [gemm.time(m, n, k, "fp16") for m in np.geomspace(1, 65536, 200)]
        assert all(b >= a for a, b in zip(times, times[1:])), (n, k)
        for m, t in zip(np.geomspace(1, 65536, 200), times):
            flops, nbytes = gemm_work(m, n, k, "fp16")
            assert t >= max(flops / profile.bf16_flops_per_s, nbytes / profile.hbm_bandwidth_bytes_per_s)


@settings(max_examples=100, deadline=None)
@given(factors=st.lists(st.floats(0.5, 3.0), min_size=3, max_size=8), sizes=st.lists(st.floats(1, 1e5), min_size=2, max_size=20))
def test_any_correction_table_gives_monotone_times(factors, sizes):
    grid = tuple(np.linspace(0, 14, len(factors)).tolist())
    op = CalibratedOp(Roofline(1e14, 1e12, 0.7, 0.8, 5e-6), CorrectionTable(grid, tuple(factors), {}))
    work = lambda m: gemm_work(m, 4096, 4096, "bf16")  # noqa: E731
    sizes = sorted(sizes)
    times = [op.time("c", s, work) for s in sizes]
    assert all(b >= a * (1 - 1e-12) for a, b in zip(times, times[1:]))


def run(*args, cwd):
    return subprocess.run([sys.executable, "-m", "calibration", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_import_vidur_then_predict_and_show_from_the_command_line(tmp_path):
    out = run("import-vidur", f"path={SAMPLE}", "name=a100_80g", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    folder = tmp_path / "results" / "calibration" / "a100_80g"
    for name in ("raw.csv", "profile.json", "fit_report.md", "fit.png"):
        assert (folder / name).is_file()
    assert json.loads((folder / "profile.json").read_text())["operators"]["gemm"]["source"].startswith("imported:vidur")
    shapes = tmp_path / "shapes.csv"
    shapes.write_text("op,m,n,k,dtype\ngemm,4096,6144,4096,fp16\ngemm,1,6144,4096,fp16\ngemm,512,4096,4096,bf16\n")
    out = run("predict", "gpu=a100_80g", f"shapes={shapes}", "out=pred.csv", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    predicted = pd.read_csv(tmp_path / "pred.csv")
    assert predicted.m.tolist() == [4096, 1, 512] and (predicted.time_s > 0).all()
    assert predicted.time_s[0] > predicted.time_s[2] > predicted.time_s[1]
    refit = run("fit", f"raw={folder / 'raw.csv'}", "name=a100_80g", "out_dir=again", cwd=tmp_path)
    assert refit.returncode == 0, refit.stderr
    shown = run("show", "gpu=a100_80g", cwd=tmp_path)
    assert "source=imported" in shown.stdout and "held_out_classes" in shown.stdout


@pytest.mark.parametrize("args, fragment", [
    (["show", "gpu=nope"], "unknown gpu profile 'nope'"),
    (["fit", "raw=missing.csv", "name=h100"], "no such file 'missing.csv'"),
    (["import-vidur", "path=missing", "name=a100_80g"], "no such directory 'missing'"),
    (["predict", "gpu=h100", "shapes=missing.csv", "out=x.csv"], "no such file 'missing.csv'"),
    (["bench"], "unknown command 'bench'"),
    (["fit", "raw"], "malformed override"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, args, fragment):
    out = run(*args, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in out.stderr


def test_gpu_names_come_from_the_data_and_pick_the_datasheet_base(tmp_path):
    from calibration.gpus import base_profile
    from calibration.vidur import gpu_of

    assert gpu_of(Path("x/h100__meta-llama_Meta-Llama-3-8B.csv")) == "h100"
    assert gpu_of(Path("data/profiling/compute/a100/meta-llama/Llama-2-7b-hf/mlp.csv")) == "a100"
    assert gpu_of(Path("somewhere/mlp.csv")) == "unknown"
    packaged = ["a100_40g", "a100_80g", "h100", "h200"]
    assert base_profile("h200", "mine", ["h100"], packaged) == "h200"          # base= wins
    assert base_profile(None, "a100_80g", ["a100"], packaged) == "a100_80g"   # then the name
    assert base_profile(None, "my_gpu", ["NVIDIA H100 80GB HBM3"], packaged) == "h100"  # then the data
    with pytest.raises(KvsimError, match="key base, give base=<one of a100_40g"):
        base_profile(None, "my_gpu", ["unknown"], packaged)


def test_imported_h100_data_is_labelled_h100(tmp_path):
    (tmp_path / "in").mkdir()
    source = SAMPLE / "a100__meta-llama_Meta-Llama-3-8B.csv"
    (tmp_path / "in" / "h100__meta-llama_Meta-Llama-3-8B.csv").write_text(source.read_text())
    rows = import_directory(tmp_path / "in")
    assert {r["gpu"] for r in rows} == {"h100"}


def test_profile_names_are_plain_one_gpu_and_match_a_packaged_gpu():
    from calibration.gpus import check_profile_name
    packaged = ["a100_40g", "a100_80g", "h100", "h200"]
    check_profile_name("a100_80g", ["a100"], packaged)          # Vidur's folder name, same family
    check_profile_name("my_h100", ["h100"], packaged)
    for name, gpus, message in [("../x", ["h100"], "not a plain file name"),
                                ("mine", ["foo", "h100"], "several GPUs"),
                                ("h200", ["NVIDIA H100 80GB HBM3"], "use name=h100 or a name of your own")]:
        with pytest.raises(KvsimError, match=re.escape(message)):
            check_profile_name(name, gpus, packaged)


def test_a_cut_vidur_file_is_one_line_naming_its_row(tmp_path):
    text = (SAMPLE / "a100__meta-llama_Meta-Llama-3-8B.csv").read_text()
    (tmp_path / "a100__cut.csv").write_text(text[:20000])
    with pytest.raises(KvsimError, match=r"incomplete row \(empty values\), .*a100__cut.csv:\d+"):
        import_directory(tmp_path)


def test_calibration_run_without_torch_says_what_to_install(tmp_path):
    code = ("import sys; sys.modules['torch'] = None; sys.argv = ['calibration', 'run']; "
            "from calibration.__main__ import main; main()")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        "error: python -m calibration run needs torch and triton (torch is not installed), command line, "
        "install them first: pip install torch==2.13.0 triton==3.7.1 (fit, import-vidur, predict and "
        "show need neither)"]
    assert list(tmp_path.iterdir()) == []


def test_a_raw_csv_is_measured_imported_or_refused_by_every_row_source():
    from calibration.commands import raw_provenance
    from calibration.raw import RawError

    def frame(*sources):
        return pd.DataFrame({"op": "gemm", "m": 1, "n": 1, "k": 1, "dtype": "bf16", "time_s": 1e-5,
                             "source": list(sources)})

    assert raw_provenance(frame("measured", "Measured"), Path("x.csv")) == "measured"
    assert raw_provenance(frame(None, None), Path("x.csv")) == "measured"  # no sources: calibration run's own
    assert raw_provenance(frame("vLLM PR #19566", "torchao PR #2427"), Path("x.csv")) == "imported"
    with pytest.raises(RawError, match="1 rows say source=measured and 1 name another source"):
        raw_provenance(frame("measured", "vLLM PR #19566"), Path("x.csv"))


def test_fitting_a_raw_csv_of_measured_and_imported_rows_is_one_line_exit_2_and_writes_nothing(tmp_path):
    (tmp_path / "raw.csv").write_text("op,m,n,k,dtype,time_s,source\n"
                                      "gemm,512,4096,4096,bf16,1e-5,measured\n"
                                      "gemm,1024,4096,4096,bf16,2e-5,vLLM PR #19566\n")
    out = run("fit", "raw=raw.csv", "name=b200", "base=b200", cwd=tmp_path)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1 and "fit measured and imported timings" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw.csv"]


def test_the_report_says_where_the_fit_is_unchecked_or_worse_than_the_datasheet():
    """A fit worse on held-out rows than the datasheet profile alone is a warning (the CPU smoke
    loop's memory streams came out 390-457% against 68%), and an operator with no held-out split
    says its fit is unchecked instead of printing an empty table."""
    from calibration.report import NO_SPLIT, markdown, worse_than_datasheet

    def errors(mape):
        return {"num_rows": 6, "mape": mape, "p90_abs_error": mape, "bias": 0.0}
    fit = {"compute_efficiency": 1.0, "memory_efficiency": 0.2, "t0_s": 1e-6}
    report = {"stream": {"fit": fit, "held_out_classes": errors(3.9), "held_out_classes_datasheet": errors(0.68),
                         "held_out_classes_roofline": errors(0.68)},
              "gemm": {"fit": fit, "held_out_classes": errors(0.1), "held_out_classes_datasheet": errors(0.67),
                       "held_out_classes_roofline": errors(0.67)},
              "kv_copy": {"fit": fit}}
    assert worse_than_datasheet(report) == [
        "stream held-out shape classes: calibrated MAPE 390.0% against the datasheet profile's 68.0%"]
    text = markdown({"name": "cpu", "gpu_name": "CPU", "source": "measured"}, report)
    kv_copy = text.split("## kv_copy")[1]
    assert NO_SPLIT in kv_copy and "| split |" not in kv_copy
    assert "worse than the datasheet profile here" in text.split("## stream")[1].split("## ")[0]
    assert "worse than the datasheet" not in text.split("## gemm")[1].split("## ")[0]
