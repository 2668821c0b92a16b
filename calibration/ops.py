"""The benchmarked kernels as operators: each raw row's size axis, shape class and work, from
the operator catalogue's work models (sim.latency.operators; torch-free). Rows of the catalogue's
own operators (gemm, attention_decode, attention_prefill, all_reduce) come from imported public
timings and from `predict`; the Triton benchmarks write the kernel names below, whose attention
rows the fit reads as the catalogue's (to_catalogue)."""
from __future__ import annotations

from sim.latency.operators import (CATALOGUE, Operator, attention_decode_work, attention_prefill_work,
                                   kv_bytes_per_token)
from sim.models import DTYPE_BYTES

MLA_LATENT, MLA_ROPE = 512, 64  # DeepSeek-V3's cached widths (REFERENCE.md section 1)


def _i(row, name) -> int:
    return int(row[name])


def _decode(row, context):
    batch, heads, kv_heads, hd = (_i(row, c) for c in ("batch", "heads", "kv_heads", "head_dim"))
    return attention_decode_work(batch, batch * context, heads, hd, hd, kv_bytes_per_token(kv_heads, hd, row["dtype"]))


def _mla(row, context):
    batch, heads = _i(row, "batch"), _i(row, "heads")
    width = MLA_LATENT + MLA_ROPE
    return attention_decode_work(batch, batch * context, heads, width, MLA_LATENT,
                                 width * DTYPE_BYTES[row["dtype"]])


def _prefill(row, q):
    batch, heads, kv_heads, hd, c = (_i(row, x) for x in ("batch", "heads", "kv_heads", "head_dim", "context"))
    return attention_prefill_work(batch, batch * q * c, batch * q * (q + 1) / 2, batch * (c + q), batch * q,
                                  heads, hd, hd, kv_bytes_per_token(kv_heads, hd, row["dtype"]))


def _copy(row, nbytes):
    return 0.0, float(nbytes)


def _kernel(size_column: str, class_columns: tuple[str, ...], work, bandwidth: str = "hbm") -> Operator:
    return Operator(
        (size_column, *class_columns), lambda r: float(r[size_column]),
        lambda r: ",".join(f"{c}={r[c]}" for c in class_columns), work,
        lambda r: float(r[size_column]), (1024, 2048), size_column, peak="compute" if work is not _copy else "none",
        bandwidth=bandwidth)


KERNELS = {
    "paged_decode": _kernel("context", ("batch", "heads", "kv_heads", "head_dim", "block_size", "num_splits",
                                        "dtype"), _decode),
    "contiguous_decode": _kernel("context", ("batch", "heads", "kv_heads", "head_dim", "dtype"), _decode),
    "mla_decode": _kernel("context", ("batch", "heads", "block_size", "dtype"), _mla),
    "prefill": _kernel("num_tokens", ("batch", "heads", "kv_heads", "head_dim", "context", "dtype"), _prefill),
    "stream": _kernel("bytes", ("kind",), _copy),
}
OPS: dict[str, Operator] = {**CATALOGUE, **KERNELS}

# Kernel rows the fit reads as catalogue operators: (catalogue op, catalogue column <- raw column)
AS_CATALOGUE = {
    "paged_decode": ("attention_decode", {"batch_size": "batch", "context_len": "context", "num_q_heads": "heads",
                                          "num_kv_heads": "kv_heads", "head_dim": "head_dim", "dtype": "dtype"}),
    "prefill": ("attention_prefill", {"batch_size": "batch", "chunk_len": "num_tokens", "context_len": "context",
                                      "num_q_heads": "heads", "num_kv_heads": "kv_heads", "head_dim": "head_dim",
                                      "dtype": "dtype"}),
}
