"""`python -m sim validate`: every row of validation/published.csv (a published result of a real
engine) simulated as that benchmark ran, and kvsim / published per row.

A row is run as `scenario=bench` (fixed lengths) or `scenario=sharegpt` with the row's model,
GPU profile, precision, parallelism, engine limits and load; its metric is read from the run's
vllm_bench block. A row whose GPUs hold several engines (`num_gpus` over TP x PP x DP: MLPerf's
systems of eight GPUs) runs them as replicas with requests dealt round-robin, and its metric is the
system's. A row whose metric is set by the offered load while the engines keep up (`set_by_load`:
a Server run's throughput) is counted apart in the summary. A benchmark that drives the engine
in-process (`harness`: trtllm-bench, gptSessionBenchmark, vLLM's offline benchmarks) pays no HTTP
serving overhead; TensorRT-LLM's rows run its default capacity policy
(capacity_scheduler_policy=guaranteed_no_evict). Rows kvsim cannot run (a feature it does not
model) are kept with their reason and count as misses; the rows check the model and never train it
(no factor is fitted to them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from sim.errors import ConfigError, KvsimError

DEFAULT_PATH = Path(__file__).resolve().parent.parent / "validation" / "published.csv"  # in a clone


def default_path() -> Path:
    """The project's published.csv: beside the sources in a clone (or an editable install), else
    under the current directory (a plain install does not carry it)."""
    return DEFAULT_PATH if DEFAULT_PATH.is_file() else Path("validation") / "published.csv"
WITHIN = 0.20  # a row within 20% of the published value counts as a hit
QUICK_ROWS = ("R018", "R023", "R066", "R077")  # small runs, one per kind of metric
QUICK_MAX_PROMPTS = 16
COLUMNS = ("id", "engine", "num_gpus", "gpu", "model", "quantization", "kv_cache_dtype", "tensor_parallel_size",
           "pipeline_parallel_size", "data_parallel_size", "enable_expert_parallel", "harness",
           "async_output_processing", "async_scheduling", "speculative_method", "num_speculative_tokens",
           "acceptance_length",
           "dataset", "input_len", "output_len", "num_prompts", "max_concurrency",
           "request_rate", "max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
           "gpu_memory_utilization", "metric",
           "set_by_load", "value", "unit", "run",
           "not_run_reason", "caveat", "known_gap", "source_url")
# metric -> (vllm_bench key, divide by the GPU count)
METRICS = {"output_throughput": ("output_throughput", False),
           "output_throughput_per_gpu": ("output_throughput", True),
           "total_throughput": ("total_token_throughput", False),
           "request_throughput": ("request_throughput", False),
           "ttft_mean": ("mean_ttft_ms", False), "ttft_median": ("median_ttft_ms", False),
           "tpot_mean": ("mean_tpot_ms", False), "tpot_median": ("median_tpot_ms", False),
           "itl_median": ("median_itl_ms", False), "e2e_mean": ("mean_e2el_ms", False),
           "e2e_median": ("median_e2el_ms", False)}


def read_published(path: Path) -> pd.DataFrame:
    """The rows, or one line saying what is wrong with the file."""
    if not path.is_file():
        raise ConfigError(f"no such file '{path}', key path, give path=<a clone of kvsim>/validation/published.csv "
                          f"(the package install does not carry it) or a file like it")
    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    except (pd.errors.ParserError, UnicodeDecodeError) as exc:
        raise ConfigError(f"unreadable CSV ({str(exc).splitlines()[0]}), {path}, fix the file") from None
    missing = [c for c in COLUMNS if c not in frame.columns]
    if missing:
        raise ConfigError(f"missing column(s) {', '.join(missing)}, {path}:1, keep the published.csv header")
    for line, row in enumerate(frame.to_dict("records"), start=2):
        if row["run"] == "yes" and row["metric"] not in METRICS:
            raise ConfigError(f"unknown metric '{row['metric']}', {path}:{line}, use one of: {', '.join(METRICS)}")
        if row["enable_chunked_prefill"] not in ("", "true", "false"):
            raise ConfigError(f"enable_chunked_prefill '{row['enable_chunked_prefill']}', {path}:{line}, "
                              f"use true, false or leave it empty (kvsim's default, chunked)")
    return frame


# ShareGPT rows replay vLLM's own sample: benchmark_serving.py's seed-0 draw from
# ShareGPT_V3_unfiltered_cleaned_split.json (first human turn as the prompt, first answer's length
# as the output; pairs under 4, prompts over 1,024 or pairs over 2,048 tokens skipped), Llama-3
# tokenizer, as one saved result published its first 200 (sim/workload/samples/LICENSES.md). A
# row of more prompts runs those 200 and says so in its caveat.
SHAREGPT_V3_SAMPLE, SHAREGPT_V3_REQUESTS = "sharegpt_v3", 200
# vLLM <= 0.5 served HTTP from the engine's process: seconds a running request a step. vLLM's
# v0.6.0 blog (2024-09-05) profiled Llama-3-8B on one H100 in 0.5.3: API server 33% of the time,
# GPU 38%; kvsim's GPU step of that model at 256 sequences (vLLM's max_num_seqs) of 450 tokens is
# 15.1 ms, so 0.33 / 0.38 x 15.1 ms / 256 (tests/test_validation.py recomputes it).
VLLM05_API_SERVER_PER_SEQ_S = 51e-6


def _optional(value: str) -> str:
    return value if value else "null"


def overrides(row: dict, native_window: int, max_prompts: int | None = None) -> list[str]:
    """The `python -m sim run` keys that replay the row's benchmark."""
    prompts = int(row["num_prompts"])
    if max_prompts:
        prompts = min(prompts, max_prompts)
    keys = [f"model={row['model']}", f"gpu={row['gpu']}", f"tensor_parallel_size={row['tensor_parallel_size']}",
            f"quantization={_optional(row['quantization'])}", f"kv_cache_dtype={row['kv_cache_dtype']}",
            f"max_num_seqs={row['max_num_seqs']}", f"gpu_memory_utilization={row['gpu_memory_utilization']}",
            "allocators=[paged]", f"cluster.num_replicas={engines(row)}", "plots=false", "quiet=true",
            "progress=false"]
    if engines(row) > 1:  # one system of several engines (MLPerf): its harness deals the queries out
        keys.append("router=round_robin")
    if row["pipeline_parallel_size"] not in ("", "1"):
        keys.append(f"pipeline_parallel_size={row['pipeline_parallel_size']}")
    if row["data_parallel_size"] not in ("", "1"):  # attention ranks (TensorRT-LLM's enable_attention_dp)
        keys.append(f"data_parallel_size={row['data_parallel_size']}")
    if row["enable_expert_parallel"] == "true":
        keys.append("enable_expert_parallel=true")
    if row["speculative_method"]:  # the source's drafts and their measured acceptance
        keys += [f"speculative_config.method={row['speculative_method']}",
                 f"speculative_config.num_speculative_tokens={row['num_speculative_tokens']}",
                 f"speculative_config.acceptance_length={row['acceptance_length']}"]
    if row["max_num_batched_tokens"]:  # the source's token budget per step (per rank)
        keys.append(f"max_num_batched_tokens={row['max_num_batched_tokens']}")
    if row["enable_chunked_prefill"] == "false":  # trtllm-bench's default: a prompt's prefill in one step
        keys.append("enable_chunked_prefill=false")
    if row["engine"] == "TensorRT-LLM":  # its default capacity policy (SchedulerConfig): never preempts
        keys.append("capacity_scheduler_policy=guaranteed_no_evict")
    if row["harness"] == "in-process":  # trtllm-bench, gptSessionBenchmark, vLLM's offline benchmarks
        keys.append("serving_overhead_s=0")
    if row["async_output_processing"] == "false":  # vLLM before 0.6 (PR #7049)
        keys.append("async_output_processing=false")
        if row["harness"] == "http":  # its OpenAI server ran in the engine's process until 0.6 (PR #6883)
            keys.append(f"api_server_per_seq_s={VLLM05_API_SERVER_PER_SEQ_S}")
    if row["async_scheduling"] == "true":  # TensorRT-LLM >= 0.20's PyTorch flow, SGLang >= 0.4, vLLM >= 0.14
        keys.append("async_scheduling=true")
    if row["dataset"] == "sharegpt":  # vLLM's seed-0 sample, as far as published (SHAREGPT_V3_REQUESTS)
        return ["scenario=sharegpt", *keys, f"scenario.path=sample:{SHAREGPT_V3_SAMPLE}",
                f"scenario.max_requests={min(prompts, SHAREGPT_V3_REQUESTS)}",
                "scenario.arrival_rate_rps=1e9", "max_model_len=null"]
    total = int(row["input_len"]) + int(row["output_len"])
    # An in-process benchmark sizes its engine to the dataset (trtllm-bench's max_seq_len); a server
    # keeps the model's window unless the requests need more. (Every sequence's length, and so the
    # result, is the same either way; only the pool's fit check reads max_model_len.)
    sized = row["harness"] == "in-process" or total > native_window
    return ["scenario=bench", *keys, f"scenario.input_len={row['input_len']}",
            f"scenario.output_len={row['output_len']}", f"scenario.num_prompts={prompts}",
            f"scenario.max_concurrency={_optional(row['max_concurrency'])}",
            f"scenario.request_rate={row['request_rate'] or 'inf'}",
            f"max_model_len={total if sized else 'null'}"]


