"""A state (Mamba-2) layer's work on one tensor-parallel rank, as vLLM's MambaMixer2 runs it.

    in_proj   hidden -> 2 x inner + 2 x groups x N + heads   (z, x, B, C, dt), a GEMM
    conv1d    causal conv of kernel K over x, B and C          (conv channels = inner + 2 groups N)
    scan      decode: selective_state_update reads and writes each sequence's state;
              prefill: the chunked scan (SSD) over blocks of Q = ssm_chunk tokens
    norm      gated RMSNorm of the scan's output by z
    out_proj  inner -> hidden, a GEMM

TP splits the heads (and the groups when they divide evenly; one group is kept on every rank, as
vLLM pads n_groups for its head shards; sim.run refuses what vLLM's MambaMixer2 refuses). SSD's
FLOPs per token (Dao and Gu, "Transformers are SSMs", 2024, section 6, arXiv 2405.21060): within
a block of Q tokens, C B^T over the group's N and its product with x over P (2 Q N per group and
2 Q P per head), the block's state B^T x and the output from the states (2 N P per head each);
the conv 2 K per channel. Its traffic: the activations read and written, each block's
intermediate state (heads x P x N in FP32: written by the block-state kernel, read and rewritten
by state passing, read by the block scan), and each sequence's state read and written (a first
chunk reads a zero state all the same: a small overcount).
"""
from __future__ import annotations

from dataclasses import dataclass

from sim.kv_layout import LayerGroup
from sim.latency.operators import ACTIVATION_BYTES

FP32_BYTES = 4  # SSD's intermediate block states


@dataclass(frozen=True)
class StateMixer:
    group: LayerGroup
    tp: int
    hidden_size: int

    @property
    def count(self) -> int:
        return self.group.count

    @property
    def heads(self) -> float:
        return self.group.ssm_heads / self.tp

    @property
    def inner(self) -> float:
        return self.heads * self.group.ssm_head_dim

    @property
    def conv_channels(self) -> float:
        return self.group.conv_channels(self.tp)

    @property
    def gemms(self) -> list[tuple[float, float]]:
        """(n, k) of in_proj and out_proj on one rank."""
        return [(self.inner + self.conv_channels + self.heads, self.hidden_size), (self.hidden_size, self.inner)]

    @property
    def state_bytes(self) -> float:
        """One sequence's state on one rank (LayerGroup.mamba_state_bytes)."""
        return self.group.mamba_state_bytes(self.tp)

    def decode_kernels(self, num_seqs: float) -> list[float]:
        """Bytes of each of a decode step's three kernels over num_seqs sequences: the conv update
        (its state read and written, x, B and C read and written), the state update (the SSM state
        read and written; x, dt, B, C read, y written) and the gated norm (y and z read, its output
        written)."""
        conv = self.group.conv_state_bytes(self.tp, ACTIVATION_BYTES)
        ssm = self.state_bytes - conv
        scan_io = (self.conv_channels + self.heads + self.inner) * ACTIVATION_BYTES
        return [num_seqs * (2 * conv + 2 * self.conv_channels * ACTIVATION_BYTES),
                num_seqs * (2 * ssm + scan_io),
                num_seqs * 3 * self.inner * ACTIVATION_BYTES]

    def prefill_stream_kernels(self, tokens: float) -> list[float]:
        """Bytes of a prefill's conv and gated norm over `tokens` tokens."""
        return [tokens * 2 * self.conv_channels * ACTIVATION_BYTES, tokens * 3 * self.inner * ACTIVATION_BYTES]

    def prefill_scan(self, tokens: float, chunks: float) -> tuple[float, float]:
        """(FLOPs, bytes) of SSD over prefill chunks of `tokens` tokens in all (`chunks` of them, one
        per sequence), in blocks of at most ssm_chunk tokens."""
        g = self.group
        q = min(g.ssm_chunk, tokens / max(chunks, 1))
        n, p = g.ssm_state_size, g.ssm_head_dim
        groups = g.groups_per_rank(self.tp)
        flops = tokens * (2 * q * (n * groups + p * self.heads) + 4 * n * p * self.heads
                          + 2 * g.conv_kernel * self.conv_channels)
        io = tokens * (self.conv_channels + self.heads + self.inner) * ACTIVATION_BYTES
        block_states = tokens / q * 4 * self.inner * n * FP32_BYTES
        return flops, io + block_states + chunks * 2 * self.state_bytes
