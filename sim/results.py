"""Writing a run's files: temporary names first, renamed last, so that a failed run never
leaves a metrics.json or comparison.csv that looks complete."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from sim.metrics import flatten

COMPARISON_FILE = "comparison.csv"


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def write_json(path: Path, data: dict) -> None:
    _atomic(path, lambda tmp: tmp.write_text(json.dumps(_nan_as_null(data), indent=2) + "\n"))


def _nan_as_null(value):
    """A statistic of nothing (sim.metrics.NO_DATA, NaN) is written as null; an infinite rate (all
    requests at once) stays Infinity, as before."""
    if isinstance(value, dict):
        return {k: _nan_as_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_nan_as_null(v) for v in value]
    return None if isinstance(value, float) and math.isnan(value) else value


def write_parquet(path: Path, frame: pd.DataFrame) -> None:
    _atomic(path, lambda tmp: frame.to_parquet(tmp, index=False))


def write_csv(path: Path, frame: pd.DataFrame) -> None:
    _atomic(path, lambda tmp: frame.to_csv(tmp, index=False))


def comparison_frame(results) -> pd.DataFrame:
    rows = [{"allocator": r.allocator, **flatten(r.metrics)} for r in results]
    return pd.DataFrame(rows)


def write_run(out_dir: Path, results, cfg) -> pd.DataFrame:
    """Per allocator: metrics.json, requests.parquet, timeline.parquet, config.yaml; then
    comparison.csv, last."""
    resolved = OmegaConf.to_container(cfg, resolve=True)
    staged = []
    for result in results:
        folder = out_dir / result.allocator
        folder.mkdir(parents=True, exist_ok=True)
        write_parquet(folder / "requests.parquet", result.requests)
        write_parquet(folder / "timeline.parquet", result.timeline)
        config = dict(resolved, allocator=dict(result.allocator_config, name=result.allocator))
        _atomic(folder / "config.yaml", lambda tmp, c=config: tmp.write_text(OmegaConf.to_yaml(c)))
        staged.append((folder / "metrics.json", result.metrics))
    for path, metrics in staged:
        write_json(path, metrics)
    comparison = comparison_frame(results)
    write_csv(out_dir / COMPARISON_FILE, comparison)
    return comparison
