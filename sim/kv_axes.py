"""The KV-shrinking axes on one model and the same GPUs (`python -m sim run +experiment=kv_axes`).

Each variant changes only the model's KV fields (heads, latent width, shared layers, layer kinds)
and keeps the base model's weights and parameter count, so what moves is the KV cache: bytes per
token, how many sequences fit, and what the serving numbers become. Each runs in BF16 and FP8 KV on
each workload with the paged allocator (vLLM's hybrid manager for the sliding-window and the
compressed variants). A variant whose layers the simulator does not model (state layers) would get
its memory figures from sim.kv_layout and no serving figures, and the run says so.
"""
from __future__ import annotations

import sys

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from sim.errors import ConfigError
from sim.models import ModelSpec, model_from_config, resolve_kv_dtype

COLUMNS = ("workload", "variant", "kv_dtype", "simulated", "kv_bytes_per_token", "kv_bytes_per_token_stored_across_tp",
           "kv_bytes_per_sequence_at_mean_length", "kv_pool_gib", "sequences_that_fit_at_mean_length",
           "mean_running_sequences", "output_tokens_per_s", "tpot_p50_ms", "ttft_p50_s", "num_preemptions",
           "mean_sequence_tokens")


def variant_cfg(cfg: DictConfig, model_fields: dict, kv_dtype: str) -> DictConfig:
    """A workload's run config with the variant's model fields and the KV dtype."""
    cfg = cfg.copy()
    with_model = OmegaConf.to_container(cfg.model, resolve=True)
    with_model.update(model_fields)
    OmegaConf.set_struct(cfg, False)
    cfg.model = with_model
    cfg.kv_cache_dtype = kv_dtype
    cfg.allocators = ["paged"]
    return cfg


def _memory_row(model: ModelSpec, kv_dtype: str, tensor_parallel_size: int, mean_tokens: float) -> dict:
    tokens = max(int(round(mean_tokens)), 1)
    per_sequence = sum(u.allocated_bytes for u in model.kv_usage(tokens, 1, 16, kv_dtype))
    per_token = model.kv_bytes_per_token(kv_dtype)
    return {"kv_bytes_per_token": per_token,
            "kv_bytes_per_token_stored_across_tp": per_token * model.kv_replication(tensor_parallel_size),
            "kv_bytes_per_sequence_at_mean_length": per_sequence * model.kv_replication(tensor_parallel_size)}


def mean_sequence_tokens(workload, max_model_len: int) -> float:
    """Mean prompt + output tokens per request (capped at max_model_len, as sequences are)."""
    requests = [r for session in workload.sessions for r in session.turns]
    return sum(min(r.prompt_len + r.output_len, max_model_len) for r in requests) / max(len(requests), 1)


def run_kv_axes(cfg: DictConfig, compose_workload, build_workload, simulate_run) -> pd.DataFrame:
    """One row per workload x variant x KV dtype. compose_workload(overrides) -> the run config
    with a workload's overrides; build_workload(cfg) -> its requests (built once per workload:
    the variants change the model only); simulate_run(cfg, workload, label) -> (Setup, RunResult)."""
    spec = cfg.kv_axes
    if spec is None:
        raise ConfigError("task=kv_axes needs the experiment's parameters, key kv_axes, "
                          "run python -m sim run +experiment=kv_axes")
    rows, skipped = [], []
    for workload_name, overrides in spec.workloads.items():
        wcfg = compose_workload(list(overrides))
        workload = build_workload(wcfg)
        mean_tokens = mean_sequence_tokens(workload, wcfg.max_model_len)
        for variant, fields in spec.variants.items():
            for kv_dtype in spec.kv_dtypes:
                vcfg = variant_cfg(wcfg, OmegaConf.to_container(fields, resolve=True) or {}, kv_dtype)
                model = model_from_config(vcfg.model)
                dtype = resolve_kv_dtype(model, kv_dtype)
                row = {"workload": workload_name, "variant": variant, "kv_dtype": dtype}
                if not model.untimed_layers:
                    setup, result = simulate_run(vcfg, workload, f"{workload_name}/{variant}/{dtype}")
                    row.update(_memory_row(model, dtype, setup.spec.tensor_parallel_size, mean_tokens))
                    m = result.metrics
                    row.update(simulated=True, kv_pool_gib=setup.pool.pool_bytes / 2**30,
                               sequences_that_fit_at_mean_length=int(setup.pool.pool_bytes
                                                                     // row["kv_bytes_per_sequence_at_mean_length"]),
                               mean_running_sequences=m["scheduler"]["mean_batch_size"],
                               output_tokens_per_s=m["throughput"]["output_tokens_per_s"],
                               tpot_p50_ms=1000 * m["latency_s"]["tpot"]["p50"],
                               ttft_p50_s=m["latency_s"]["ttft"]["p50"],
                               num_preemptions=m["scheduler"]["num_preemptions"],
                               mean_sequence_tokens=mean_tokens)
                else:
                    skipped.append(f"{workload_name}/{variant}/{dtype}")
                    row.update(simulated=False, mean_sequence_tokens=mean_tokens,
                               **_memory_row(model, dtype, int(vcfg.tensor_parallel_size), mean_tokens))
                rows.append(row)
    if skipped:
        print(f"note: {len(skipped)} variant runs not simulated (layer kinds the simulator does not model yet, "
              f"python -m sim kv prices them; memory columns only): {', '.join(skipped)}", file=sys.stderr)
    return pd.DataFrame(rows, columns=list(COLUMNS))


def plot_kv_axes(table: pd.DataFrame, path) -> None:
    """KV bytes per token (stored across TP, log scale) against output throughput, per workload."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(table.workload))
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.5), squeeze=False)
    for ax, name in zip(axes[0], workloads):
        part = table[(table.workload == name) & table.simulated.astype(bool)]
        for dtype, marker in (("bf16", "o"), ("fp8", "s")):
            rows = part[part.kv_dtype == dtype]
            ax.scatter(rows.kv_bytes_per_token_stored_across_tp, rows.output_tokens_per_s, marker=marker,
                       label=f"KV {dtype}")
            for _, r in rows.iterrows():
                ax.annotate(r.variant, (r.kv_bytes_per_token_stored_across_tp, r.output_tokens_per_s),
                            fontsize=7, xytext=(3, 3), textcoords="offset points")
        for _, r in table[(table.workload == name) & ~table.simulated.astype(bool) & (table.kv_dtype == "bf16")].iterrows():
            ax.axvline(r.kv_bytes_per_token_stored_across_tp, color="grey", linestyle=":", linewidth=1)
            ax.annotate(f"{r.variant} (bf16, not simulated)", (r.kv_bytes_per_token_stored_across_tp, 0.02),
                        xycoords=("data", "axes fraction"), rotation=90, fontsize=7, color="grey")
        ax.set_xscale("log")
        ax.set_xlabel("KV bytes per token, stored across the TP group")
        ax.set_ylabel("output tokens per second (paged)")
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
