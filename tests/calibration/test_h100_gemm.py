"""H100 GEMMs: the packaged profile against measured H100 timings it was not fitted to
(validation/h100_gemm.csv: vLLM PR #49363 and FBGEMM PR #2546), and held-out shape classes of
Vidur's H100 timings it was fitted to (issue 5's 15% MAPE)."""
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from calibration.commands import profile_json
from calibration.fit import evaluate, operator_params, predict, prepare
from calibration.vidur import import_file

ROOT = Path(__file__).parent.parent.parent
CHECK = ROOT / "validation" / "h100_gemm.csv"


def errors(rows: pd.DataFrame, operator: str) -> np.ndarray:
    profile = profile_json("h100")
    prepared = prepare(rows.reset_index(drop=True), "gemm", profile)
    predicted = predict(prepared, profile, "gemm", profile["operators"][operator])
    return (predicted - prepared.t.to_numpy()) / prepared.t.to_numpy()


@pytest.mark.parametrize("dtype,operator", [("bf16", "gemm"), ("fp8", "gemm_fp8")])
def test_h100_gemms_of_an_independent_source_are_within_15_percent(dtype, operator):
    rows = pd.read_csv(CHECK)
    uncapped = rows[(rows.dtype == dtype) & rows.source_url.str.contains("vllm")]
    assert len(uncapped) == 4
    assert np.abs(errors(uncapped, operator)).mean() <= 0.15
    capped = rows[(rows.dtype == dtype) & rows.source_url.str.contains("FBGEMM")]  # a 500 W H100 (700 W rated)
    assert (errors(capped, operator) < 0).all()  # slower than a full-power H100, as it should be


def test_held_out_h100_gemm_classes_are_within_15_percent():
    frame = pd.DataFrame(import_file(ROOT / "tests" / "data" / "vidur_h100_sample" / "h100__meta-llama_Llama-2-7b-hf.csv"))
    base = profile_json("h100")
    report = evaluate(prepare(frame, "gemm", base), base, "gemm", operator_params(base, "gemm"))
    assert report["held_out_classes"]["mape"] <= 0.15
    assert report["extrapolation"]["mape"] <= 0.15
