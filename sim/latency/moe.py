"""One MoE layer on one tensor-parallel rank, as vLLM's FusedMoE runs it (Triton path;
vllm/model_executor/layers/fused_moe/fused_moe.py): a replicated router GEMM, top-k selection,
token alignment by expert, two grouped GEMMs over the experts the batch touches (each a single
kernel whose tiles run per expert, so a touched expert with few tokens runs a small, inefficient
GEMM), SiLU-and-mul between them, the weighted sum of the top-k outputs, and the shared experts
as dense GEMMs. Every GEMM is timed by the profile's calibrated GEMM; the small routing kernels
read and write their bytes at the GEMM's memory efficiency with its fixed cost.
"""
from __future__ import annotations

from typing import Callable

from sim.latency.calibrated import CalibratedGemm
from sim.latency.operators import ACTIVATION_BYTES
from sim.models import ModelSpec

ROUTER_DTYPE = "bf16"  # the gate stays unquantized (ReplicatedLinear, quant_config=None)
INDEX_BYTES = 4


class MoeLayer:
    def __init__(self, model: ModelSpec, tp: int, gemm: CalibratedGemm, weight_dtype: str,
                 memory_time: Callable[[float], float]):
        self.model, self.gemm, self.dtype, self.memory_time = model, gemm, weight_dtype, memory_time
        up = 2 if model.gated_mlp else 1
        inter = model.expert_intermediate_size / tp
        self.expert_gemms = [(up * inter, model.hidden_size), (model.hidden_size, inter)]
        shared = inter * model.num_shared_experts
        self.shared_gemms = [(up * shared, model.hidden_size), (model.hidden_size, shared)] if shared else []
        self.inter = inter

    def touched_experts(self, tokens: float) -> float:
        """Expected distinct routed experts that `tokens` tokens choosing k of E each touch."""
        m = self.model
        return m.num_experts * (1.0 - (1.0 - m.num_active_experts / m.num_experts) ** tokens)

    def time(self, tokens: float) -> float:
        m, gemm, h = self.model, self.gemm.time, self.model.hidden_size
        k = m.num_active_experts
        touched = self.touched_experts(tokens)
        per_expert = tokens * k / touched
        router = gemm(tokens, m.num_experts, h, ROUTER_DTYPE)
        grouped = sum(self.gemm.grouped_time(per_expert, touched, n, kk, self.dtype) for n, kk in self.expert_gemms)
        shared = sum(gemm(tokens, n, kk, self.dtype) for n, kk in self.shared_gemms)
        routing = (self.memory_time(tokens * m.num_experts * 4 + tokens * k * 2 * INDEX_BYTES)  # top-k
                   + self.memory_time(tokens * k * 2 * INDEX_BYTES)                          # align
                   + self.memory_time(tokens * k * 3 * self.inter * ACTIVATION_BYTES)         # SiLU-and-mul
                   + self.memory_time(tokens * (k + 1) * h * ACTIVATION_BYTES))               # weighted sum
        return router + grouped + shared + routing
