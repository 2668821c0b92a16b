"""One MoE layer on one tensor-parallel rank, as vLLM's FusedMoE runs it (Triton path;
vllm/model_executor/layers/fused_moe/fused_moe.py): a replicated router GEMM, top-k selection,
token alignment by expert, two grouped GEMMs over the experts the batch touches (each a single
kernel whose tiles run per expert, so a touched expert with few tokens runs a small, inefficient
GEMM), SiLU-and-mul between them, the weighted sum of the top-k outputs, and the shared experts
as dense GEMMs. Every GEMM is timed by the profile's calibrated GEMM, the experts' grouped
GEMMs at the shares of its efficiencies that vLLM's and SGLang's fused kernel reaches, with its own
fixed cost and a cost per touched expert (sim.latency.calibrated.GROUPED);
the small routing kernels (top-k, alignment, activation, weighted sum) as the step's other
streaming kernels (the profile's `elementwise` operator: their bytes at its memory efficiency,
its fixed cost of a few microseconds; until 2026-12-05 they paid the GEMM's fixed cost, 14 us
on Hopper, which put a batch-1 fused MoE at 1.2-2x vLLM's measured kernel times:
tests/test_moe_kernels.py).

Expert parallelism (`enable_expert_parallel`, EP = the TP group): each GPU holds E / EP whole
experts instead of a 1/TP slice of every expert, and runs the tokens routed to them: the same
FLOPs and expert bytes per GPU in expectation, in wider GEMMs over fewer experts. The routed
tokens travel by all-to-all (dispatch to the experts' GPUs, combine back) and the layer's output
is gathered for the next attention instead of all-reduced (sim.latency.model). Shared experts
stay split over TP. The layer runs at the pace of its busiest GPU (sim.latency.expert_load):
the most experts touched and token copies received, from the experts' popularity spread
(`expert_tokens_cv`); until 2026-12-05 every GPU ran the mean.

Data-parallel attention (`data_parallel_size` DP > 1, with EP): DP ranks of TP GPUs each run
attention for their own sequences, and every MoE layer's experts are spread over all DP x TP GPUs,
which receive the routed tokens of every rank: the router, shared experts and top-k run on one
rank's tokens, the experts on all ranks'.
"""
from __future__ import annotations

from typing import Callable

from sim.latency.calibrated import CalibratedGemm
from sim.latency.expert_load import EXPERT_TOKENS_CV, busiest_gpu
from sim.latency.operators import ACTIVATION_BYTES
from sim.models import ModelSpec

ROUTER_DTYPE = "bf16"  # the gate stays unquantized (ReplicatedLinear, quant_config=None)
INDEX_BYTES = 4


class MoeLayer:
    def __init__(self, model: ModelSpec, tp: int, gemm: CalibratedGemm, weight_dtype: str,
                 memory_time: Callable[[float], float], expert_parallel: bool = False,
                 data_parallel_size: int = 1, expert_tokens_cv: float = EXPERT_TOKENS_CV):
        self.model, self.gemm, self.dtype, self.memory_time = model, gemm, weight_dtype, memory_time
        self.expert_tokens_cv = expert_tokens_cv  # the experts' routed tokens' spread (EP: the busiest GPU)
        self._busiest: dict[float, tuple[float, float]] = {}  # busiest_gpu by tokens (the layer and its all-to-all)
        self.ranks = data_parallel_size  # attention ranks whose tokens meet in every MoE layer
        self.ep = tp * data_parallel_size if expert_parallel else 1  # GPUs the experts are spread over, whole
        up = 2 if model.gated_mlp else 1
        inter = model.expert_intermediate_size / (1 if expert_parallel else tp)
        self.expert_gemms = [(up * inter, model.hidden_size), (model.hidden_size, inter)]
        shared = model.expert_intermediate_size / tp * model.num_shared_experts
        self.shared_gemms = [(up * shared, model.hidden_size), (model.hidden_size, shared)] if shared else []
        self.inter = inter

    def all_to_all_bytes(self, tokens: float, every: float | None = None) -> float:
        """One all-to-all's message to the busiest GPU under EP (`tokens`: one rank's, `every`: all
        ranks', by default the ranks balanced): the token copies its experts run."""
        _, copies = self.busiest_gpu(self._all_ranks(tokens, every))
        return copies * self.model.hidden_size * ACTIVATION_BYTES

    def busiest_gpu(self, every: float) -> tuple[float, float]:
        """(experts touched, token copies) on the GPU with the most when all ranks send `every`
        tokens: without EP each GPU holds a slice of every touched expert and runs every copy."""
        found = self._busiest.get(every)
        if found is None:
            m = self.model
            touched = self.touched_experts(every)
            found = self._busiest[every] = (
                (touched, every * m.num_active_experts) if self.ep == 1 else
                busiest_gpu(every, m.num_active_experts, touched, m.num_experts, self.ep, self.expert_tokens_cv))
        return found

    def _all_ranks(self, tokens: float, every: float | None) -> float:
        """The tokens all attention ranks send a MoE layer (by default `tokens` on each rank)."""
        return tokens * self.ranks if every is None else every

    def touched_experts(self, tokens: float) -> float:
        """Expected distinct routed experts that `tokens` tokens choosing k of E each touch."""
        m = self.model
        return m.num_experts * (1.0 - (1.0 - m.num_active_experts / m.num_experts) ** tokens)

    def time(self, tokens: float, every: float | None = None) -> float:
        """One layer on one GPU for a step of `tokens` tokens on its attention rank and `every`
        on all ranks (by default the ranks balanced)."""
        router, grouped, shared, routing = self._parts(tokens, every)
        return router + grouped + shared + routing

    def fused_time(self, tokens: float) -> float:
        """The routed experts' kernels alone (top-k, alignment, the two grouped GEMMs, activation,
        weighted sum): what vLLM's benchmark_moe.py times as fused_moe, without the router GEMM
        and the shared experts."""
        _, grouped, _, routing = self._parts(tokens, None)
        return grouped + routing

    def _parts(self, tokens: float, every: float | None) -> tuple[float, float, float, float]:
        m, gemm, h = self.model, self.gemm.time, self.model.hidden_size
        k, every = m.num_active_experts, self._all_ranks(tokens, every)
        local, routed = self.busiest_gpu(every)  # the touched experts and token copies this GPU runs
        router = gemm(tokens, m.num_experts, h, ROUTER_DTYPE)
        grouped = sum(self.gemm.grouped_time(routed / local, local, n, kk, self.dtype) for n, kk in self.expert_gemms)
        shared = sum(gemm(tokens, n, kk, self.dtype) for n, kk in self.shared_gemms)
        routing = (self.memory_time(tokens * m.num_experts * 4 + tokens * k * 2 * INDEX_BYTES)  # top-k
                   + self.memory_time(tokens * k * 2 * INDEX_BYTES)                          # align
                   + self.memory_time(routed * m.mlp_activation_widths * self.inter * ACTIVATION_BYTES)  # activation
                   + self.memory_time((routed + every / self.ep) * h * ACTIVATION_BYTES))    # weighted sum
        return router, grouped, shared, routing
