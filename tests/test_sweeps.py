"""Sweeps that survive (sim/sweep.py, sim/staging.py): infeasible jobs, summary.parquet, resume,
and the sweep report, as a user runs them."""
import json

import pandas as pd

from tests.test_cli import SMALL, assert_one_line_error, sim

SWEEP = ["run", "-m", *SMALL, "allocators=[paged]", "quiet=true"]


def test_an_infeasible_job_is_a_row_with_its_reason_and_the_sweep_goes_on(tmp_path):
    out = sim(tmp_path, *SWEEP, "model=llama31_405b,llama3_8b", "hydra.sweep.dir=sweep")
    assert out.returncode == 0, out.stderr
    summary = pd.read_parquet(tmp_path / "sweep" / "summary.parquet")
    assert summary.set_index("model").status.to_dict() == {"llama31_405b": "infeasible", "llama3_8b": "ok"}
    infeasible = summary[summary.status == "infeasible"].iloc[0]
    assert "does not fit" in infeasible.reason and "tensor_parallel_size" in infeasible.reason
    assert sorted(p.name for p in (tmp_path / "sweep" / "0").iterdir()) == [".hydra", "status.json"]
    assert summary[summary.status == "ok"]["throughput.output_tokens_per_s"].iloc[0] > 0
    assert "job 0 infeasible" in out.stderr and "1 jobs ran, 1 infeasible" in out.stderr


def test_a_sweep_where_nothing_ran_exits_2_and_leaves_nothing(tmp_path):
    out = sim(tmp_path, *SWEEP, "model=llama31_405b,llama31_70b", "hydra.sweep.dir=sweep")
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and len(lines) == 1 and "no job of the sweep ran" in lines[0]
    assert not (tmp_path / "sweep").exists()


def test_a_single_run_that_cannot_run_still_exits_2(tmp_path):
    assert_one_line_error(sim(tmp_path, "run", *SMALL, "model=llama31_405b", "hydra.run.dir=one"), "does not fit")
    assert_one_line_error(sim(tmp_path, "run", *SMALL, "resume=true"), "resume=true continues a sweep")
    assert list(tmp_path.iterdir()) == []


def test_a_killed_sweep_resumed_equals_an_uninterrupted_one(tmp_path):
    args = [*SWEEP, "seed=0,1,2"]
    assert sim(tmp_path, *args, "hydra.sweep.dir=whole").returncode == 0
    assert sim(tmp_path, *args, "hydra.sweep.dir=killed").returncode == 0
    killed = tmp_path / "killed"
    for name in ("status.json", "comparison.csv"):  # job 2 died before finishing
        (killed / "2" / name).unlink()
    (killed / "summary.parquet").unlink()
    before = {job: (killed / job / "status.json").stat().st_mtime_ns for job in ("0", "1")}
    out = sim(tmp_path, *args, "resume=true", "hydra.sweep.dir=killed")
    assert out.returncode == 0 and out.stderr.count("complete, skipped (resume=true)") == 2
    assert {job: (killed / job / "status.json").stat().st_mtime_ns for job in ("0", "1")} == before
    whole, resumed = (pd.read_parquet(tmp_path / d / "summary.parquet").drop(columns=["job_wall_time_s"])
                      for d in ("whole", "killed"))
    pd.testing.assert_frame_equal(whole.drop(columns=["resume"], errors="ignore"),
                                  resumed.drop(columns=["resume"], errors="ignore"))


def test_the_report_of_a_two_key_sweep_has_faceted_figures_and_a_self_contained_page(tmp_path):
    assert sim(tmp_path, *SWEEP, "block_size=8,32", "max_num_seqs=4,64", "hydra.sweep.dir=sweep").returncode == 0
    out = sim(tmp_path, "report", "run_dir=sweep")
    assert out.returncode == 0, out.stderr
    sweep = tmp_path / "sweep"
    figures = sorted(p.name for p in sweep.glob("sweep_*.png"))
    assert "sweep_throughput_output_tokens_per_s.png" in figures and len(figures) >= 6
    page = (sweep / "index.html").read_text()
    assert page.count("data:image/png;base64,") == len(figures) and "max_num_seqs" in page
    table = pd.read_csv(sweep / "sweep_summary.csv")
    assert len(table) == 4 and set(table.block_size) == {8, 32}
    assert json.loads((sweep / "0" / "status.json").read_text())["status"] == "ok"


