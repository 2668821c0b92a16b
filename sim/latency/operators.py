"""The operator catalogue: each operator's work defined once, for the fit, for
`python -m calibration predict` and for the simulator (torch-free).

An operator's work is (FLOPs, bytes, sequences, causal FLOPs): sim.latency.calibrated times it as

    t = t0 + per_seq_s * sequences + max(FLOPs / (peak e_c) + causal FLOPs / (peak e_causal),
                                         bytes / (bandwidth e_m))

Attention is per GPU and per layer. Decode reads every cached token of every sequence and
computes each query head's scores and weighted values over it; a prefill chunk of q new tokens
after c cached ones attends to q * c context pairs and q (q + 1) / 2 causal pairs, of which
FlashAttention computes q (q + 128) / 2 (the diagonal's tiles whole), the latter with their own
efficiency (the few thread blocks of a short chunk). A ring all-reduce
moves 2 (n - 1) / n of the message per GPU over one direction of its link, a send/recv between
pipeline stages the message once. The CPU's share of an
engine step has no FLOPs or bytes: t0 + per_seq_s * sequences in the batch, for the critical
part (cpu_step: schedule, prepare inputs, sample) and for processing the outputs (cpu_output:
detokenise, build responses), which engines with asynchronous output processing overlap with
the next step's GPU work.

`CATALOGUE` gives each operator's shape columns (as predict reads them; head counts per GPU),
its correction axis, its shape class and the split its extrapolation is judged on.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

from sim.models import DTYPE_BYTES

ACTIVATION_BYTES = 2  # bf16 queries and outputs
CAUSAL_TILE = 128     # FlashAttention-2's query/key tile for head dim 128 (Dao, 2023)

Work = tuple  # (flops, nbytes) or (flops, nbytes, num_seqs, causal_flops)


def gemm_work(m: float, n: float, k: float, dtype: str) -> Work:
    """An (m x k) @ (k x n) GEMM; fp8 inputs write a 16-bit output."""
    size = DTYPE_BYTES[dtype]
    return 2.0 * m * n * k, (m * k + k * n) * size + m * n * max(size, 2)


def attention_decode_work(num_seqs: float, context_tokens: float, q_heads: float, qk_dim: float,
                          v_dim: float, kv_bytes_per_token: float) -> Work:
    """Decode attention of num_seqs sequences holding context_tokens cached tokens in all."""
    return (2.0 * q_heads * (qk_dim + v_dim) * context_tokens, context_tokens * kv_bytes_per_token,
            num_seqs, 0.0)


def attention_prefill_work(num_chunks: float, context_pairs: float, causal_pairs: float,
                           kv_tokens: float, new_tokens: float, q_heads: float, qk_dim: float,
                           v_dim: float, kv_bytes_per_token: float) -> Work:
    """Prefill attention of num_chunks chunks: sum of q * c, sum of q (q + 1) / 2, sum of c + q
    (KV read and written) and sum of q (queries read, outputs written)."""
    per_pair = 2.0 * q_heads * (qk_dim + v_dim)
    nbytes = kv_tokens * kv_bytes_per_token + new_tokens * q_heads * (qk_dim + v_dim) * ACTIVATION_BYTES
    # FlashAttention skips the tiles above the diagonal and computes the diagonal ones whole: a
    # chunk of q tokens computes q (q + TILE) / 2 causal pairs, not q (q + 1) / 2.
    computed = causal_pairs + new_tokens * (CAUSAL_TILE - 1) / 2
    return per_pair * context_pairs, nbytes, num_chunks, per_pair * computed


# NCCL's latency model (src/graph/tuning.cc): a ring's LL all-reduce costs a base latency plus one
# per step, 2 (n - 1) steps over n GPUs; per step 0.6 us over NVLink.
NCCL_RING_LL_BASE_S, NCCL_NVLINK_STEP_S = 6.6e-6, 0.6e-6


def all_reduce_work(message_bytes: float, num_gpus: float) -> Work:
    """A ring all-reduce: 2 (n - 1) / n of the message per GPU, and its 2 (n - 1) steps in the
    sequences slot (each step has its own latency, per_seq_s)."""
    return 0.0, 2.0 * (num_gpus - 1) / num_gpus * message_bytes, 2.0 * (num_gpus - 1), 0.0


def nvls_all_reduce_work(message_bytes: float) -> Work:
    """An NVLS all-reduce (NVLink SHARP): the switch reduces, so each GPU's traffic is the message
    itself, at an algorithm bandwidth nearly independent of the GPU count (sim.latency.collectives)."""
    return 0.0, float(message_bytes)


def one_shot_all_reduce_work(message_bytes: float, num_gpus: float) -> Work:
    """A one-shot peer-memory all-reduce: each GPU reads every peer's whole message."""
    return 0.0, (num_gpus - 1) * message_bytes


