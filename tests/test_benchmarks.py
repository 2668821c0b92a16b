"""The speed benchmarks run in their quick mode, to check that they work (never timed here)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

import bench_suite  # noqa: E402


def test_quick_benchmarks_run_and_report_every_figure(capsys):
    rows = bench_suite.main(["--quick", "vidur_matched", "rag_agents_100k"])
    assert [(r["benchmark"], r["allocator"]) for r in rows] == [
        ("vidur_matched", "paged"), ("rag_agents_100k", "prefix"), ("rag_agents_100k", "paged")]
    assert rows[0]["requests"] == 1000                       # trace.max_requests=1000, all served
    for row in rows:
        assert row["wall_s"] > 0 and row["peak_rss_mb"] > 0 and row["tokens"] > row["requests"]
        assert row["steps"] > 0 and row["events"] > 0
    # every one runs in the compiled loop, which handles each step as an event of its own
    assert [r["loop"] for r in rows] == ["compiled", "compiled", "compiled"]
    assert all(r["events"] >= r["steps"] for r in rows)
    printed = capsys.readouterr().out
    assert "events/s" in printed and printed.count("\n") == 6
    assert "vidur_matched ran on TP 2 x PP 2" in printed
    [ratio] = [line for line in printed.splitlines() if "prefix/paged" in line]
    expected = rows[1]["wall_s"] / rows[2]["wall_s"]
    assert f"= {expected:.2f}x (medians of 1 and 1 runs" in ratio


def test_the_ratio_line_takes_medians_of_each_allocators_runs():
    rows = [{"benchmark": "b", "size": "1k", "allocator": a, "wall_s": w}
            for a, w in (("prefix", 3.0), ("paged", 1.0), ("prefix", 9.0), ("paged", 2.0), ("prefix", 3.3),
                         ("paged", 2.2))]
    rows.append({"benchmark": "b", "size": "2k", "allocator": "paged", "wall_s": 1.0})  # no prefix run: no line
    [line] = bench_suite.prefix_over_paged(rows)
    assert line == ("  b 1k: prefix/paged = 3.30 s / 2.00 s = 1.65x (medians of 3 and 3 runs; "
                    "target at most 1.5x)")
