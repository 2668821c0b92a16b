"""The Hydra task functions behind each subcommand."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from sim.errors import ConfigError
from sim.models import model_from_config, resolve_kv_dtype
from sim.staging import final_dir, sweep_progress

GiB = 2**30
TRACE_SELECTED_ENV = "KVSIM_TRACE_SCENARIO_SELECTED"  # set by `python -m sim` when it chose it


def profile_line(latency_profile: dict) -> str:
    """Which GPU profile timed the run, and which of its operators are measured, imported or
    priors (the full sources: metrics.json's latency_profile, or `python -m calibration show`)."""
    kinds: dict[str, list[str]] = {}
    for op, source in latency_profile.get("operators", {}).items():
        kinds.setdefault(source.split(":", 1)[0], []).append(op)
    parts = "; ".join(f"{kind}: {', '.join(ops)}" for kind, ops in kinds.items())
    return (f"step times: gpu profile {latency_profile['gpu']} ({parts}); sources: "
            f"python -m calibration show gpu={latency_profile['gpu']}")


def loop_line(results) -> str:
    """Which simulation loop ran each allocator, how long it took, and why not the compiled one."""
    groups: dict[tuple, list[str]] = {}
    for r in results:
        engine = r.metrics["engine"]
        groups.setdefault((engine["loop"], engine.get("why")), []).append(
            f"{r.allocator} {r.metrics['wall_time_s']:.2f} s")
    return "simulation loop: " + "; ".join(
        f"{loop} for {', '.join(runs)}" + (f" ({why})" if why else "") for (loop, why), runs in groups.items())


def kv_pool_line(results) -> str:
    """Each replica's KV pool, in the token slots each allocator gets from it."""
    pools = results[0].metrics.get("disaggregation")
    if pools:
        return "kv pool per replica: " + "; ".join(
            f"{role} {pools[role]['kv_pool_bytes_per_replica'] / GiB:.1f} GiB, "
            f"{pools[role]['kv_pool_token_slots_per_replica']:,} token slots" for role in ("prefill", "decode"))
    slots = ", ".join(f"{r.allocator} {r.metrics['kv_pool']['token_slots_per_replica']:,}" for r in results)
    line = (f"kv pool per replica: {results[0].metrics['kv_pool']['bytes_per_replica'] / GiB:.1f} GiB, "
            f"token slots: {slots}")
    for r in results:
        tiers = r.metrics.get("kv_tiers")
        if tiers:
            found = ", ".join(f"{name} {t['hit_tokens']:,} ({t['loaded_bytes'] / 1e9:.1f} GB loaded)"
                              for name, t in tiers.items() if isinstance(t, dict))
            line += (f"\nkv tiers ({r.allocator}): prefix tokens found in {found}; steps waited "
                     f"{tiers['load_wait_s']:.2f} s of {tiers['load_transfer_s']:.2f} s of loads")
    return line


def run_task(cfg: DictConfig) -> None:
    """Simulate the scenario once per allocator; write results, plots and comparison.csv."""
    from sim.report import format_serving, format_table, plot_run, run_title
    from sim.results import write_run
    from sim.run import run_all
    from sim.unserved import unserved_warnings

    out_dir = Path(HydraConfig.get().runtime.output_dir)
    if cfg.task == "sharing":
        return sharing_task(cfg, out_dir)
    if cfg.task == "kv_axes":
        return kv_axes_task(cfg, out_dir)
    if cfg.task != "compare":
        raise ConfigError(f"unknown task '{cfg.task}', key task, use compare, sharing or kv_axes")
    check_keys_are_read(cfg, HydraConfig.get().runtime.choices)
    results = run_all(cfg, show_progress=cfg.progress and not cfg.quiet)
    if cfg.enable_prefix_caching and "paged" in cfg.allocators:
        print(f"note: enable_prefix_caching=true runs paged as prefix: allocators="
              f"[{','.join(cfg.allocators)}] ran {', '.join(r.allocator for r in results)}",
              file=sys.stderr)
    if os.environ.pop(TRACE_SELECTED_ENV, None):
        print("note: trace.* keys given without a scenario: ran scenario=trace", file=sys.stderr)
    detected = results[0].metrics["workload"]["trace_format"]
    # scenario=trace reads the top-level trace.* keys; a trace scenario (sharegpt) its own scenario.*
    prefix, spec = ("trace", cfg.scenario.trace) if "trace" in cfg.scenario else ("scenario", cfg.scenario)
    if detected and spec.get("format") == "auto":
        print(f"note: {prefix}.format=auto read {spec.path} as {detected}", file=sys.stderr)
    for line in unserved_warnings(results, cfg):
        print(line, file=sys.stderr)
    title = run_title(cfg, HydraConfig.get())
    for result in results:
        result.metrics["run_title"] = title
    comparison = write_run(out_dir, results, cfg)
    if cfg.plots:
        plot_run(comparison, {r.allocator: r.timeline for r in results},
                 {r.allocator: r.requests for r in results}, out_dir, title)
    if not cfg.quiet:
        print(title)
        print(format_table(comparison))
        print(format_serving(comparison))
        print(kv_pool_line(results))
        print(loop_line(results))
        pools = results[0].metrics.get("disaggregation")
        for role, profile in ([(f"{role} pool ", pools[role]["latency_profile"]) for role in ("prefill", "decode")]
                              if pools else [("", results[0].metrics["latency_profile"])]):
            print(role + profile_line(profile))
        print(f"results: {final_dir(out_dir)}")
    progress = sweep_progress(out_dir)
    if progress and cfg.progress:
        print(progress, file=sys.stderr)


def capacity_task(cfg: DictConfig) -> None:
    """Search, per allocator, the highest rate (or fewest replicas) that meets the SLOs; write
    capacity.json (and one per allocator folder), capacity.csv and capacity.png."""
    import pandas as pd

    from sim.capacity_search import CapacitySpec, offered_rate_rps, plot_search, run_search
    from sim.report import run_title
    from sim.results import write_csv, write_json
    from sim.run import build_workload, prepare
    from sim.workload.overlength import truncate_overlength

    out_dir = Path(HydraConfig.get().runtime.output_dir)
    check_keys_are_read(cfg, HydraConfig.get().runtime.choices, command="capacity")
    spec = CapacitySpec(**OmegaConf.to_container(cfg.capacity, resolve=True))
    if cfg.disaggregation.enabled:
        raise ConfigError("python -m sim capacity does not search disaggregated pools yet, key "
                          "disaggregation.enabled, run it colocated or sweep rates with python -m sim run -m")
    setup = prepare(cfg)
    if not setup.spec.slo.targets:
        raise ConfigError("python -m sim capacity needs at least one SLO target, key slo.ttft_s, "
                          "give e.g. slo.ttft_s=2 (or slo.tpot_s, slo.e2e_s)")
    workload = build_workload(cfg, setup.spec.seed)
    if setup.spec.on_overlength == "truncate":
        workload = truncate_overlength(workload, setup.spec.max_model_len)
    if spec.search == "rate" and math.isinf(offered_rate_rps(workload)):
        raise ConfigError("capacity.search=rate scales the arrival rate, but every request arrives at once, "
                          "key capacity.search, give the scenario a finite rate (e.g. scenario.request_rate=10) "
                          "or use capacity.search=replicas")
    if os.environ.pop(TRACE_SELECTED_ENV, None):
        print("note: trace.* keys given without a scenario: ran scenario=trace", file=sys.stderr)
    title = run_title(cfg, HydraConfig.get(), replicas="searched" if spec.search == "replicas" else None)
    slots = setup.pool.context_tokens
    print(f"{title}\nkv pool per replica: {setup.pool.pool_bytes / GiB:.1f} GiB, {slots:,} token slots "
          f"(paged; contiguous: {setup.pool.num_token_slots:,})", file=sys.stderr)
    results, rows = {}, []
    for allocator in setup.allocator_configs:
        result, steps = run_search(setup, workload, allocator, spec, cfg.router, cfg.queue_order)
        results[allocator], rows = result, rows + steps
        warn_thin_answer(allocator, steps)
    slo = dataclasses.asdict(setup.spec.slo)
    for allocator, result in results.items():
        (out_dir / allocator).mkdir(parents=True, exist_ok=True)
        write_json(out_dir / allocator / "capacity.json", {"search": spec.search, "slo": slo, **result})
    summary = {"search": spec.search, "slo": slo, "by_allocator": results}
    if len(results) == 1:
        summary.update(next(iter(results.values())))
    write_json(out_dir / "capacity.json", summary)
    write_csv(out_dir / "capacity.csv", pd.DataFrame(rows))
    if cfg.plots:
        plot_search(rows, results, out_dir / "capacity.png", title, spec.search)
    if not cfg.quiet:
        print(capacity_lines(results, spec.search))
        print(f"results: {final_dir(out_dir)}")


THIN_ANSWER_REQUESTS = 200  # fewer measured requests than this at the answer: said on stderr


def warn_thin_answer(allocator: str, steps: list[dict]) -> None:
    """Say when the step that decided the answer measured few requests (a burst, not a load)."""
    met = [row for row in steps if row["met"]]  # the last one met is the answer (the search closes on it)
    if met and met[-1]["num_measured_requests"] < THIN_ANSWER_REQUESTS:
        print(f"note: {allocator}'s answer rests on {met[-1]['num_measured_requests']} measured requests, "
              f"a burst rather than a steady load; more sessions or requests (scenario.*) give a steadier "
              f"one", file=sys.stderr)


def capacity_lines(results: dict, search: str) -> str:
    lines = []
    for allocator, r in results.items():
        if search == "rate":
            found = (f"max_rate_rps {r['max_rate_rps']:.3f} (x{r['max_rate_scale']:.4g} the workload's "
                     f"{r['base_rate_rps']:.3f} req/s)" if r["max_rate_scale"] else
                     f"no rate tried meets the SLOs, down to {r['first_missed_rate_rps']:.4g} req/s: "
                     + ("the percentiles stopped falling with the rate, so the targets are below what a "
                        "lightly loaded replica gives (see the last steps)" if r.get("unreachable") else
                        "the targets may be below what a lightly loaded replica gives (see the last step)"))
            if not r["bracketed"] and r["max_rate_scale"]:
                found += f"; not bracketed within capacity.max_steps={r['num_steps']}: raise it"
        else:
            found = (f"min_replicas {r['min_replicas']} ({r['min_gpus']} GPUs) at {r['rate_rps']:.3f} req/s"
                     if r["min_replicas"] else "no replica count tried meets the SLOs (raise capacity.max_replicas)")
        lines.append(f"{allocator}: {found}, {r['num_steps']} simulations")
    return "\n".join(lines)


def user_keys() -> list[tuple[str, str]]:
    """(override, its dotted key) for each key=value the user gave this command."""
    return [(o, o.lstrip("+~").split("=", 1)[0]) for o in HydraConfig.get().overrides.task]


def check_keys_are_read(cfg: DictConfig, choices, command: str = "run") -> None:
    """A key the user set that nothing in this run reads is an error, not silently ignored."""
    scenario = choices.get("scenario")
    allocators = set(cfg.allocators) | ({"prefix"} if cfg.enable_prefix_caching else set())
    from sim.staging import sweep_job_dir
    in_sweep, given = sweep_job_dir() is not None, {key for _, key in user_keys()}
    for override, key in user_keys():
        if key == "cluster.num_replicas" and cfg.disaggregation.enabled:
            raise ConfigError(f"cluster.num_replicas is not read with disaggregation.enabled=true, override "
                              f"'{override}', use disaggregation.prefill_replicas and disaggregation.decode_replicas")
        if key.startswith("capacity.") and command != "capacity":
            raise ConfigError(f"python -m sim {command} does not read {key}, override '{override}', "
                              f"use python -m sim capacity (or drop it)")
        if override.startswith("+") and key.split(".")[0] not in OPEN_NODES:
            raise ConfigError(f"{key} is not a key of python -m sim run, override '{override}', "
                              f"drop it (python -m sim run --help lists the keys)")
        if key.startswith("trace.") and key not in READ_BY_EVERY_SCENARIO and scenario != "trace":
            raise ConfigError(f"{key} is set but scenario={scenario} reads no trace, override "
                              f"'{override}', add scenario=trace or drop the trace.* keys")
        unread = unread_because(cfg, key, given if in_sweep else set(), command)
        if unread:
            raise ConfigError(f"{key} is not read: {unread}, override '{override}', drop it")
        if key.startswith("allocator_options."):
            name = key.split(".")[1]
            if name not in allocators:
                raise ConfigError(f"{key} is set but {name} is not in allocators="
                                  f"[{','.join(cfg.allocators)}], override '{override}', "
                                  f"add {name} to allocators or drop the option")


def unread_because(cfg: DictConfig, key: str, switches_given: set = frozenset(), command: str = "run") -> str | None:
    """Why nothing in this run reads key (a setting of something switched off), or None. In a
    sweep, a key whose switch the command line also sets is kept: the switch may be swept."""
    from hydra.utils import get_class

    from sim.kvcache.tiers import TIER_SIZE_KEYS, tiers_enabled
    from sim.slo import TARGETS
    offload, sizes = cfg.kv_offload, {f"kv_offload.{size}" for size in TIER_SIZE_KEYS}
    targets = {f"slo.{name}_s" for name in TARGETS}
    if key.startswith("disaggregation.") and key != "disaggregation.enabled" and not cfg.disaggregation.enabled \
            and "disaggregation.enabled" not in switches_given:
        return "disaggregation.enabled is false"
    if key.startswith("kv_offload.") and key not in sizes and not tiers_enabled(offload) and not sizes & switches_given:
        return "no KV tier is on (kv_offload.cpu_gib, disk_gib and shared_gib are 0)"
    if key == "kv_offload.pool_cpu" and offload.pool_cpu and not offload.cpu_gib and "kv_offload.cpu_gib" not in switches_given:
        return "kv_offload.cpu_gib is 0, so there is no CPU memory to pool"
    if key == "slo.percentile" and all(cfg.slo[t.split(".")[1]] is None for t in targets) and not targets & switches_given:
        return "no SLO target is set (slo.ttft_s, slo.tpot_s, slo.e2e_s)"
    if key == "capacity.max_replicas" and cfg.capacity.search != "replicas" and "capacity.search" not in switches_given:
        return "capacity.search=rate keeps the replica count (capacity.search=replicas reads it)"
    if key == "capacity.tolerance" and cfg.capacity.search == "replicas" and "capacity.search" not in switches_given:
        return "capacity.search=replicas bisects whole replica counts"
    if key == "expert_tokens_cv" and not cfg.enable_expert_parallel and "enable_expert_parallel" not in switches_given:
        return "enable_expert_parallel is false (a MoE GPU then holds a slice of every expert, and no GPU is busiest)"
    if key == "figures" and cfg.figures_dir is None and "figures_dir" not in switches_given:
        return "figures_dir is not set (figures name what a sweep copies there)"
    if key == "cluster.router_staleness_s" and cfg.cluster.router_staleness_s and "router" not in switches_given \
            and not getattr(get_class(cfg.router._target_), "reads_replica_state", True):
        return f"the router ({cfg.router._target_.rsplit('.', 1)[-1]}) reads no replica state"
    replica_search = command == "capacity" and cfg.capacity.search == "replicas"  # tries 1, 2, 4, ... replicas
    if key == "router" and cfg.cluster.num_replicas == 1 and not cfg.disaggregation.enabled and not replica_search \
            and not {"cluster.num_replicas", "disaggregation.enabled", "capacity.search"} & switches_given:
        return "cluster.num_replicas is 1 (a router chooses among replicas)"
    if key == "swap_space" and cfg.preemption_mode != "swap" and "preemption_mode" not in switches_given:
        return f"preemption_mode is {cfg.preemption_mode} (swap_space is the CPU memory a swap preemption moves KV to)"
    if key == "scenario.burstiness" and str(cfg.scenario.get("request_rate")) == "inf" \
            and "scenario.request_rate" not in switches_given:
        return "scenario.request_rate is inf (every request arrives at once: there are no gaps to shape)"
    return None


READ_BY_EVERY_SCENARIO = {"trace.on_overlength"}
# Nodes whose keys are free-form (checked where they are used) or groups added with +NAME=...
OPEN_NODES = {"allocator_options", "scenario", "model", "sharing", "kv_axes", "experiment", "sweep", "hydra"}
TRACE_STATS_KEYS = {"scenario", "trace", "block_size", "seed", "format", "model"}


def sharing_task(cfg: DictConfig, out_dir: Path) -> None:
    """The block-sharing study of parallel sampling and beam search; writes sharing.csv."""
    from sim.results import write_csv
    from sim.sharing import run_sharing_study, sharing_spec

    if cfg.sharing is None:
        raise ConfigError("task=sharing needs the sharing study's parameters, key sharing, "
                          "run python -m sim run +experiment=sharing")
    spec = sharing_spec(OmegaConf.to_container(cfg.sharing, resolve=True))
    table = run_sharing_study(spec, cfg.block_size, cfg.seed)
    write_csv(out_dir / "sharing.csv", table)
    if not cfg.quiet:
        print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        print(f"results: {out_dir / 'sharing.csv'}")


def kv_axes_task(cfg: DictConfig, out_dir: Path) -> None:
    """The KV-shrinking axes on one model (sim.kv_axes); writes kv_axes.csv and kv_axes.png."""
    from sim.kv_axes import plot_kv_axes, run_kv_axes
    from sim.results import write_csv
    from sim.run import build_workload, prepare, simulate

    def simulate_run(vcfg, workload, label):
        setup = prepare(vcfg)
        result = simulate(setup, workload, "paged", vcfg.router)
        if not cfg.quiet:
            print(f"  {label}: {result.metrics['wall_time_s']:.1f} s", file=sys.stderr)
        return setup, result

    def compose_workload(overrides):
        from hydra import compose
        given = [o for o, _ in user_keys()]
        return compose(config_name="run", overrides=[*given, *overrides])

    table = run_kv_axes(cfg, compose_workload, lambda wcfg: build_workload(wcfg, wcfg.seed), simulate_run)
    write_csv(out_dir / "kv_axes.csv", table)
    plot_kv_axes(table, out_dir / "kv_axes.png")
    if not cfg.quiet:
        print(table.to_string(index=False, float_format=lambda v: f"{v:,.4g}"))
        print(f"results: {final_dir(out_dir)}/kv_axes.csv, kv_axes.png")


def kv_task(cfg: DictConfig) -> None:
    """A model's KV bytes per token at `tokens` and the cache the engine allocates for `batch`
    sequences, per layer kind (sim.kv_layout); compare=[...] prints a row per model."""
    from sim.kv_report import kv_report, print_kv_compare, print_kv_report
    from sim.models import model_by_name

    if cfg.tokens < 0 or cfg.batch < 1 or cfg.tensor_parallel_size < 1 or cfg.block_size < 1:
        raise ConfigError("tokens must be >= 0, batch, block_size and tensor_parallel_size >= 1, "
                          "command line, fix tokens=, batch=, block_size= or tensor_parallel_size=")
    if cfg.format not in ("text", "json"):
        raise ConfigError(f"unknown format '{cfg.format}', key format, use text or json")
    models = [model_by_name(name) for name in cfg.compare] or [model_from_config(cfg.model)]
    reports = [kv_report(model, cfg.tokens, cfg.batch, cfg.block_size, cfg.tensor_parallel_size,
                         resolve_kv_dtype(model, cfg.kv_cache_dtype), cfg.kv_cache_dtype)
               for model in models]
    if cfg.format == "json":
        print(json.dumps(reports if cfg.compare else reports[0]))
    elif cfg.compare:
        print_kv_compare(reports)
    else:
        print_kv_report(reports[0])


def validate_task(cfg: DictConfig) -> None:
    """Simulate published engine results (validation/published.csv); write the comparison."""
    import tempfile
    import time

    from hydra import compose

    from sim import validation
    from sim.models import load_model
    from sim.run import run_all

    frame = validation.read_published(Path(cfg.path) if cfg.path else validation.default_path())
    if cfg.rows:
        unknown = sorted(set(cfg.rows) - set(frame.id))
        if unknown:
            raise ConfigError(f"unknown row id(s) {', '.join(unknown)}, key rows, use ids of the published file "
                              f"(R001 ... {frame.id.iloc[-1]})")
        frame = frame[frame.id.isin(list(cfg.rows))]
    elif cfg.quick:
        frame = frame[frame.id.isin(validation.QUICK_ROWS)]

    def simulate(overrides):
        started = time.perf_counter()
        metrics = run_all(compose(config_name="run", overrides=overrides))[0].metrics
        print(f"  {' '.join(o for o in overrides if not o.startswith(('plots', 'quiet', 'progress')))}: "
              f"{time.perf_counter() - started:.1f} s", file=sys.stderr)
        return metrics

    table = validation.run_rows(frame, simulate, lambda name: load_model(name).max_position_embeddings or 0,
                                validation.QUICK_MAX_PROMPTS if cfg.quick else None)
    summary = validation.summarize(table, quick=bool(cfg.quick and not cfg.rows))
    out_dir = Path(cfg.out_dir)
    if summary.quick and cfg.out_dir == "results/validation":  # never over a full run's results
        out_dir = out_dir / "quick"
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".partial-") as staging:
        staged = Path(staging)
        table.to_csv(staged / "validation.csv", index=False)
        (staged / "validation.md").write_text(validation.markdown(table, summary))
        validation.plot(table, summary, staged / "validation.png")
        for name in ("validation.csv", "validation.md", "validation.png"):
            os.replace(staged / name, out_dir / name)
    shown = table[["id", "engine", "gpu", "model", "metric", "published", "kvsim", "ratio", "status"]]
    print(shown.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    for line in summary.lines():
        print(line)
    print(f"results: {out_dir}/validation.csv, validation.md, validation.png")


def report_task(cfg: DictConfig) -> None:
    """Redraw plots and write the memory breakdown CSV of a finished run."""
    from sim.report import report

    written = report(Path(cfg.run_dir))
    print("wrote " + ", ".join(str(p) for p in written))


def trace_stats_task(cfg: DictConfig) -> None:
    """Statistics of a trace (trace.path=...) or of a scenario (scenario=NAME)."""
    from sim.workload.stats import scenario_stats, trace_stats
    from sim.workload.trace import TraceSpec

    if cfg.format not in ("text", "json"):
        raise ConfigError(f"unknown format '{cfg.format}', key format, use text or json")
    if cfg.seed < 0:
        raise ConfigError(f"seed={cfg.seed} is negative, key seed, use 0 or a positive integer")
    for override, key in user_keys():  # run keys are accepted, not read here
        if key.split(".")[0] not in TRACE_STATS_KEYS:
            raise ConfigError(f"trace-stats does not read {key}, override '{override}', "
                              f"use {', '.join(sorted(TRACE_STATS_KEYS))} (or python -m sim run)")
        if key.startswith("trace.") and cfg.scenario is not None:
            raise ConfigError(f"{key} is set but trace-stats describes scenario="
                              f"{HydraConfig.get().runtime.choices.get('scenario')}, override "
                              f"'{override}', drop scenario= to describe the trace")
    if cfg.scenario is not None:
        from sim.run import build_workload
        name = HydraConfig.get().runtime.choices.get("scenario")
        workload = build_workload(cfg, cfg.seed)
        stats = scenario_stats(workload, cfg.block_size, name)
    else:
        stats = trace_stats(TraceSpec(**OmegaConf.to_container(cfg.trace, resolve=True)), cfg.seed)
    if cfg.format == "json":
        print(json.dumps(stats))
        return
    print(f"source: {stats['format']}")
    print(f"requests: {stats['num_requests']:,}  sessions: {stats['num_sessions']:,}  "
          f"duration: {stats['duration_s']:.1f} s  rate: {stats['arrival_rate_rps']:.3f} req/s")
    for kind in ("input", "output"):
        print(f"{kind} tokens: mean {stats[f'mean_{kind}_tokens']:.1f}  p50 {stats[f'p50_{kind}_tokens']:.0f}  "
              f"p99 {stats[f'p99_{kind}_tokens']:.0f}")
    print(f"ideal prefix hit rate: {stats['ideal_prefix_hit_rate']:.4f} "
          f"(infinite cache, {stats['block_size']}-token blocks)")
    if stats["num_skipped_records"] or stats["num_failed_requests"]:
        print(f"skipped records: {stats['num_skipped_records']}  failed requests: {stats['num_failed_requests']}")