def ring_latency_split(latency_s: float, num_gpus: float) -> tuple[float, float]:
    """A measured all-reduce latency at one GPU count as (base, per step) in NCCL's proportions,
    so that it scales with the GPU count as NCCL's model does."""
    steps = 2.0 * (num_gpus - 1)
    base_share = NCCL_RING_LL_BASE_S / (NCCL_RING_LL_BASE_S + steps * NCCL_NVLINK_STEP_S)
    return latency_s * base_share, latency_s * (1 - base_share) / steps


def send_recv_work(message_bytes: float) -> Work:
    """One GPU sends a message to the next (pipeline stages): the message crosses the link once."""
    return 0.0, float(message_bytes)


def all_to_all_work(message_bytes: float, num_gpus: float) -> Work:
    """Each GPU keeps 1/n of its message and sends the rest, one direction of its link."""
    return 0.0, (num_gpus - 1) / num_gpus * message_bytes


def copy_work(nbytes: float) -> Work:
    """A copy that reads and writes `nbytes` in all (KV blocks on the GPU, or KV between host and GPU)."""
    return 0.0, float(nbytes)


def cpu_step_work(num_seqs: float) -> Work:
    """The host's work for one engine step of num_seqs sequences."""
    return 0.0, 0.0, num_seqs, 0.0


def kv_bytes_per_token(num_kv_heads: float, head_dim: float, dtype: str) -> float:
    """K and V of one token for one layer on one GPU."""
    return 2.0 * num_kv_heads * head_dim * DTYPE_BYTES[dtype]


def attention_class(q_heads, kv_heads, head_dim, dtype: str) -> str:
    return f"{int(q_heads)}q{int(kv_heads)}kv{int(head_dim)}:{dtype}"


def gemm_class(n: float, k: float, dtype: str) -> str:
    return f"{int(n)}x{int(k)}:{dtype}"


def _i(row: Mapping, name: str) -> int:
    return int(row[name])


def _decode(row: Mapping, context_tokens: float) -> Work:
    heads, kv_heads, head_dim = _i(row, "num_q_heads"), _i(row, "num_kv_heads"), _i(row, "head_dim")
    return attention_decode_work(_i(row, "batch_size"), context_tokens, heads, head_dim, head_dim,
                                 kv_bytes_per_token(kv_heads, head_dim, row["dtype"]))


def _prefill(row: Mapping, q: float) -> Work:
    """One chunk, or batch_size equal ones where a row gives that optional column."""
    c, chunks = _i(row, "context_len"), row.get("batch_size", 1)
    chunks = 1 if chunks is None or (isinstance(chunks, float) and math.isnan(chunks)) else int(chunks)
    heads, kv_heads, head_dim = _i(row, "num_q_heads"), _i(row, "num_kv_heads"), _i(row, "head_dim")
    return attention_prefill_work(chunks, chunks * q * c, chunks * q * (q + 1) / 2, chunks * (c + q),
                                  chunks * q, heads, head_dim, head_dim,
                                  kv_bytes_per_token(kv_heads, head_dim, row["dtype"]))


def _attention_class(row: Mapping) -> str:
    return attention_class(row["num_q_heads"], row["num_kv_heads"], row["head_dim"], row["dtype"])