def launcher_sweep(tmp_path, *launcher):
    out = sim(tmp_path, *SWEEP, *launcher, "model=llama31_405b,llama3_8b", "hydra.sweep.dir=sweep")
    assert out.returncode == 0, out.stderr
    summary = pd.read_parquet(tmp_path / "sweep" / "summary.parquet")
    assert summary.set_index("model").status.to_dict() == {"llama31_405b": "infeasible", "llama3_8b": "ok"}
    assert (tmp_path / "sweep" / "1" / "paged" / "metrics.json").is_file()


def test_a_sweep_on_a_local_ray_cluster(tmp_path):
    launcher_sweep(tmp_path, "hydra/launcher=ray", "+hydra.launcher.ray.init.num_cpus=2")


def test_a_sweep_through_submitit_as_on_slurm(tmp_path):
    launcher_sweep(tmp_path, "hydra/launcher=submitit_local")


def test_a_sweep_with_figures_dir_publishes_the_figures_it_names(tmp_path):
    out = sim(tmp_path, *SWEEP, "block_size=8,32", "hydra.sweep.dir=sweep", "figures_dir=docs/figs",
              "figures=[latency_s.ttft.p50,kv.waste_of_used]")
    assert out.returncode == 0, out.stderr
    published = sorted(p.name for p in (tmp_path / "docs" / "figs").iterdir())
    assert published == ["sweep_kv_waste_of_used.png", "sweep_latency_s_ttft_p50.png"]
    assert (tmp_path / "sweep" / "index.html").is_file() and "figures: 2 in" in out.stderr
    assert_one_line_error(sim(tmp_path, *SWEEP, "block_size=8,32", "figures_dir=f", "figures=[ttft]",
                              "hydra.sweep.dir=other"), "unknown figure metric 'ttft'")
    assert_one_line_error(sim(tmp_path, "run", *SMALL, "figures_dir=f"), "run with -m")
    assert_one_line_error(sim(tmp_path, "run", "-m", "+sweep=disaggregation", "seed=3", "figures=[bogus]",
                              "hydra.sweep.dir=other"), "unknown figure metric 'bogus'")
    assert not (tmp_path / "other").exists() and not (tmp_path / "f").exists()


def test_every_figure_in_the_docs_is_rebuilt_by_a_named_sweep():
    """docs/figures.md shows docs/figures/NAME/*.png; scenarios/sweep/NAME.yaml draws each."""
    import re
    from pathlib import Path

    from sim.staging import sweep_figures
    from tests.conftest import compose_config
    root = Path(__file__).resolve().parents[1]
    shown = set(re.findall(r"\(figures/([\w-]+/[\w.-]+\.png)\)", (root / "docs" / "figures.md").read_text()))
    rebuilt = set()
    for path in sorted((root / "scenarios" / "sweep").glob("*.yaml")):
        cfg = compose_config("run", [f"+sweep={path.stem}"])
        folder, metrics = sweep_figures(cfg, multirun=True)
        assert folder == (Path.cwd() / "docs" / "figures" / path.stem) and metrics
        rebuilt |= {f"{path.stem}/sweep_{m.replace('.', '_')}.png" for m in metrics}
    assert shown and shown <= rebuilt
    assert {str(p.relative_to(root / "docs" / "figures")) for p in (root / "docs" / "figures").rglob("*.png")} == rebuilt


def test_job_folders_of_an_earlier_larger_sweep_are_named_and_left_out_of_the_summary(tmp_path):
    assert sim(tmp_path, *SWEEP, "seed=0,1,2", "hydra.sweep.dir=sweep").returncode == 0
    out = sim(tmp_path, *SWEEP, "seed=5,6", "hydra.sweep.dir=sweep")
    assert out.returncode == 0 and "job folders 2 in" in out.stderr
    summary = pd.read_parquet(tmp_path / "sweep" / "summary.parquet")
    assert sorted(summary.seed) == [5, 6]
    report = sim(tmp_path, "report", "run_dir=sweep")   # a later report keeps to the last sweep
    assert report.returncode == 0, report.stderr
    assert sorted(pd.read_csv(tmp_path / "sweep" / "sweep_summary.csv").seed) == [5, 6]


def test_a_named_sweep_with_changed_results_leaves_the_docs_figures_alone(tmp_path):
    out = sim(tmp_path, "run", "-m", "+sweep=disaggregation", "scenario.num_requests=40", "hydra.sweep.dir=sweep")
    assert out.returncode == 0, out.stderr
    assert "left as it is" in out.stderr and "figures:" not in out.stderr and not (tmp_path / "docs").exists()
    assert (tmp_path / "sweep" / "index.html").is_file()   # the report is drawn in the sweep folder
