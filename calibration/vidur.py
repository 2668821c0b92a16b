"""Vidur's public A100 operator profiles (microsoft/vidur, MIT; Agrawal et al., MLSys 2024) in
our raw format. Their compute files (`<gpu>__<model>.csv`, mlp.csv) hold GEMM and elementwise
timings: the four GEMMs per layer become `gemm` rows, shapes per
../shared/calibration_data/SOURCE.md:

    attn_pre_proj   K = n_embd,              N = (n_head + 2 n_kv_head) hd / TP
    attn_post_proj  K = n_head hd / TP,      N = n_embd
    mlp_up_proj     K = n_embd,              N = (2 if gated else 1) n_expanded_embd / TP
    mlp_down_proj   K = n_expanded_embd / TP, N = n_embd

Their `attention.csv` (FlashAttention per layer and GPU, Kineto) becomes `attention_decode` rows
(batch_size sequences of kv_cache_size cached tokens) and `attention_prefill` rows (a chunk of
prefill_chunk_size tokens after kv_cache_size cached ones), heads per GPU = heads / TP. Their
`cpu_overheads.csv` (Sarathi-Serve's per-step host times) becomes `cpu_step` rows: the medians of
schedule, prepare inputs, sampler and output processing, summed, per batch size. Their
`all_reduce.csv` and `send_recv.csv` (torch.distributed, `size` in bytes) become `all_reduce` and
`send_recv` rows from GPUs of one node whose topology is known: the 2-GPU all-reduces (NVLink) and
the intra-node send/recv; the 4-GPU all-reduces (a pairwise-NVLink node, not a full NVSwitch one,
see ../shared/calibration_data/SOURCE.md), the all-gathers and the inter-node send/recv are named
as left out.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from calibration.raw import RawError

GEMMS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
NEEDED = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "use_gated_mlp", "num_tokens",
          "num_tensor_parallel_workers")


def gpu_of(path: Path) -> str:
    """The GPU a Vidur file was measured on, from its name (`<gpu>__<model>.csv`) or its folder
    (`data/profiling/compute/<gpu>/<model>/mlp.csv`); 'unknown' when neither says."""
    if "__" in path.stem:
        return path.stem.split("__")[0]
    parts = path.parts
    if "compute" in parts and parts.index("compute") + 1 < len(parts) - 1:
        return parts[parts.index("compute") + 1]
    return "unknown"


def _read(path: Path, needed: tuple[str, ...], what: str) -> pd.DataFrame:
    """A Vidur CSV with the columns needed, or a one-line error naming the file."""
    try:
        frame = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise RawError(f"unreadable Vidur CSV ({str(exc).splitlines()[0]}), {path}, give {what}") from None
    missing = [c for c in needed if c not in frame.columns]
    if missing:
        raise RawError(f"missing column(s) {', '.join(missing[:3])}, {path}:1, give {what}")
    return frame


def _shapes(row) -> dict[str, tuple[int, int]]:
    tp = int(row.num_tensor_parallel_workers)
    hd = int(row.n_embd) // int(row.n_head)
    gated = str(row.use_gated_mlp).strip().lower() in ("true", "1")
    return {
        "attn_pre_proj": ((int(row.n_head) + 2 * int(row.n_kv_head)) * hd // tp, int(row.n_embd)),
        "attn_post_proj": (int(row.n_embd), int(row.n_head) * hd // tp),
        "mlp_up_proj": ((2 if gated else 1) * int(row.n_expanded_embd) // tp, int(row.n_embd)),
        "mlp_down_proj": (int(row.n_embd), int(row.n_expanded_embd) // tp),
    }


def import_file(path: Path) -> list[dict]:
    frame = _read(path, NEEDED + tuple(f"time_stats.{g}.median" for g in GEMMS),
                  "Vidur's data/profiling/compute/<gpu>/<model>/mlp.csv")
    model = path.stem.split("__")[-1]
    gpu = gpu_of(path)
    rows = []
    incomplete = frame[list(NEEDED + tuple(f"time_stats.{g}.{s}" for g in GEMMS
                                           for s in ("min", "max", "median", "std")))].isna().any(axis=1)
    if incomplete.any():
        line = int(incomplete.to_numpy().argmax()) + 2  # 1-based, after the header
        raise RawError(f"incomplete row (empty values), {path}:{line}, "
                       f"give Vidur's whole data/profiling/compute/<gpu>/<model>/mlp.csv")
    for index, row in enumerate(frame.itertuples(index=False)):
        shapes = _shapes(row)
        for gemm in GEMMS:
            n, k = shapes[gemm]
            stat = {s: float(frame.at[index, f"time_stats.{gemm}.{s}"]) / 1e3  # ms -> s
                    for s in ("min", "max", "median", "std")}
            rows.append({"op": "gemm", "m": int(row.num_tokens), "n": n, "k": k,
                         "tp": int(row.num_tensor_parallel_workers), "dtype": "fp16",
                         "time_s": stat["median"], "time_s_min": stat["min"],
                         "time_s_max": stat["max"], "time_s_std": stat["std"],
                         "source": f"vidur:{model}:{gemm}", "gpu": gpu})
    return rows


ATTENTION_NEEDED = ("n_embd", "n_q_head", "n_kv_head", "num_tensor_parallel_workers", "batch_size",
                    "prefill_chunk_size", "kv_cache_size", "is_prefill", "time_stats.attn_decode.median",
                    "time_stats.attn_prefill.median")


def import_attention(path: Path, gpu: str) -> list[dict]:
    """Vidur's attention.csv -> attention_decode and attention_prefill rows (seconds)."""
    frame = _read(path, ATTENTION_NEEDED, "Vidur's data/profiling/<gpu>/attention.csv")
    rows = []
    for line, row in enumerate(frame.to_dict("records"), start=2):
        tp = int(row["num_tensor_parallel_workers"])
        prefill = str(row["is_prefill"]).strip().lower() == "true"
        median = row["time_stats.attn_prefill.median" if prefill else "time_stats.attn_decode.median"]
        if median != median:  # NaN
            raise RawError(f"row without its {'prefill' if prefill else 'decode'} time, {path}:{line}, "
                           f"give Vidur's whole attention.csv")
        shape = {"num_q_heads": int(row["n_q_head"]) // tp, "num_kv_heads": int(row["n_kv_head"]) // tp,
                 "head_dim": int(row["n_embd"]) // int(row["n_q_head"]), "dtype": "fp16",
                 "context_len": int(row["kv_cache_size"])}
        if prefill:
            shape.update(op="attention_prefill", chunk_len=int(row["prefill_chunk_size"]),
                         batch_size=int(row["batch_size"]))
        else:
            shape.update(op="attention_decode", batch_size=int(row["batch_size"]))
        rows.append({**shape, "tp": tp, "time_s": float(median) / 1e3, "source": "vidur:attention", "gpu": gpu})
    return rows


