"""The printed table, comparison.csv, metrics.json and the plots say the same numbers; progress."""
import io
import json

import numpy as np
import pandas as pd
import pytest

import sim.report as report_module
from sim.metrics import flatten
from sim.progress import progress_bar
from sim.report import BREAKDOWN, TABLE_COLUMNS, _carried, _number
from tests.test_cli import sim


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("agree")
    out = sim(folder, "run", "+experiment=golden", "scenario.num_sessions=12", "plots=true",
              "measure.warmup_s=0.5", "measure.exclude_drain=true", "hydra.run.dir=out")
    assert out.returncode == 0, out.stderr
    return folder / "out", out.stdout


def test_printed_table_csv_and_metrics_json_agree(run_dir):
    folder, stdout = run_dir
    comparison = pd.read_csv(folder / "comparison.csv")
    lines = stdout.splitlines()
    header = lines[1].split()
    assert header[:len(TABLE_COLUMNS)] == list(TABLE_COLUMNS.values())
    for line, (_, row) in zip(lines[2:2 + len(comparison)], comparison.iterrows()):
        printed = dict(zip(header, line.split()))
        assert printed["allocator"] == row.allocator
        for key, label in list(TABLE_COLUMNS.items())[1:]:
            value = row[key]   # integers print as integers, other numbers as the table formats them
            expected = str(int(value)) if pd.api.types.is_integer(value) else _number(value)
            assert printed[label] == expected, (label, printed[label], value)
        metrics = flatten(json.loads((folder / row.allocator / "metrics.json").read_text()))
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and key != "wall_time_s":
                assert row[key] == pytest.approx(value, rel=1e-12), key


def test_plots_draw_the_comparison_numbers_and_say_what_was_run(run_dir, monkeypatch):
    folder, _ = run_dir
    comparison = pd.read_csv(folder / "comparison.csv")
    figures = {}
    monkeypatch.setattr(report_module, "_save", lambda fig, path: figures.__setitem__(path.name, fig))
    monkeypatch.setattr(report_module, "write_csv", lambda path, frame: None)
    report_module.report(folder)
    assert set(figures) == {"comparison.png", "memory_breakdown.png", "kv_usage.png", "latency_cdf.png"}
    for name, fig in figures.items():
        title = fig._suptitle.get_text()
        for part in ("scenario=rag_agents", "model=llama3_8b", "gpu=a100_80g",
                     "tensor_parallel_size=1", "cluster.num_replicas=2"):
            assert part in title, (name, part)
    left = figures["comparison.png"].axes[0]
    assert "of capacity" in left.get_title() and "capacity" in left.get_ylabel()
    # Bars are stacked in BREAKDOWN order, one container per category, one bar per allocator.
    for container, (key, _, _) in zip(left.containers, BREAKDOWN):
        heights = [bar.get_height() for bar in container]
        assert heights == pytest.approx(comparison[f"kv.{key}_of_capacity"].tolist(), rel=1e-12)


def test_breakdown_over_time_averages_to_the_reported_shares(run_dir):
    """memory_breakdown.png draws each category's share of capacity over time; its time average
    over the measured window is what comparison.csv reports."""
    folder, _ = run_dir
    comparison = pd.read_csv(folder / "comparison.csv").set_index("allocator")
    for allocator, row in comparison.iterrows():
        start, end = json.loads((folder / allocator / "metrics.json").read_text())["measurement"]["window_s"]
        summed = _carried(pd.read_parquet(folder / allocator / "timeline.parquet"),
                          ["capacity", *[k for k, _, _ in BREAKDOWN]])
        times = np.clip(summed.index.to_numpy(), start, end)
        held = np.diff(np.append(times, end))
        for key, _, _ in BREAKDOWN:
            share = (summed[key] / summed["capacity"]).to_numpy()
            assert (share * held).sum() / (end - start) == pytest.approx(row[f"kv.{key}_of_capacity"], abs=1e-9)


def test_progress_bar_counts_requests_and_shows_rate_and_eta():
    stream = io.StringIO()
    with progress_bar(True, 200, "paged", file=stream, delay_s=0) as bar:
        for i in range(200):
            bar.advance(float(i))
        shown = str(bar.bar)            # what the terminal line says now
    assert shown.startswith("paged:") and "192/200" in shown and "req/s" in shown
    assert "<" in shown and "sim 191 s" in shown      # elapsed<remaining (ETA), simulated time
    quiet = io.StringIO()
    with progress_bar(False, 200, "paged", file=quiet) as bar:
        bar.advance(1.0)
    assert quiet.getvalue() == ""


def test_report_redraws_a_run_written_before_the_denominator_names(run_dir, tmp_path, monkeypatch):
    folder, _ = run_dir
    old = tmp_path / "old"
    old.mkdir()
    comparison = pd.read_csv(folder / "comparison.csv")
    legacy = comparison.drop(columns=[c for c in comparison if c.endswith(("_of_capacity", "_of_used"))])
    legacy.to_csv(old / "comparison.csv", index=False)
    monkeypatch.setattr(report_module, "_save", lambda fig, path: None)
    report_module.report(old)
    written = pd.read_csv(old / "memory_breakdown.csv")
    for key in ("kv.token_states_of_capacity", "kv.waste_of_used", "kv.token_states_of_used"):
        assert written[key].tolist() == pytest.approx(comparison[key].tolist(), rel=1e-12)
