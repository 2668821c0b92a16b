"""A state (Mamba-2) layer's work on one tensor-parallel rank, as vLLM's MambaMixer2 runs it.

    in_proj   hidden -> 2 x inner + 2 x groups x N + heads   (z, x, B, C, dt), a GEMM
    conv1d    causal conv of kernel K over x, B and C          (conv channels = inner + 2 groups N)
    scan      decode: selective_state_update reads and writes each sequence's state;
              prefill: the chunked scan (SSD) over chunks of Q tokens
    norm      gated RMSNorm of the scan's output by z
    out_proj  inner -> hidden, a GEMM

TP splits the heads (and the groups, when they divide evenly; else every rank keeps them all, as
vLLM replicates them). SSD's FLOPs per token and head (Dao and Gu, "Transformers are SSMs",
2024, section 6, arXiv 2405.21060): within a chunk, C B^T over the group's N and its product with
x over P (2 Q N per group and 2 Q P per head), the chunk's state B^T x and the output from the
states (2 N P each); the conv 2 K per channel.
"""
from __future__ import annotations

from dataclasses import dataclass

from sim.kv_layout import LayerGroup
from sim.latency.operators import ACTIVATION_BYTES


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
    def groups(self) -> float:
        g = self.group.ssm_groups
        return g / self.tp if g % self.tp == 0 else g

    @property
    def inner(self) -> float:
        return self.heads * self.group.ssm_head_dim

    @property
    def conv_channels(self) -> float:
        return self.inner + 2 * self.groups * self.group.ssm_state_size

    @property
    def gemms(self) -> list[tuple[float, float]]:
        """(n, k) of in_proj and out_proj on one rank."""
        return [(self.inner + self.conv_channels + self.heads, self.hidden_size), (self.hidden_size, self.inner)]

    @property
    def state_bytes(self) -> float:
        """One sequence's state on one rank (the rank's share of LayerGroup.mamba_state_bytes)."""
        g = self.group
        ssm = {"": ACTIVATION_BYTES, "bf16": 2, "fp16": 2, "fp32": 4}[g.ssm_state_dtype]
        return ((g.conv_kernel - 1) * self.conv_channels * ACTIVATION_BYTES
                + self.inner * g.ssm_state_size * ssm)

    def _stream_bytes(self, tokens: float) -> float:
        """Activations per token through conv and norm: x, B, C read and written by the conv,
        z and the scan's output read by the norm, its output written."""
        return tokens * (2 * self.conv_channels + 3 * self.inner) * ACTIVATION_BYTES

    def decode_bytes(self, num_seqs: float) -> float:
        """A decode step of num_seqs sequences: each state read and written, and the activations."""
        return num_seqs * 2 * self.state_bytes + self._stream_bytes(num_seqs)

    def prefill_work(self, tokens: float, chunks: float) -> tuple[float, float]:
        """(FLOPs, bytes) of prefill chunks of `tokens` tokens in all: SSD over chunks of at most
        ssm_chunk tokens, the conv, and each chunk's state read and written."""
        g = self.group
        q = min(g.ssm_chunk, tokens / max(chunks, 1))
        n, p = g.ssm_state_size, g.ssm_head_dim
        per_token = (2 * q * (n * self.groups + p * self.heads) + 4 * n * p * self.heads
                     + 2 * g.conv_kernel * self.conv_channels)
        return tokens * per_token, self._stream_bytes(tokens) + chunks * 2 * self.state_bytes
