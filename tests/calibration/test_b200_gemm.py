"""B200 GEMMs: the packaged profile's 16-bit GEMM is fitted to published B200 BF16 timings
(calibration/published/b200_gemm_times.csv), and its FP8 and FP4 GEMMs, derived from that fit at
the priors' ratios, are checked against published B200 timings of other kernels."""
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from calibration.commands import profile_json
from calibration.fit import evaluate, operator_params, predict, prepare

ROOT = Path(__file__).parent.parent.parent
PUBLISHED = ROOT / "calibration" / "published" / "b200_gemm_times.csv"
TFLOPS = 1e12


def timings(dtype: str, points) -> pd.DataFrame:
    return pd.DataFrame([{"op": "gemm", "m": m, "n": n, "k": k, "dtype": dtype,
                          "time_s": 2 * m * n * k / (tflops * TFLOPS)} for m, n, k, tflops in points])


def errors(rows: pd.DataFrame, operator: str) -> np.ndarray:
    profile = profile_json("b200")
    prepared = prepare(rows.reset_index(drop=True), "gemm", profile)
    predicted = predict(prepared, profile, "gemm", profile["operators"][operator])
    return (predicted - prepared.t.to_numpy()) / prepared.t.to_numpy()


def test_the_b200_gemm_is_imported_from_the_published_timings_and_holds_out_within_15_percent():
    profile = profile_json("b200")
    assert profile["operators"]["gemm"]["source"].startswith("imported:")
    assert profile["operators"]["gemm"]["origin"] == "calibration/published/b200_gemm_times.csv"
    report = evaluate(prepare(pd.read_csv(PUBLISHED), "gemm", profile), profile, "gemm",
                      operator_params(profile, "gemm"))
    assert report["held_out_classes"]["mape"] <= 0.15
    assert report["extrapolation"]["mape"] <= 0.15
    assert profile["operators"]["gemm"]["compute_efficiency"] < 1745.0 / 2250  # below the best-shape MAMF


def test_weight_bound_b200_gemms_the_fit_never_saw_are_within_15_percent():
    """The same PRs' rows at m 1-256 (N=6144 K=4096), which the fit (m >= 512) never saw: they read
    the weights, so they check the fixed cost (1.5 us) and the memory efficiency the fit kept; the
    best-shape prior (4 us) was about a third slow on them."""
    rows = timings("bf16", [(1, 6144, 4096, 5.916331), (16, 6144, 4096, 94.832504), (64, 6144, 4096, 402.560830),
                            (128, 6144, 4096, 729.298288), (256, 6144, 4096, 1100.851307),  # vLLM PR #19566
                            (1, 6144, 4096, 5.924172), (16, 6144, 4096, 94.808087), (64, 6144, 4096, 402.453176),
                            (128, 6144, 4096, 729.098503), (256, 6144, 4096, 1127.022999)])  # vLLM PR #20578
    error = errors(rows, "gemm")
    assert np.abs(error).max() <= 0.15 and np.abs(error).mean() <= 0.10, error


def test_b200_fp8_and_fp4_gemms_of_other_kernels_are_faster_by_about_a_sixth():
    """vLLM's CUTLASS kernels without the activation quantization (vLLM PR #19566 FP8 per-tensor,
    PR #20578 NVFP4, the GEMM alone): kvsim is faster, as the ratios it carries over are the best
    shapes' (stas00's MAMF, cuBLASLt at 8192^3)."""
    fp8 = timings("fp8", [(512, 6144, 4096, 1838.7), (1024, 6144, 4096, 2341.4), (16384, 6144, 4096, 2544.68),
                          (512, 4096, 4096, 1832.0), (1024, 4096, 4096, 2076.66)])
    fp4 = timings("nvfp4", [(512, 6144, 4096, 2188), (1024, 6144, 4096, 2895), (2048, 6144, 4096, 3411), (4096, 6144, 4096, 3645.59),
                            (8192, 6144, 4096, 3779), (16384, 6144, 4096, 3904)])
    for rows, operator in ((fp8, "gemm_fp8"), (fp4, "gemm_fp4")):
        error = errors(rows, operator)
        assert (error < 0).all() and np.abs(error).max() <= 0.4, (operator, error)  # FP4 at m=512: -37%
        assert np.abs(error).mean() == pytest.approx(0.16, abs=0.04), (operator, error)


def test_no_b200_gemm_kernel_is_timed_shorter_than_the_small_kernels_measured_on_it():
    """The fit's fixed cost (1.5 us, from m >= 512 and confirmed by 50 MB weight-bound GEMVs) put
    small B200 GEMMs at 1.7-3.0 us, where TensorRT-LLM's decode trace measured 3.7-10.0 us and torchao
    5.1 us at 1024^3 (calibration/published/b200_small_gemm_kernels.csv): the profile's gemm_floor is
    their geometric mean, and kvsim now times each plain GEMM among them (not the two per-head bmm)
    within a factor 2 of its measured time (0.18-0.59 of it before); the Hopper profiles measured
    no small kernels and have no floor."""
    from sim.latency.calibrated import calibrated_gemm
    from sim.latency.profile import load_profile
    rows = pd.read_csv(ROOT / "calibration" / "published" / "b200_small_gemm_kernels.csv")
    b200 = load_profile("b200")
    floor = b200.op("gemm_floor").t0_s
    assert floor == pytest.approx(np.exp(np.log(rows.time_s).mean()), rel=1e-3)
    assert b200.op("gemm_floor").source.startswith("imported:")
    from calibration.priors import PRIORS, with_priors  # a profile refitted without it gets it back
    packaged = profile_json("b200")
    bare = {**packaged, "operators": {k: v for k, v in packaged["operators"].items() if k != "gemm_floor"}}
    assert with_priors(bare)["operators"]["gemm_floor"] == packaged["operators"]["gemm_floor"]
    assert PRIORS["h100"].small_gemms is None
    gemm = calibrated_gemm(b200)
    gemms = rows[rows.op == "gemm"]
    ratios = np.array([gemm.time(r.m, r.n, r.k, r.dtype) / r.time_s for r in gemms.itertuples()])
    assert (ratios >= floor / gemms.time_s.to_numpy() - 1e-9).all()
    assert ratios.min() > 0.5 and ratios.max() < 1.5, ratios
    assert load_profile("h100").op("gemm_floor").t0_s == 0.0
    assert load_profile("h100").op("gemm_floor").source.startswith("prior:none")


def test_show_says_the_floor_is_a_least_kernel_time_not_a_fixed_cost(capsys):
    from omegaconf import OmegaConf
    from calibration.commands import show_task
    show_task(OmegaConf.create({"gpu": "b200"}))
    line = next(line for line in capsys.readouterr().out.splitlines() if "gemm_floor" in line)
    assert "least GEMM kernel time=5.17us" in line and "t0=" not in line
