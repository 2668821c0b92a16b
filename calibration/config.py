"""Config schemas of `python -m calibration` (registered by its CLI before composing)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from sim.config import register_schemas as register_sim_schemas


@dataclass
class CalibrationRunConfig:
    grid: Any = MISSING
    name: Optional[str] = None     # profile name; default: derived from the detected GPU
    out_dir: str = "results/calibration"
    warmup_ms: int = 25
    rep_ms: int = 100
    device: str = "cuda"           # cpu: a dry run under TRITON_INTERPRET=1 with wall-clock timing
    backend: str = "triton"        # torch: time the torch reference operators (real CPU timings with device=cpu)


@dataclass
class CalibrationFitConfig:
    raw: str = MISSING
    name: str = MISSING
    base: Optional[str] = None     # datasheet profile to start from; default: name
    out_dir: str = "results/calibration"


@dataclass
class CalibrationImportConfig:
    path: Any = MISSING            # a folder of Vidur CSVs, or a list of folders
    name: str = MISSING
    base: Optional[str] = None
    out_dir: str = "results/calibration"


@dataclass
class CalibrationPredictConfig:
    gpu: str = MISSING
    shapes: str = MISSING
    out: str = MISSING


@dataclass
class CalibrationShowConfig:
    gpu: str = MISSING


def register_schemas() -> None:
    register_sim_schemas()
    store = ConfigStore.instance()
    store.store(name="calibration_run_schema", node=CalibrationRunConfig)
    store.store(name="calibration_fit_schema", node=CalibrationFitConfig)
    store.store(name="calibration_import_schema", node=CalibrationImportConfig)
    store.store(name="calibration_predict_schema", node=CalibrationPredictConfig)
    store.store(name="calibration_show_schema", node=CalibrationShowConfig)