CPU_PARTS = {"cpu_step": ("schedule", "prepare_inputs_e2e", "sampler_e2e"),
             "cpu_output": ("process_model_outputs",)}


def import_cpu_overheads(path: Path, gpu: str) -> list[dict]:
    """Vidur's cpu_overheads.csv -> cpu_step rows (schedule + prepare inputs + sampler) and
    cpu_output rows (process outputs), seconds per engine step, by batch size."""
    needed = ("model_name", "batch_size", "tensor_parallel_degree") + tuple(
        f"{p}_median" for parts in CPU_PARTS.values() for p in parts)
    frame = _read(path, needed, "Vidur's data/profiling/<gpu>/cpu_overheads.csv")
    rows = []
    for line, row in enumerate(frame.to_dict("records"), start=2):
        for op, parts in CPU_PARTS.items():
            values = [row[f"{p}_median"] for p in parts]
            if any(value != value for value in values):  # NaN
                raise RawError(f"row without its CPU times, {path}:{line}, give Vidur's whole cpu_overheads.csv")
            rows.append({"op": op, "batch_size": int(row["batch_size"]),
                         "tp": int(row["tensor_parallel_degree"]), "time_s": sum(values) / 1e3,
                         "source": f"vidur:cpu_overheads:{row['model_name']}", "gpu": gpu})
    return rows


def import_collectives(path: Path, gpu: str) -> tuple[list[dict], str]:
    """Vidur's all_reduce.csv or send_recv.csv -> rows of one node's NVLink (seconds), and what
    was left out."""
    op = "all_reduce" if path.name == "all_reduce.csv" else "send_recv"
    frame = _read(path, (f"time_stats.{op}.median", "num_workers", "size", "collective", "devices_per_node"),
                  f"Vidur's data/profiling/<gpu>/{path.name}")
    rows, left = [], 0
    for line, row in enumerate(frame.to_dict("records"), start=2):
        if row["collective"] != op:
            left += 1
            continue
        workers, per_node = int(row["num_workers"]), int(row["devices_per_node"])
        if per_node != workers or (op == "all_reduce" and workers != 2):
            left += 1
            continue
        median = row[f"time_stats.{op}.median"]
        if median != median:  # NaN
            raise RawError(f"row without its {op} time, {path}:{line}, give Vidur's whole {path.name}")
        shape = {"bytes": int(row["size"])} | ({"num_gpus": workers} if op == "all_reduce" else {})
        rows.append({"op": op, **shape, "time_s": float(median) / 1e3, "source": f"vidur:{op}", "gpu": gpu})
    return rows, f"{path.name}: {left} rows of other collectives or topologies"


def import_directory(folder: Path) -> list[dict]:
    """Every Vidur file of a folder this importer knows; the others are named as skipped."""
    if not folder.is_dir():
        raise RawError(f"no such directory '{folder}', key path, give the folder of Vidur CSVs "
                       f"(e.g. ../shared/calibration_data/vidur_a100)")
    files = sorted(folder.glob("*.csv"))
    if not files:
        raise RawError(f"no CSV files in '{folder}', key path, give the folder of Vidur CSVs")
    rows, skipped = [], []
    gpu = folder.name.split("_")[1] if "_" in folder.name else "unknown"
    for path in files:
        if path.name == "attention.csv":
            rows.extend(import_attention(path, gpu))
        elif path.name == "cpu_overheads.csv":
            rows.extend(import_cpu_overheads(path, gpu))
        elif path.name in ("all_reduce.csv", "send_recv.csv"):
            collective, left_out = import_collectives(path, gpu)
            rows.extend(collective)
            skipped.append(left_out)
        else:
            rows.extend(import_file(path))
    if skipped:
        print(f"not imported from {folder}: {', '.join(skipped)}")
    return rows
