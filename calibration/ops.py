"""Work models of the benchmarked operators: FLOPs, bytes, the size axis and the shape class
of a raw row (torch-free; used by the fit and by predict)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from sim.latency.calibrated import DTYPE_BYTES, gemm_class, gemm_work

MLA_LATENT, MLA_ROPE = 512, 64  # DeepSeek-V3's cached widths (REFERENCE.md section 1)


def _i(row, name) -> int:
    return int(row[name])


def _decode_work(row, context):
    s = DTYPE_BYTES[row["dtype"]]
    batch, heads, kv_heads, hd = (_i(row, c) for c in ("batch", "heads", "kv_heads", "head_dim"))
    return 4.0 * batch * heads * hd * context, 2.0 * batch * context * kv_heads * hd * s


def _mla_work(row, context):
    s = DTYPE_BYTES[row["dtype"]]
    batch, heads = _i(row, "batch"), _i(row, "heads")
    width = MLA_LATENT + MLA_ROPE
    return 2.0 * batch * heads * (width + MLA_LATENT) * context, float(batch * context * width * s)


def _prefill_work(row, q):
    s = DTYPE_BYTES[row["dtype"]]
    batch, heads, kv_heads, hd, c = (_i(row, x) for x in ("batch", "heads", "kv_heads", "head_dim", "context"))
    flops = 4.0 * batch * heads * hd * q * (c + (q + 1) / 2)
    return flops, batch * ((c + q) * 2 * kv_heads * hd + 2 * q * heads * hd) * s


@dataclass(frozen=True, slots=True)
class OpModel:
    size_column: str
    class_columns: tuple[str, ...]
    work: Callable  # (row, size) -> (FLOPs, bytes)
    bandwidth: str = "hbm"  # or "host"


OPS = {
    "gemm": OpModel("m", ("n", "k", "dtype"), lambda r, m: gemm_work(m, float(r["n"]), float(r["k"]), r["dtype"])),
    "paged_decode": OpModel("context", ("batch", "heads", "kv_heads", "head_dim", "block_size", "num_splits", "dtype"),
                            _decode_work),
    "contiguous_decode": OpModel("context", ("batch", "heads", "kv_heads", "head_dim", "dtype"), _decode_work),
    "mla_decode": OpModel("context", ("batch", "heads", "block_size", "dtype"), _mla_work),
    "prefill": OpModel("num_tokens", ("batch", "heads", "kv_heads", "head_dim", "context", "dtype"), _prefill_work),
    "kv_copy": OpModel("bytes", ("dtype",), lambda r, b: (0.0, float(b))),
    "stream": OpModel("bytes", ("kind",), lambda r, b: (0.0, float(b))),
    "host_copy": OpModel("bytes", ("pinned",), lambda r, b: (0.0, float(b)), bandwidth="host"),
}


def shape_class(op: str, row) -> str:
    if op == "gemm":
        return gemm_class(float(row["n"]), float(row["k"]), row["dtype"])
    return ",".join(f"{c}={row[c]}" for c in OPS[op].class_columns)
