"""Shared fixtures: compose the Hydra config as the CLI would, without running Hydra's app."""
import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from calibration.config import register_schemas  # the simulator's schemas and calibration's


def compose_config(config_name: str, overrides: list[str]):
    register_schemas()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="scenarios", version_base="1.3"):
            return compose(config_name=config_name, overrides=overrides)
    finally:
        GlobalHydra.instance().clear()


@pytest.fixture
def run_config():
    def make(*overrides: str):
        return compose_config("run", ["+experiment=golden", *overrides])
    return make
