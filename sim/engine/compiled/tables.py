"""What the compiled loop reads of a LatencyModel: its token-count terms as tables (computed by
the model itself, so every value is the Python engine's float) and its attention operators'
fitted rooflines and correction factors (evaluated in sim.engine.compiled.core)."""
from __future__ import annotations

import numpy as np

from sim.engine.compiled import core
from sim.latency.model import LatencyModel


def _token_terms(latency: LatencyModel, padded: float) -> tuple[float, ...]:
    """(QKV and O projections, MLP, all-reduce, all-to-all, elementwise, send/recv) at `padded` tokens, from
    the model's own memo as _gpu_ops reads it."""
    send_recv = latency.send_recv_time(padded) if latency.pp > 1 else 0.0
    return (*latency.token_ops(padded), send_recv)


def _attention(latency: LatencyModel, op, dims: tuple[float, float]) -> tuple[np.ndarray, ...]:
    """(parameters, grid, factors) of an attention operator (core.A_* order)."""
    roof, table = op.roofline, op.table
    assert roof.bandwidth_ceiling == 1.0 and roof.kernel_floor_s == 0.0, \
        "core._corrected's floor is the datasheet's (a read ceiling and a least kernel time are GEMMs' only)"
    par = np.array([roof.peak_flops, roof.bandwidth, roof.compute_efficiency, roof.memory_efficiency,
                    roof.t0_s, roof.per_seq_s, roof.causal_efficiency or roof.compute_efficiency,
                    latency.heads_per_rank, dims[0], dims[1], latency.kv_bytes_per_token_layer_rank,
                    1.0 if table is not None else 0.0], dtype=np.float64)
    if table is None:
        return par, np.zeros(1), np.ones(1)
    factors = table.classes.get(latency.attention_class, table.factors)
    return par, np.asarray(table.grid, dtype=np.float64), np.asarray(factors, dtype=np.float64)


def latency_tables(latency: LatencyModel, max_tokens: int, max_seqs: int) -> tuple:
    """core.step_time's tables for steps of at most max_tokens tokens and max_seqs sequences;
    micro-batches of 1 and (with pipeline stages) 2 parts."""
    rows = min(latency.pp, 2)
    capture = np.asarray(latency.capture_sizes, dtype=np.int64)
    largest_graph = int(capture[-1]) if len(capture) else 0
    tokens = np.zeros((rows, max_tokens + 1, core.TOKEN_TERMS))
    lm_head, cpu, output = (np.zeros((rows, max_seqs + 1)) for _ in range(3))
    for row in range(rows):
        parts = row + 1
        for count in range(1, max_tokens + 1):
            tokens[row, count] = _token_terms(latency, count if parts == 1 else count / parts)
        for count in range(1, max_seqs + 1):
            share = count if parts == 1 else count / parts
            lm_head[row, count] = latency.lm_head_time(share)
            cpu[row, count] = latency.cpu_time(share)
            output[row, count] = latency.cpu_output_time(share)
    graph = np.zeros((largest_graph + 1, core.TOKEN_TERMS))
    lm_graph = np.zeros(largest_graph + 1)
    for size in capture.tolist():
        graph[size] = _token_terms(latency, size)
        lm_graph[size] = latency.lm_head_time(size)
    prefill = _attention(latency, latency.prefill_op, latency.prefill_dims)
    decode = _attention(latency, latency.decode_op, latency.decode_dims)
    return (tokens, graph, lm_head, lm_graph, cpu, output, capture, *prefill, *decode)


def latency_parameters(latency: LatencyModel) -> tuple[dict, dict]:
    """The step clock's entries of core's int and float parameters."""
    ints = {core.P_PP: latency.pp, core.P_LAYERS: latency.model.num_layers,
            core.P_ASYNC_OUTPUT: int(latency.async_output), core.P_EXPERT_PARALLEL: int(latency.expert_parallel),
            core.P_ASYNC_SCHEDULING: int(latency.async_scheduling)}
    floats = {core.P_GRAPH_LAUNCH_S: latency.profile.graph_launch_s, core.P_EAGER_LAUNCH_S: latency.eager_launch_s}
    return ints, floats