@dataclass(frozen=True, slots=True)
class Operator:
    columns: tuple[str, ...]                      # shape columns, as predict reads them
    size: Callable[[Mapping], float]              # the correction table's axis
    shape_class: Callable[[Mapping], str]
    work: Callable[[Mapping, float], Work]        # (row, size) -> work
    extrapolation: Callable[[Mapping], float]     # what the extrapolation split cuts on
    extrapolation_split: tuple[float, float]      # train <= first, test >= second
    extrapolation_axis: str                       # what that axis is, for the fit report
    peak: str = "compute"                         # or "none": moves bytes only
    bandwidth: str = "hbm"                        # "hbm", "link" (one direction), "host" or "none"
    monotone: bool = True                         # a class fixes the work as a function of the size
    table: bool = True                            # fit a correction table per class (else the
                                                  # physical form alone, which extrapolates)


# The host's share of a step (cpu_step, cpu_output): t0 + per_seq_s * sequences.
HOST_STEP = Operator(("batch_size",), lambda r: float(r["batch_size"]), lambda r: "step",
                     lambda r, n: cpu_step_work(n), lambda r: float(r["batch_size"]), (64, 65),
                     "batch_size", peak="none", bandwidth="none", table=False)

CATALOGUE = {
    "gemm": Operator(("m", "n", "k", "dtype"), lambda r: float(r["m"]),
                     lambda r: gemm_class(float(r["n"]), float(r["k"]), r["dtype"]),
                     lambda r, m: gemm_work(m, float(r["n"]), float(r["k"]), r["dtype"]),
                     lambda r: float(r["m"]), (1024, 2048), "m"),
    "attention_decode": Operator(
        ("batch_size", "context_len", "num_q_heads", "num_kv_heads", "head_dim", "dtype"),
        lambda r: float(_i(r, "batch_size") * _i(r, "context_len")), _attention_class, _decode,
        lambda r: float(r["context_len"]), (1024, 1025), "context_len", monotone=False, table=False),
    "attention_prefill": Operator(
        ("chunk_len", "context_len", "num_q_heads", "num_kv_heads", "head_dim", "dtype"),
        lambda r: float(r["chunk_len"]), _attention_class, _prefill,
        lambda r: float(_i(r, "chunk_len") + _i(r, "context_len")), (1024, 1025), "chunk_len + context_len",
        monotone=False, table=False),
    "all_reduce": Operator(("bytes", "num_gpus"), lambda r: float(r["bytes"]),
                           lambda r: f"{int(r['num_gpus'])}gpus",
                           lambda r, b: all_reduce_work(b, _i(r, "num_gpus")),
                           lambda r: float(r["bytes"]), (2**23, 2**24), "bytes",
                           peak="none", bandwidth="link", table=False),
    "send_recv": Operator(("bytes",), lambda r: float(r["bytes"]), lambda r: "p2p",
                          lambda r, b: send_recv_work(b), lambda r: float(r["bytes"]), (2**23, 2**24), "bytes",
                          peak="none", bandwidth="link"),
    "all_to_all": Operator(("bytes", "num_gpus"), lambda r: float(r["bytes"]),
                           lambda r: f"{int(r['num_gpus'])}gpus",
                           lambda r, b: all_to_all_work(b, _i(r, "num_gpus")),
                           lambda r: float(r["bytes"]), (2**23, 2**24), "bytes",
                           peak="none", bandwidth="link", table=False),
    "kv_copy": Operator(("bytes", "dtype"), lambda r: float(r["bytes"]), lambda r: f"dtype={r['dtype']}",
                        lambda r, b: copy_work(b), lambda r: float(r["bytes"]), (2**20, 2**21), "bytes",
                        peak="none"),
    "elementwise": Operator(("bytes",), lambda r: float(r["bytes"]), lambda r: "stream",
                            lambda r, b: copy_work(b), lambda r: float(r["bytes"]), (2**20, 2**21), "bytes",
                            peak="none", table=False),
    "host_copy": Operator(("bytes", "pinned"), lambda r: float(r["bytes"]), lambda r: f"pinned={r['pinned']}",
                          lambda r, b: copy_work(b), lambda r: float(r["bytes"]), (2**20, 2**21), "bytes",
                          peak="none", bandwidth="host"),
    "cpu_step": HOST_STEP,
    "cpu_output": HOST_STEP,  # the same work model; its own fitted t0 and per-sequence cost
}