def gpus_per_engine(row: dict) -> int:
    return (int(row["tensor_parallel_size"]) * int(row["pipeline_parallel_size"] or 1)
            * int(row["data_parallel_size"] or 1))


def engines(row: dict) -> int:
    """The engines (kvsim replicas) on the row's GPUs: one unless the source ran several."""
    return max(1, int(row["num_gpus"] or 0) // gpus_per_engine(row))


def metric_value(metrics: dict, row: dict) -> float:
    key, per_gpu = METRICS[row["metric"]]
    value = float(metrics["vllm_bench"][key])
    if per_gpu:
        value /= gpus_per_engine(row) * engines(row)
    return value


@dataclass(frozen=True)
class Summary:
    num_rows: int
    num_run: int
    num_within: int
    median_abs_error: float
    worst: str
    quick: bool = False
    within_set_by_load: tuple[str, ...] = ()  # rows within whose metric the offered load sets

    def lines(self) -> list[str]:
        if self.quick:
            return [f"quick: {self.num_rows} rows with at most {QUICK_MAX_PROMPTS} prompts each check that the "
                    f"suite runs, not its figures ({self.num_within} within {WITHIN:.0%}, median absolute "
                    f"error {self.median_abs_error:.1%}); python -m sim validate runs every row in full"]
        by_load = self.within_set_by_load
        apart = (f"; {self.num_within - len(by_load)} without the {len(by_load)} whose metric the offered load "
                 f"sets while the engines keep up, {', '.join(by_load)}" if by_load else "")
        return [f"rows: {self.num_rows} published results, {self.num_run} run, "
                f"{self.num_within} within {WITHIN:.0%} ({self.num_within / self.num_rows:.0%} of all rows; "
                f"target 90%{apart})",
                f"median absolute error of the rows run: {self.median_abs_error:.1%} (target 10%)",
                f"worst: {self.worst}"]


def summarize(table: pd.DataFrame, quick: bool = False) -> Summary:
    ran = table[table.status != "not run"]
    errors = ran.error.abs().fillna(math.inf)  # a run that measured nothing is the worst of misses
    worst = ran.loc[errors.idxmax()] if len(ran) else None
    by_load = ran[(errors <= WITHIN) & ran.set_by_load]
    return Summary(len(table), len(ran), int((errors <= WITHIN).sum()),
                   float(errors.median()) if len(ran) else math.nan,
                   f"{worst.id} {worst.metric} kvsim/published {worst.ratio:.2f}" if worst is not None else "none",
                   quick, tuple(by_load.id))


def status(row: dict, error: float | None) -> tuple[str, str]:
    """(status, explanation) of one row: not run, within, or a miss with what kvsim does not model
    for it (known_gap) and the source's caveats."""
    if error is None:
        return "not run", row["not_run_reason"]
    explanation = "; ".join(part for part in (row.get("known_gap", ""), row["caveat"]) if part)
    if math.isnan(error):
        return "miss", "; ".join(part for part in ("kvsim's run measured nothing for this metric (no request "
                                                   "served in its window)", explanation) if part)
    if abs(error) <= WITHIN:
        return "within", explanation
    return "miss", explanation or "unexplained (see docs/validation.md)"


def run_rows(frame: pd.DataFrame, simulate, native_window, max_prompts: int | None) -> pd.DataFrame:
    """simulate(overrides) -> metrics.json dict; one output row per published row."""
    out = []
    for row in frame.to_dict("records"):
        kvsim, error = None, None
        if row["run"] == "yes":
            try:
                metrics = simulate(overrides(row, native_window(row["model"]), max_prompts))
            except KvsimError as exc:  # say which row the keys came from
                raise ConfigError(f"row {row['id']} of the published file: {exc}") from None
            kvsim = metric_value(metrics, row)
            error = kvsim / float(row["value"]) - 1
        state, why = status(row, error)
        out.append({"id": row["id"], "engine": row["engine"], "gpu": row["gpu"], "model": row["model"],
                    "tp": _parallelism(row), "lengths": _lengths(row), "load": _load(row),
                    "metric": row["metric"], "unit": row["unit"], "published": float(row["value"]),
                    "kvsim": kvsim if kvsim is not None else math.nan,
                    "ratio": kvsim / float(row["value"]) if kvsim is not None else math.nan,
                    "error": error if error is not None else math.nan, "status": state, "explanation": why,
                    "source_url": row["source_url"], "set_by_load": row["set_by_load"] == "true"})
    return pd.DataFrame(out)


def _parallelism(row: dict) -> str:
    """TP, with DP ranks, PP stages and engines where the row has them (TP 1 DP 8: `1 dp8`)."""
    text = row["tensor_parallel_size"]
    for key, label in (("data_parallel_size", "dp"), ("pipeline_parallel_size", "pp")):
        if row[key] not in ("", "1"):
            text += f" {label}{row[key]}"
    return text + (f" x{engines(row)}" if engines(row) > 1 else "")


def _lengths(row: dict) -> str:
    if row["dataset"] == "sharegpt":
        return "sharegpt"
    means = "" if row["dataset"] == "fixed" else f" ({row['dataset']} means)"
    return f"{row['input_len']}/{row['output_len']}{means}"


def _load(row: dict) -> str:
    if row["max_concurrency"]:
        return f"conc {row['max_concurrency']}"
    rate = row["request_rate"] or "inf"
    return f"{row['num_prompts']} at once" if rate == "inf" else f"{rate} req/s"


def markdown(table: pd.DataFrame, summary: Summary) -> str:
    header = ("| id | engine | GPU | model | TP (dp: ranks, pp: stages, xN: engines) | in/out | load | metric | "
              "published | kvsim | kvsim/published | status |")
    lines = [header, "|" + "---|" * 12]
    for r in table.to_dict("records"):
        kvsim = "" if math.isnan(r["kvsim"]) else f"{r['kvsim']:.4g}"
        ratio = "" if math.isnan(r["ratio"]) else f"{r['ratio']:.2f}"
        lines.append(f"| [{r['id']}]({r['source_url']}) | {r['engine']} | {r['gpu']} | {r['model']} | {r['tp']} | "
                     f"{r['lengths']} | {r['load']} | {r['metric']} ({r['unit']}) | {r['published']:.4g} | {kvsim} | "
                     f"{ratio} | {r['status']} |")
    misses = [f"- {r['id']} (kvsim/published {r['ratio']:.2f}): {r['explanation']}"
              for r in table.to_dict("records") if r["status"] == "miss"]
    return "\n".join(["\n".join(f"- {line}" for line in summary.lines()), "", *lines,
                      *(["", "Misses and what kvsim does not model for them (or the source leaves open):", "", *misses]
                        if misses else [])]) + "\n"


def plot(table: pd.DataFrame, summary: Summary, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ran = table[table.status != "not run"].reset_index(drop=True)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.22 * len(ran) + 2), 4.2))
    colors = np.where(ran.error.abs() <= WITHIN, "tab:green", "tab:red")
    ax.bar(range(len(ran)), ran.ratio, color=colors)
    ax.axhline(1.0, color="black", lw=0.8)
    for bound in (1 - WITHIN, 1 + WITHIN):
        ax.axhline(bound, color="grey", lw=0.6, ls="--")
    ax.set_yscale("log")
    ax.set_xticks(range(len(ran)), ran.id, rotation=90, fontsize=7)
    ax.set_ylabel("kvsim / published")
    ax.set_title(f"{summary.num_within} of {summary.num_rows} rows within {WITHIN:.0%}; "
                 f"median |error| {summary.median_abs_error:.1%}; {summary.num_rows - summary.num_run} not run",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
