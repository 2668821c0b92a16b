"""`python -m sim run +experiment=kv_axes`: the shrinking axes' claims, checkable in its table
(REFERENCE.md section 1: GQA-8 is 1/8 of MHA, CLA-2 halves it, FP8 halves s; section 8: the
compressed pattern stores a small fraction)."""
import subprocess
import sys

import pandas as pd
import pytest

from sim.models import load_model, model_from_dict


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("kv_axes")
    out = subprocess.run([sys.executable, "-m", "sim", "run", "+experiment=kv_axes", f"hydra.run.dir={run_dir}",
                          "quiet=true"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "not simulated" not in out.stderr  # every variant runs (a kind that could not is said)
    assert (run_dir / "kv_axes.png").stat().st_size > 10_000
    return pd.read_csv(run_dir / "kv_axes.csv")


def per_token(table, variant, dtype="bf16"):
    rows = table[(table.variant == variant) & (table.kv_dtype == dtype)]
    assert len(rows) == 2  # one per workload
    return rows.kv_bytes_per_token.iloc[0]


def test_the_axes_scale_their_factor(table):
    assert per_token(table, "GQA-8") * 8 == per_token(table, "MHA")
    assert per_token(table, "CLA-2") * 2 == per_token(table, "GQA-8")
    assert per_token(table, "MQA") * 8 == per_token(table, "GQA-8")
    assert per_token(table, "MLA") == 80 * 576 * 2  # DeepSeek-V3's latent + RoPE widths
    for variant in set(table.variant) - {"CSA/HCA"}:  # its indexer keys stay 132 B (FP8 already)
        assert per_token(table, variant, "fp8") * 2 == per_token(table, variant, "bf16")
    entry = 2 * 8 * 128 * 2  # a pooled entry of GQA-8's K and V, BF16
    assert per_token(table, "CSA/HCA") == 40 * (entry / 4 + 132 / 4) + 40 * entry / 128


def test_every_variant_is_simulated_and_the_compressed_one_fits_the_most(table):
    assert table.simulated.all()
    for _, part in table.groupby(["workload", "kv_dtype"]):
        most = part.loc[part.sequences_that_fit_at_mean_length.idxmax()]
        assert most.variant == "CSA/HCA"


def test_fewer_stored_bytes_never_fit_fewer_sequences(table):
    simulated = table[table.simulated.astype(bool)].sort_values("kv_bytes_per_sequence_at_mean_length")
    for _, part in simulated.groupby("workload"):
        fits = part.sequences_that_fit_at_mean_length.tolist()
        assert fits == sorted(fits, reverse=True)


def test_memory_decides_when_the_cache_is_the_limit(table):
    for workload, part in table[table.simulated.astype(bool)].groupby("workload"):
        mha, gqa = (part[(part.variant == v) & (part.kv_dtype == "bf16")].iloc[0] for v in ("MHA", "GQA-8"))
        assert gqa.mean_running_sequences > 2 * mha.mean_running_sequences, workload
        assert gqa.output_tokens_per_s > 1.3 * mha.output_tokens_per_s, workload


def test_the_compressed_pattern_stores_a_small_fraction_at_1m():
    base = load_model("llama31_70b")
    fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
    compressed = model_from_dict({**fields, "layers": [
        {"kind": "compressed", "count": 40, "ratio": 4, "window": 128, "top_k": 1024, "indexer_entry_bytes": 132},
        {"kind": "compressed", "count": 40, "ratio": 128, "window": 128}]})
    tokens = 1 << 20
    stored = sum(u.stored_bytes + u.indexer_bytes + u.window_bytes for u in compressed.kv_usage(tokens))
    entry = 2 * 8 * 128 * 2
    expected = 40 * (entry / 4 + 132 / 4) + 40 * entry / 128 + 80 * 128 * entry / tokens  # + windows
    assert stored / tokens == pytest.approx(expected)
    assert stored / (tokens * base.kv_bytes_per_token()) < 0.14  # V4-Pro vs V3.2: 11.5% (REFERENCE §8)
