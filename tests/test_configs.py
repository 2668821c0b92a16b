"""Every shipped config composes, and every option of every group builds its runtime object."""
from importlib import resources
from pathlib import Path

import pytest

from sim.errors import ConfigError
from sim.models import model_from_config
from sim.run import build_workload, prepare
from tests.conftest import compose_config


def options(group: str) -> list[str]:
    folder = resources.files("scenarios") / group
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


@pytest.mark.parametrize("name", ["run", "kv", "report"])
def test_primary_configs_compose(name):
    overrides = ["run_dir=x"] if name == "report" else []
    assert compose_config(name, overrides) is not None


def test_main_job_defaults_follow_the_issue():
    cfg = compose_config("run", [])
    # rag_agents on a long-context model: 32,768 tokens lie within Llama-3.1's 131,072 window.
    assert cfg.model.name == "llama31_70b" and cfg.gpu == "h100"
    assert cfg.model.max_position_embeddings == 131072
    assert cfg.tensor_parallel_size == 4 and cfg.cluster.num_replicas == 2
    assert cfg.max_model_len == 32768 and list(cfg.allocators) == ["contiguous", "paged", "prefix"]
    assert cfg.scheduler_reserve_full_isl is True and cfg.watermark == 0.0
    assert cfg.measure.warmup_s > 0 and cfg.measure.exclude_drain is True
    assert cfg.router._target_.endswith("LeastLoaded")


@pytest.mark.parametrize("model", options("model"))
def test_every_model_option_prepares(model):
    extra = [f"model.hf_config={Path(__file__).parent / 'data' / 'hf' / 'llama3_70b.json'}"] if model == "hf" else []
    tp = 16 if model == "deepseek_v4_pro" else 8  # 1.6T parameters counted FP8 (its FP4 experts are not a dtype here)
    cfg = compose_config("run", [f"model={model}", *extra, "gpu=h200", f"tensor_parallel_size={tp}",
                                 "max_model_len=4096"])
    spec = model_from_config(cfg.model)
    if any(g.kind in ("sliding", "chunked", "compressed", "state") for g in spec.layer_groups):  # hybrid manager
        cfg.allocators = ["paged"]
    assert prepare(cfg).pool.num_blocks > 0


@pytest.mark.parametrize("scenario", options("scenario"))
def test_every_scenario_option_generates(scenario):
    extra = ["trace.path=sample:mooncake", "trace.max_requests=50"] if scenario == "trace" else []
    cfg = compose_config("run", [f"scenario={scenario}", *extra])
    assert build_workload(cfg, 0).num_requests > 0


@pytest.mark.parametrize("experiment", options("experiment"))
def test_every_experiment_composes(experiment):
    assert compose_config("run", [f"+experiment={experiment}"]) is not None


def test_vllm_knob_names_are_top_level_keys():
    cfg = compose_config("run", ["block_size=32", "max_num_seqs=8", "max_num_batched_tokens=512",
                                 "gpu_memory_utilization=0.8", "enable_prefix_caching=true",
                                 "enable_chunked_prefill=false", "kv_cache_dtype=fp8",
                                 "max_model_len=512", "tensor_parallel_size=8"])
    setup = prepare(cfg)
    assert setup.pool.block_size == 32 and setup.kv_dtype == "fp8"
    assert list(setup.allocator_configs) == ["contiguous", "prefix"]   # paged became prefix


@pytest.mark.parametrize("group", ["router", "queue_order"])
def test_every_router_and_queue_order_option_builds(group):
    from hydra.utils import instantiate
    for option in options(group):
        cfg = compose_config("run", [f"{group}={option}"])
        policy = instantiate(cfg[group])
        assert callable(policy) if group == "router" else hasattr(policy, "victim"), option
