"""Per-operator step time: each operator takes t0 + max(compute time, memory time).

    compute time = FLOPs / (peak FLOP/s * compute efficiency)
    memory time  = bytes / (HBM bandwidth * memory efficiency)

per layer, per tensor-parallel rank, for one engine step (one forward pass over every scheduled
token). GPU operators: attention projections (QKV + output), MLP (dense or the experts a batch
touches), LM head over the sampled positions, prefill attention (FLOPs of the causal chunk against
its cached context), decode attention (KV bytes read), each layer's elementwise kernels (norms,
rotary, KV-cache write, SiLU-and-mul: bytes streamed plus a fixed cost each), two all-reduces per
layer (their algorithm chosen per message size, sim.latency.collectives). Then the host's share of
the step:

    step = GPU time + launch + CPU step + output processing
    CPU step (schedule, prepare inputs, sample; the profile's cpu_step) = t0 + per sequence
    output processing (cpu_output, t0 + per sequence) = all of it in a synchronous engine, or
        with asynchronous output processing (vLLM PR #7049; SGLang's and TensorRT-LLM's overlap
        schedulers) only what the step's GPU work does not hide
    launch = graph replay cost                        decode batch within the CUDA-graph sizes
           = max(0, kernels x per-kernel launch - GPU time)   otherwise (eager: the host issues
                                                              kernels while the GPU runs them)

A graph-replayed batch runs padded to the next capture size, as vLLM pads it.

Pipeline parallelism (pp stages of num_layers / pp layers, vLLM's virtual engines): the running
batch is split into pp micro-batches in flight, so one step of every sequence is a round in which
each stage runs each micro-batch once. A round takes pp stage times plus the pp - 1 activation
transfers of one micro-batch through the pipeline:

    round = (every layer's operators on a micro-batch of 1/pp of the batch) + pp LM heads of it
            + (pp - 1) send/recv of its activations + pp graph launches + pp CPU steps of it

Every token's work is done once: the layers of all stages over all micro-batches are the layers
of the model over the batch. A prefill chunk is not split: it runs whole in one micro-batch and
crosses the stages one after another, so a round lasts at least that chunk's time through every
layer plus its transfers; the excess over the balanced round is `pipeline_bubble`.
"""
from __future__ import annotations

import dataclasses
from bisect import bisect_left
from dataclasses import dataclass

import numpy as np

from sim.latency.calibrated import FP8_BLOCK, CalibratedOp, calibrated_gemm, calibrated_profile_op
from sim.latency.collectives import all_reduce_for
from sim.latency.expert_load import EXPERT_TOKENS_CV
from sim.latency.operators import (ACTIVATION_BYTES, CATALOGUE, all_to_all_work, attention_class,
                                   attention_decode_work, attention_prefill_work, copy_work, cpu_step_work,
                                   send_recv_work)
from sim.kv_layout import NO_ATTENTION
from sim.latency.moe import MoeLayer
from sim.latency.profile import GpuProfile
from sim.latency.state import StateMixer
from sim.models import DTYPE_BYTES, QUANTIZED_WEIGHTS, ModelSpec


@dataclass(frozen=True, slots=True)
class BatchShape:
    """What one engine step computes, aggregated over its sequences.

    num_prefill_seqs: prefill chunks (one per sequence).
    prefill_context_pairs, prefill_causal_pairs: sums over prefill chunks of q * c and
    q (q + 1) / 2, the query-key pairs of a chunk of q new tokens after c cached ones.
    prefill_kv_tokens: sum over prefill chunks of c + q (KV read and written).
    decode_context_tokens: sum over decode sequences of their context including the new token.
    num_sampled: sequences whose logits are computed this step.
    swap_tokens: KV tokens moved between GPU and CPU memory this step (swap preemption).
    copy_tokens: KV token slots copied on the GPU this step (copy-on-write of a shared block, or a
    contiguous cache's copy of a forked prompt).
    kv_load_s: prefix blocks loaded from the KV tiers below HBM for this step's admissions.
    """
    num_prefill_tokens: int = 0
    num_prefill_seqs: int = 0
    prefill_context_pairs: int = 0
    prefill_causal_pairs: int = 0
    prefill_kv_tokens: int = 0
    num_decode_seqs: int = 0
    decode_context_tokens: int = 0
    num_sampled: int = 0
    swap_tokens: int = 0
    copy_tokens: int = 0
    # Seconds of loads from KV tiers below HBM (sim.kvcache.tiers) for this step's admissions.
    kv_load_s: float = 0.0
    # Speculative decoding: the query tokens of all decode sequences, a verification's 1 + k and a
    # plain decode's 1 (0: one a decode sequence, no verification in the step).
    decode_queries: float = 0
    # Models whose layer groups read different parts of the context: per group (decode keys,
    # prefill pairs against the cache, causal pairs, prefill KV tokens, indexer keys of decodes,
    # indexer pairs of prefills), summed over the batch (sim.kv_layout's reach).
    group_attention: tuple = ()
    # The prefill chunk of the most new tokens: (new tokens, context pairs, causal pairs, KV
    # tokens); data-parallel attention's busiest rank holds at least it (LatencyModel.rank_shape).
    largest_chunk: tuple = ()

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + (self.decode_queries or self.num_decode_seqs)

    def micro_batch(self, parts: int) -> "BatchShape":
        """One of `parts` equal micro-batches (pipeline parallelism); sums become shares."""
        if parts == 1:
            return self
        groups = tuple(tuple(v / parts for v in group) for group in self.group_attention)
        return BatchShape(*(getattr(self, name) / parts for name in self.__dataclass_fields__
                            if name not in ("group_attention", "largest_chunk")), groups)


class LatencyModel:
    """step_time(shape) for one model on one TP group of one GPU kind; pure and cheap."""

    def __init__(self, model: ModelSpec, profile: GpuProfile, tensor_parallel_size: int,
                 kv_dtype: str, cudagraph_capture_sizes: tuple[int, ...] = (), pipeline_parallel_size: int = 1,
                 expert_parallel: bool = False, async_output_processing: bool = True,
                 overlap_kv_load: bool = True, async_scheduling: bool = False, data_parallel_size: int = 1,
                 num_speculative_tokens: int = 0, expert_tokens_cv: float = EXPERT_TOKENS_CV,
                 api_server_per_seq_s: float = 0.0):
        self.model, self.profile, self.tp = model, profile, tensor_parallel_size
        # Data-parallel attention: dp ranks of tp GPUs, each with its own sequences (a step waits
        # for the busiest rank: rank_shape), the experts spread over all of them.
        self.dp = data_parallel_size
        self.speculative_tokens = num_speculative_tokens  # draft passes a verification step runs
        self.overlap_kv_load = overlap_kv_load  # tier loads beside the GPU work (sim.kvcache.tiers)
        self.pp = pipeline_parallel_size
        tp = tensor_parallel_size
        self.gemm_peak = profile.peak_flops(model.weight_dtype)
        self.attn_peak = profile.bf16_flops_per_s
        self.bw = profile.hbm_bandwidth_bytes_per_s
        self.heads_per_rank = model.num_heads / tp
        kv_split = 1 if model.is_mla else min(tp, model.num_kv_heads)
        self.kv_bytes_per_token_layer_rank = (
            model.kv_elements_per_token_per_layer * DTYPE_BYTES[kv_dtype] / kv_split)
        # Per layer group (models whose groups read different parts of the context): bytes of one
        # entry on one rank (a shared group reads its source's, the first storing group's).
        source = next((g for g in model.layer_groups if g.kind != "shared" and g.kind not in NO_ATTENTION), None)
        self.group_kv_bytes = [model.entry_bytes(source if g.kind == "shared" and source else g, kv_dtype) / kv_split
                               for g in model.layer_groups]
        # Whole-cache bytes per token on one rank (CLA layers share, MLA is replicated).
        self.kv_bytes_per_token_rank = (model.kv_bytes_per_token(kv_dtype) * model.kv_replication(tp)
                                        / tp / self.pp)
        # GEMM shapes (n, k) per layer on one rank; times from the profile's calibrated GEMM.
        self.gemm = calibrated_gemm(profile)
        block_scaled = model.weight_dtype == "fp8" and model.weight_block_size and profile.fp8_flops_per_s
        self.gemm_dtype = FP8_BLOCK if block_scaled else model.weight_dtype
        # What a quantized checkpoint keeps in 16 bits (ModelSpec.unquantized_params): the LM head;
        # in NVFP4, MLA attention too.
        nvfp4 = model.weight_dtype == "nvfp4"
        self.attention_gemm_dtype = "bf16" if nvfp4 and model.is_mla else self.gemm_dtype
        self.lm_head_dtype = "bf16" if model.weight_dtype in QUANTIZED_WEIGHTS else self.gemm_dtype
        h = model.hidden_size
        self.attention_gemms = (
            mla_gemms(model, tp) if model.is_mla else
            [((model.num_heads + 2 * model.num_kv_heads) * model.head_dim / tp, h),
             (h, model.num_heads * model.head_dim / tp)])
        # MLA's chunked prefill decompresses the cached prefix's latents (kv_b_proj) per chunk.
        self.mla_up_gemm = (((model.qk_nope_head_dim + model.v_head_dim) * model.num_heads / tp, model.kv_lora_rank)
                            if model.is_mla else None)
        up = (2 if model.gated_mlp else 1) * model.intermediate_size / tp
        self.dense_mlp_gemms = [(up, h), (h, model.intermediate_size / tp)]
        self.lm_head_gemm = (model.vocab_size / tp, h)
        # Layers by block (hybrids: Nemotron-H's layers hold one block each): attention mixers,
        # state (Mamba-2) mixers, dense MLPs; an all-reduce and a norm follow each block.
        self.attention_layers = model.num_attention_layers
        self.num_dense_layers = model.num_dense_mlp_layers
        self.num_blocks = model.num_blocks
        self.state_mixers = [StateMixer(g, tp, model.hidden_size) for g in model.layer_groups if g.kind == "state"]
        self._ssm_proj: dict[float, float] = {}
        self.prefill_dims = model.attention_dims(decode=False)
        self.decode_dims = model.attention_dims(decode=True)
        # Attention and all-reduce through the operator catalogue's calibrated path; the class
        # names the per-GPU heads (MLA's latent attention matches no measured class).
        self.attention_class = attention_class(self.heads_per_rank, model.num_kv_heads / kv_split,
                                               model.head_dim, kv_dtype)
        self.prefill_op = self._calibrated("attention_prefill", "attention_prefill", self.attn_peak, self.bw)
        # Decode attention per attention kind: MLA's latent kernel has its own operator.
        decode = "attention_decode_mla" if model.is_mla else "attention_decode"
        self.decode_op = self._calibrated(decode, "attention_decode", self.attn_peak, self.bw)
        link = profile.link_bandwidth_bytes_per_s / 2  # one direction
        self.allreduce = all_reduce_for(profile, tp)
        self.cpu_op = self._calibrated("cpu_step", "cpu_step", 1.0, 1.0)
        self.cpu_output_op = self._calibrated("cpu_output", "cpu_output", 1.0, 1.0)
        self.async_output = async_output_processing
        # An HTTP server in the engine's process (vLLM <= 0.5): its per-step work for each running
        # request (building and streaming the response chunk) runs on the engine's thread.
        self.api_server_per_seq_s = api_server_per_seq_s
        # The host's whole step (scheduling the next step, its inputs, the last step's outputs)
        # beside the GPU's work, as TensorRT-LLM's and SGLang's overlap schedulers and vLLM's
        # --async-scheduling run it: a step pays only the CPU time beyond its GPU time.
        self.async_scheduling = async_scheduling
        self.expert_parallel = bool(expert_parallel and model.num_moe_layers and tp * self.dp > 1)
        self.all_to_all_op = self._calibrated("all_to_all", "all_to_all", 1.0, link)
        self.send_recv_op = self._calibrated("send_recv", "send_recv", 1.0, link)
        self.kv_copy_op = self._calibrated("kv_copy", "kv_copy", 1.0, self.bw)
        self.elementwise_op = self._calibrated("elementwise", "elementwise", 1.0, self.bw)
        # (a MoE layer's top-k, alignment, activation and weighted sum are small streaming
        # kernels, timed as the elementwise ones: sim.latency.moe)
        self.moe = MoeLayer(model, tp, self.gemm, self.gemm_dtype,
                            lambda nbytes: self.elementwise_op.time("stream", nbytes, copy_work),
                            self.expert_parallel, self.dp, expert_tokens_cv) if model.num_moe_layers else None
        self.elementwise_kernels = elementwise_kernels(model, tp, kv_split, self.kv_bytes_per_token_layer_rank)
        if block_scaled:  # (per-tensor FP8: no quant kernels, see above group_quant_kernels)
            self.elementwise_kernels += group_quant_kernels(model, tp)
        if nvfp4:
            self.elementwise_kernels += nvfp4_quant_kernels(self._fp4_gemm_inputs())
        self.host_copy_op = self._calibrated("host_copy", "host_copy", 1.0, profile.host_link_bytes_per_s)
        self.kv_dtype = kv_dtype
        self.capture_sizes = tuple(cudagraph_capture_sizes)
        self.eager_launch_s = eager_kernels(model, tp) * profile.kernel_launch_s
        # Steps repeat token counts far more often than shapes: memoize what depends on them.
        self._per_token_count: dict[float, tuple[float, float, float, float, float]] = {}
        self._lm_head: dict[float, float] = {}

    def _fp4_gemm_inputs(self) -> list[tuple[int, list[tuple[float, float]]]]:
        """(layers, GEMMs (n, k) whose input is quantized) of an NVFP4 checkpoint's FP4 GEMMs: dense
        attention's (MLA's stay 16-bit), the dense MLPs', the state mixers' projections, and a MoE
        layer's routed experts (their gate/up input once a token: the down input is quantized inside
        that kernel) and shared experts."""
        groups = [(self.num_dense_layers, self.dense_mlp_gemms)]
        groups += [(mixer.count, mixer.gemms) for mixer in self.state_mixers]
        if self.attention_gemm_dtype == self.gemm_dtype:
            groups.append((self.attention_layers, self.attention_gemms))
        if self.moe:
            groups.append((self.model.num_moe_layers, [self.moe.expert_gemms[0], *self.moe.shared_gemms]))
        return groups

    def _calibrated(self, name: str, operator: str, peak: float, bandwidth: float) -> CalibratedOp:
        """The profile's operator `name`, timed as the catalogue's `operator`."""
        return calibrated_profile_op(self.profile.op(name), peak, bandwidth, CATALOGUE[operator].monotone)

    def _op(self, name: str, flops: float, nbytes: float, peak: float) -> float:
        eff = self.profile.op(name)
        return eff.t0_s + max(flops / (peak * eff.compute_efficiency),
                              nbytes / (self.bw * eff.memory_efficiency))

    def _gemms(self, tokens: int, shapes, dtype: str | None = None) -> float:
        time, dtype = self.gemm.time, dtype or self.gemm_dtype
        return sum(time(tokens, n, k, dtype) for n, k in shapes)

    def lm_head_time(self, sampled: float) -> float:
        """The LM head's GEMM over the sampled tokens (16-bit in a quantized checkpoint)."""
        value = self._lm_head.get(sampled)
        if value is None:
            value = self._lm_head[sampled] = (
                self._gemms(sampled, [self.lm_head_gemm], self.lm_head_dtype) if sampled else 0.0)
        return value

    def graph_size(self, shape: BatchShape) -> int:
        """The capture size a decode-only batch replays as (it runs padded to it); 0: eager."""
        tokens = shape.num_tokens  # (a verification's 1 + k queries each, as vLLM captures tokens)
        if shape.num_prefill_tokens or not self.capture_sizes or tokens > self.capture_sizes[-1]:
            return 0
        return self.capture_sizes[bisect_left(self.capture_sizes, tokens)]

    def breakdown(self, shape: BatchShape) -> dict[str, float]:
        """Seconds per operator for one step, GPU operators first, then `launch` and `cpu`;
        their sum (left to right) is step_time(shape)."""
        whole = shape
        parts = self.micro_batches(whole.num_prefill_seqs + whole.num_decode_seqs)
        shape = whole.micro_batch(parts) if self.dp == 1 else self.rank_shape(whole)
        num_seqs = shape.num_prefill_seqs + shape.num_decode_seqs
        if shape.num_tokens == 0:
            moves = {**({"swap": self.swap_time(whole.swap_tokens)} if whole.swap_tokens else {}),
                     **({"kv_copy": self.kv_copy_time(whole.copy_tokens)} if whole.copy_tokens else {})}
            output = parts * self.cpu_output_time(num_seqs)
            return {**moves, "launch": 0.0, "cpu": parts * self.cpu_time(num_seqs),
                    "cpu_output": 0.0 if self.async_output or self.async_scheduling else output}
        graph = self.graph_size(shape)
        # Tokens every rank's MoE layers see (ranks padded alike to one CUDA-graph size)
        every = None if self.dp == 1 else graph * self.dp if graph else whole.num_tokens
        times = self._gpu_ops(shape, graph, parts, every)
        if self.pp > 1 and whole.num_prefill_tokens:
            # A prefill chunk is not split across micro-batches: it crosses every stage in turn.
            chunk = dataclasses.replace(whole, num_decode_seqs=0, decode_context_tokens=0,
                                        num_sampled=min(whole.num_sampled, whole.num_prefill_seqs), swap_tokens=0)
            latency = sum(self._gpu_ops(chunk, 0, 1).values())
            times["pipeline_bubble"] = max(0.0, latency - sum(times.values()))
        if shape.decode_queries and self.speculative_tokens:  # (each micro-batch drafts)
            times["speculative_draft"] = parts * self.draft_time(shape)
        if whole.swap_tokens:
            times["swap"] = self.swap_time(whole.swap_tokens)
        if whole.copy_tokens:
            times["kv_copy"] = self.kv_copy_time(whole.copy_tokens)
        if whole.kv_load_s:  # loads overlapped with the GPU work cost only what exceeds it
            times["kv_load"] = (max(0.0, whole.kv_load_s - sum(times.values())) if self.overlap_kv_load
                                else whole.kv_load_s)
        gpu = sum(times.values())
        times["launch"] = parts * self.profile.graph_launch_s if graph else max(0.0, self.eager_launch_s - gpu)
        times.update(self._host(parts, num_seqs, gpu))
        return times

    def _host(self, parts: int, num_seqs: int, gpu: float) -> dict[str, float]:
        """The host's step work (`cpu`: schedule, prepare inputs, sample; `cpu_output`: output
        processing) as far as the step waits for it beside `gpu` seconds of GPU work."""
        cpu, output = parts * self.cpu_time(num_seqs), parts * self.cpu_output_time(num_seqs)
        if self.async_scheduling:
            return {"cpu": max(0.0, cpu + output - gpu), "cpu_output": 0.0}
        return {"cpu": cpu, "cpu_output": max(0.0, output - gpu) if self.async_output else output}

    def cpu_output_time(self, num_seqs: float) -> float:
        """The host's output processing of a step (detokenise, build and stream responses)."""
        return self.cpu_output_op.time("step", num_seqs, cpu_step_work)

    def micro_batches(self, num_seqs: int) -> int:
        """Micro-batches in flight: one per pipeline stage, but never more than sequences."""
        return max(1, min(self.pp, num_seqs))

    def draft_time(self, shape: BatchShape) -> float:
        """Speculative decoding's drafts: num_speculative_tokens passes, one after another, of a
        one-layer draft (DeepSeek's MTP layer, an EAGLE head) over the step's decode sequences:
        one layer's share of the model's GEMMs, collectives and elementwise kernels, one layer of
        decode attention, and the LM head."""
        seqs = shape.num_decode_seqs
        layer = sum(self.token_ops(seqs)) / self.model.num_layers
        plain = dataclasses.replace(shape, decode_queries=0)
        return self.speculative_tokens * (layer + self.attention_decode_time(plain) + self.lm_head_time(seqs))

    def busy_ranks(self, num_seqs: float) -> float:
        """Data-parallel ranks holding a sequence (balanced): all, or one per sequence."""
        return max(1, min(self.dp, num_seqs))

    def rank_shape(self, whole: BatchShape) -> BatchShape:
        """The busiest data-parallel rank's share of a step, which every rank waits for at each
        MoE layer: decodes spread evenly over the ranks; the prefill chunks, each whole on one
        rank, spread evenly too unless the largest chunk alone is more than an even share."""
        d, p = self.busy_ranks(whole.num_decode_seqs), self.busy_ranks(whole.num_prefill_seqs)
        decode_sampled = whole.decode_queries or whole.num_decode_seqs
        sampled_prefills = max(0, whole.num_sampled - decode_sampled)
        prefill = (whole.num_prefill_tokens / p, whole.prefill_context_pairs / p, whole.prefill_causal_pairs / p,
                   whole.prefill_kv_tokens / p)
        if whole.largest_chunk and whole.largest_chunk[0] > prefill[0]:
            prefill = tuple(float(v) for v in whole.largest_chunk)
        # per group: decode keys, prefill pairs, causal pairs, prefill KV tokens, indexer keys of
        # decodes, indexer pairs of prefills (BatchShape.group_attention; prefills as an even share)
        groups = tuple((g[0] / d, g[1] / p, g[2] / p, g[3] / p, g[4] / d, g[5] / p) for g in whole.group_attention)
        return BatchShape(prefill[0], whole.num_prefill_seqs / p, prefill[1], prefill[2], prefill[3],
                          whole.num_decode_seqs / d, whole.decode_context_tokens / d,
                          decode_sampled / d + sampled_prefills / p,
                          whole.swap_tokens, whole.copy_tokens, whole.kv_load_s, whole.decode_queries / d,
                          group_attention=groups)

    def _gpu_ops(self, shape: BatchShape, graph: int, parts: int, every: float | None = None) -> dict[str, float]:
        """GPU operators of a round of `parts` micro-batches like `shape` through every stage
        (without pipeline stages: one step of it); each micro-batch's activations cross the
        pp - 1 stage boundaries. With data-parallel attention `shape` is one rank's and `every`
        the tokens of all ranks, which the MoE layers run."""
        m, tokens = self.model, shape.num_tokens
        padded, sampled = (graph, graph) if graph else (tokens, shape.num_sampled)
        lm_head = self.lm_head_time(sampled)
        qkv_o_proj, mlp, allreduce, all_to_all, elementwise = self.token_ops(padded, every)
        times = {
            "qkv_o_proj": qkv_o_proj, "mlp": mlp, "elementwise": elementwise, "lm_head": parts * lm_head,
            "attention_prefill": 0.0, "attention_decode": 0.0, "allreduce": allreduce,
        }
        if self.expert_parallel:
            times["all_to_all"] = all_to_all
        if shape.group_attention:
            self._group_attention(shape, times)
        elif shape.num_prefill_tokens:
            times["attention_prefill"] = self.attention_layers * self.attention_prefill_time(shape)
        if shape.num_prefill_tokens:  # (the whole cached prefix, as the plain model decompresses it)
            cached = shape.prefill_kv_tokens - shape.num_prefill_tokens
            if self.mla_up_gemm and cached > 0:
                times["mla_up_projection"] = self.attention_layers * self._gemms(cached, [self.mla_up_gemm],
                                                                                 self.attention_gemm_dtype)
        if shape.num_decode_seqs and not shape.group_attention:
            times["attention_decode"] = self.attention_layers * self.attention_decode_time(shape)
        if self.state_mixers:
            self._state_layers(shape, padded, times)
        if self.pp > 1:
            times["send_recv"] = (self.pp - 1) * self.send_recv_time(padded)
        return times

    def send_recv_time(self, tokens: float) -> float:
        """One micro-batch's activations from one pipeline stage to the next."""
        nbytes = tokens * self.model.hidden_size * ACTIVATION_BYTES
        return self.send_recv_op.time("p2p", nbytes, send_recv_work)

    def cpu_time(self, num_seqs: int) -> float:
        """The host's critical step work (schedule, prepare inputs, sample, and an in-process API
        server's share: api_server_per_seq_s a running request); output processing is
        cpu_output_time."""
        return self.cpu_op.time("step", num_seqs, cpu_step_work) + self.api_server_per_seq_s * num_seqs

    def token_ops(self, tokens: float, every: float | None = None) -> tuple[float, float, float, float, float]:
        """_token_ops, memoized: steps repeat token counts far more often than shapes."""
        key = tokens if self.dp == 1 else (tokens, every)
        terms = self._per_token_count.get(key)
        if terms is None:  # the GEMMs and all-reduces depend on the token count alone
            terms = self._per_token_count[key] = self._token_ops(tokens, every)
        return terms

    def _token_ops(self, tokens: float, every: float | None = None) -> tuple[float, float, float, float, float]:
        """(QKV and O projections, MLP, all-reduce, all-to-all, elementwise kernels) seconds for a
        step of `tokens` tokens: an all-reduce after each attention and each MLP under TP; under EP
        a MoE layer's routed tokens go out and back by all-to-all and its output is gathered instead."""
        m = self.model
        qkv_o_proj = self.attention_layers * self._gemms(tokens, self.attention_gemms, self.attention_gemm_dtype)
        mlp = ((self.num_dense_layers * self._gemms(tokens, self.dense_mlp_gemms) if self.num_dense_layers else 0.0)
               + (m.num_moe_layers * self.moe.time(tokens, every) if m.num_moe_layers else 0.0))
        op = self.elementwise_op
        elementwise = sum(layers * op.time("stream", tokens * nbytes, copy_work)
                          for layers, nbytes in self.elementwise_kernels)
        if not self.expert_parallel:
            if self.tp == 1:
                return qkv_o_proj, mlp, 0.0, 0.0, elementwise
            activations = tokens * m.hidden_size * ACTIVATION_BYTES
            return qkv_o_proj, mlp, self.num_blocks * self._allreduce(activations), 0.0, elementwise
        activations = tokens * m.hidden_size * ACTIVATION_BYTES
        mixers = self.attention_layers + m.num_state_layers
        allreduce = (mixers + self.num_dense_layers) * self._allreduce(activations) if self.tp > 1 else 0.0
        a2a, ep = self.all_to_all_time, self.moe.ep
        gather = a2a(activations, self.tp) if self.tp > 1 else 0.0  # to the rank's TP group
        all_to_all = m.num_moe_layers * (2 * a2a(self.moe.all_to_all_bytes(tokens, every), ep) + gather)
        return qkv_o_proj, mlp, allreduce, all_to_all, elementwise

    def all_to_all_time(self, message_bytes: float, gpus: int | None = None) -> float:
        """An all-to-all over `gpus` GPUs (default the TP group): EP dispatch or combine over every
        expert GPU, the output's gather over a rank's TP group."""
        gpus = gpus or self.tp
        return self.all_to_all_op.time(f"{gpus}gpus", message_bytes, lambda size: all_to_all_work(size, gpus))

    def attention_prefill_time(self, shape: BatchShape, kv_bytes: float | None = None, heads: float | None = None,
                               dims: tuple[float, float] | None = None) -> float:
        """One layer's prefill attention on one GPU; the correction axis is the mean chunk."""
        work = attention_prefill_work(
            shape.num_prefill_seqs, shape.prefill_context_pairs, shape.prefill_causal_pairs,
            shape.prefill_kv_tokens, shape.num_prefill_tokens, heads or self.heads_per_rank,
            *(dims or self.prefill_dims), self.kv_bytes_per_token_layer_rank if kv_bytes is None else kv_bytes)
        return self.prefill_op.time(self.attention_class, shape.num_prefill_tokens / max(shape.num_prefill_seqs, 1),
                                    lambda _: work)

    def attention_decode_time(self, shape: BatchShape, kv_bytes: float | None = None, heads: float | None = None,
                              dims: tuple[float, float] | None = None) -> float:
        """One layer's decode attention on one GPU; the correction axis is the cached tokens read."""
        kv_bytes = self.kv_bytes_per_token_layer_rank if kv_bytes is None else kv_bytes
        heads = heads or self.heads_per_rank
        if shape.decode_queries:  # verifications: 1 + k queries of a sequence share its KV reads
            heads = heads * shape.decode_queries / shape.num_decode_seqs
        return self.decode_op.time(self.attention_class, shape.decode_context_tokens, lambda tokens: (
            attention_decode_work(shape.num_decode_seqs, tokens, heads, *(dims or self.decode_dims), kv_bytes)))

    def _group_attention(self, shape: BatchShape, times: dict) -> None:
        """Each layer group's attention over what it reads (BatchShape.group_attention): its own
        context sums in the same operators, at its own bytes per entry; a DSA group's indexer
        scores every cached key with its heads (FP8 keys, REFERENCE.md section 8)."""
        prefill = decode = indexer = 0.0
        for group, kv_bytes, (keys, pairs, causal, kv, index_keys, index_pairs) in zip(
                self.model.layer_groups, self.group_kv_bytes, shape.group_attention):
            if group.kind in NO_ATTENTION:
                continue
            if shape.num_prefill_tokens:
                part = dataclasses.replace(shape, prefill_context_pairs=pairs, prefill_causal_pairs=causal,
                                           prefill_kv_tokens=kv)
                prefill += group.count * self.attention_prefill_time(part, kv_bytes)
            if shape.num_decode_seqs:
                decode += group.count * self.attention_decode_time(
                    dataclasses.replace(shape, decode_context_tokens=keys), kv_bytes)
            if group.indexer_heads and (index_keys or index_pairs):
                dims = (group.indexer_head_dim, 0)
                if index_pairs:
                    part = dataclasses.replace(shape, prefill_context_pairs=index_pairs, prefill_causal_pairs=0,
                                               prefill_kv_tokens=0)
                    indexer += group.count * self.attention_prefill_time(part, 0.0, group.indexer_heads, dims)
                if index_keys:
                    indexer += group.count * self.attention_decode_time(
                        dataclasses.replace(shape, decode_context_tokens=index_keys), group.indexer_entry_bytes,
                        group.indexer_heads, dims)
        times["attention_prefill"], times["attention_decode"] = prefill, decode
        if indexer:
            times["attention_indexer"] = indexer

    def _state_layers(self, shape: BatchShape, tokens: float, times: dict) -> None:
        """State (Mamba-2) layers: their in and out projections (calibrated GEMMs, per token count),
        then their kernels (sim.latency.state): a decode's conv update, state update and gated norm,
        memory-bound streams (selective_state_update reads and writes each sequence's state); a
        prefill's conv and norm, and the chunked scan (SSD, timed at the GEMM's efficiency: its work
        is batched matrix products, Dao and Gu 2024, section 6)."""
        proj = self._ssm_proj.get(tokens)
        if proj is None:
            proj = self._ssm_proj[tokens] = sum(mixer.count * self._gemms(tokens, mixer.gemms)
                                                for mixer in self.state_mixers)
        stream, scan = self.elementwise_op.time, 0.0
        for mixer in self.state_mixers:
            kernels = 0.0
            if shape.num_decode_seqs:
                kernels += sum(stream("stream", nbytes, copy_work) for nbytes in mixer.decode_kernels(shape.num_decode_seqs))
            if shape.num_prefill_tokens:
                flops, nbytes = mixer.prefill_scan(shape.num_prefill_tokens, shape.num_prefill_seqs)
                kernels += self._op("gemm", flops, nbytes, self.attn_peak) + sum(
                    stream("stream", nbytes, copy_work) for nbytes in mixer.prefill_stream_kernels(shape.num_prefill_tokens))
            scan += mixer.count * kernels
        times["ssm_proj"], times["ssm_scan"] = proj, scan

    def swap_time(self, num_tokens: int) -> float:
        """Each rank (of every stage) moves its share of the tokens' KV over its own host link."""
        nbytes = num_tokens * self.kv_bytes_per_token_rank
        return self.host_copy_op.time("pinned=True", nbytes, copy_work)  # swap space is pinned

    def kv_copy_time(self, num_tokens: int) -> float:
        """Each rank copies its share of the tokens' KV (read and written) in its own memory."""
        nbytes = 2 * num_tokens * self.kv_bytes_per_token_rank
        return self.kv_copy_op.time(f"dtype={self.kv_dtype}", nbytes, copy_work)

    def decode_kv_bytes_per_layer(self, shape: BatchShape) -> float:
        """KV bytes one rank reads per layer for the step's decode attention."""
        return shape.decode_context_tokens * self.kv_bytes_per_token_layer_rank

    def _allreduce(self, message_bytes: float) -> float:
        """The engine's all-reduce over the TP group, its algorithm chosen per size
        (sim.latency.collectives)."""
        return self.allreduce.time(message_bytes)

    def step_time(self, shape: BatchShape) -> float:
        return sum(self.breakdown(shape).values())

    def decode_step_times(self, num_seqs: int, decode_context_tokens: np.ndarray) -> np.ndarray:
        """step_time of decode-only steps of num_seqs sequences, one per context total, bit for
        bit: the same operations in the same order as breakdown() and its sum, on arrays."""
        shape = BatchShape(num_decode_seqs=num_seqs, decode_context_tokens=1, num_sampled=num_seqs)
        parts = self.micro_batches(num_seqs)
        divide = parts * self.busy_ranks(num_seqs)  # one micro-batch of one rank
        probe, graph = self.breakdown(shape), self.graph_size(shape.micro_batch(divide))
        before = 0  # sum() adds left to right from 0; attention_decode comes sixth
        for name in ("qkv_o_proj", "mlp", "elementwise", "lm_head", "attention_prefill"):
            before = before + probe[name]
        op, roof = self.decode_op, self.decode_op.roofline
        context = np.asarray(decode_context_tokens, dtype=np.float64)
        if divide > 1:  # one micro-batch of one rank, as breakdown() times it
            num_seqs, context = num_seqs / divide, context / divide
        flops, nbytes, _, _ = attention_decode_work(num_seqs, context, self.heads_per_rank, *self.decode_dims,
                                                    self.kv_bytes_per_token_layer_rank)
        # CalibratedOp.time on arrays (no causal FLOPs in decode)
        fitted = roof.t0_s + roof.per_seq_s * num_seqs + np.maximum(
            flops / (roof.peak_flops * roof.compute_efficiency),
            nbytes / (roof.bandwidth * roof.memory_efficiency))
        floor = np.maximum(flops / roof.peak_flops, nbytes / roof.bandwidth)
        if op.table is not None:
            fitted = fitted * np.array([op.factor(self.attention_class, size) for size in context.tolist()])
        attention = self.model.num_layers * np.maximum(fitted, floor)
        gpu = before + attention + probe["allreduce"]
        if "all_to_all" in probe:
            gpu = gpu + probe["all_to_all"]
        if "send_recv" in probe:
            gpu = gpu + probe["send_recv"]
        launch = parts * self.profile.graph_launch_s if graph else np.maximum(0.0, self.eager_launch_s - gpu)
        cpu, output = parts * self.cpu_time(num_seqs), parts * self.cpu_output_time(num_seqs)
        if self.async_scheduling:
            return gpu + launch + np.maximum(0.0, cpu + output - gpu) + 0.0
        hidden = np.maximum(0.0, output - gpu) if self.async_output else output
        return gpu + launch + cpu + hidden


# Kernels one eager forward pass launches, as vLLM's model code runs them (my reading of
# vllm/model_executor/models/llama.py and deepseek_v2.py): per layer, attention block: norm, QKV
# GEMM, rotary, KV cache write, attention, output GEMM (MLA: 11 with its down/up projections, the
# absorbed up-projection's two products, and their norms); dense MLP: fused add+norm, gate/up
# GEMM, SiLU-and-mul, down GEMM; MoE: about 15 (router GEMM, top-k, align/permute, two grouped
# GEMMs, activation, sum, shared experts); plus
# an all-reduce after each block under TP, and per step embedding, final norm, LM head, sampler.
# A state (Mamba-2) block: norm, in_proj GEMM, causal conv, scan, gated norm, out_proj GEMM (my
# reading of vllm/model_executor/layers/mamba/mamba_mixer2.py).
ATTENTION_BLOCK_KERNELS, MLA_BLOCK_KERNELS, STATE_BLOCK_KERNELS = 6, 11, 6
DENSE_MLP_KERNELS, MOE_KERNELS, STEP_KERNELS = 4, 15, 6


def eager_kernels(model: ModelSpec, tp: int) -> int:
    attention = MLA_BLOCK_KERNELS if model.is_mla else ATTENTION_BLOCK_KERNELS
    all_reduces = model.num_blocks if tp > 1 else 0  # one after each block
    return (STEP_KERNELS + model.num_attention_layers * attention + all_reduces
            + model.num_state_layers * STATE_BLOCK_KERNELS + model.num_dense_mlp_layers * DENSE_MLP_KERNELS
            + model.num_moe_layers * MOE_KERNELS)


def elementwise_kernels(model: ModelSpec, tp: int, kv_split: float, kv_bytes: float) -> list[tuple[int, float]]:
    """(layers that run it, bytes per token on one rank) of each elementwise kernel of the forward
    pass (eager_kernels' list): the input and post-attention norms (fused with the residual add:
    the activations and the residual read and written), the rotary embedding (queries' and keys'
    rotary parts read and written), the KV-cache write (keys and values read, the cache written:
    counted as twice kv_bytes, one layer's KV per token on one rank), MLA's norms of its query and
    KV latents, and the dense layers' activation (SiLU-and-mul: gate and up read, their product
    written; a plain activation: up read and written, ModelSpec.mlp_activation_widths). MoE
    layers' own kernels are sim.latency.moe's; a state layer's conv and norms sim.latency.state's.
    Hybrids (Nemotron-H) norm once per block (mixer or MLP)."""
    h, b, layers = model.hidden_size, ACTIVATION_BYTES, model.num_attention_layers
    if model.is_mla:
        rope = (model.num_heads / tp + 1) * model.qk_rope_head_dim
    else:
        rope = (model.num_heads / tp + model.num_kv_heads / kv_split) * model.head_dim
    kernels = [(model.num_blocks, 4.0 * h * b), (layers, 2.0 * rope * b), (layers, 2.0 * kv_bytes)]
    if model.is_mla:
        kernels.append((layers, 2.0 * model.kv_lora_rank * b))
        if model.q_lora_rank:
            kernels.append((layers, 2.0 * model.q_lora_rank * b))
    dense = model.num_dense_mlp_layers
    if dense:
        kernels.append((dense, float(model.mlp_activation_widths) * model.intermediate_size / tp * b))
    return kernels


# Per-tensor FP8 GEMM inputs are quantized inside the kernel before the GEMM, as TensorRT-LLM
# fuses them into its norm and activation kernels: no kernel of their own (vLLM without its fusion
# passes runs scaled_fp8_quant separately, not counted); block-scaled FP8's per_token_group_quant
# kernels are (group_quant_kernels), and so are NVFP4's (nvfp4_quant_kernels).

# NVFP4 activations: 16-bit values read, 4-bit values and one FP8 scale per 16 written.
NVFP4_QUANT_BYTES_PER_VALUE = ACTIVATION_BYTES + 0.5 + 1 / 16


def nvfp4_quant_kernels(fp4_gemm_inputs) -> list[tuple[int, float]]:
    """(layers, bytes per token on one rank) of NVFP4's activation quantization: a kernel of its own
    before each FP4 GEMM's input (k of each (n, k)), as an nsys trace of TensorRT-LLM (image
    rc6.post2) decoding DeepSeek-R1-0528-NVFP4-v2 on 8 B200s at concurrency 64 shows:
    quantize_with_block_size<NVFP4>, 97,104 launches over 24,888 attention-layer passes (3.9 a
    layer: before the output projection, the routed experts, the shared experts' gate/up and their
    down projection; the routed experts' down input is quantized inside their gate/up kernel), 2.2
    to 3.8 us each, after the fused all-reduce and norm rather than inside it; SGLang 0.5.9's trace
    on the B200 runs them too (validation/SOURCES.md, "Kernel times that check the model"). That
    trace's -v2 checkpoint quantizes MLA's output projection too; kvsim keeps MLA attention 16-bit,
    as the first DeepSeek-R1 FP4 checkpoint does, so it counts none there. The W4A4 GEMM itself is
    the profile's FP4 GEMM."""
    return [(layers, width * NVFP4_QUANT_BYTES_PER_VALUE)
            for layers, gemms in fp4_gemm_inputs if layers for _, width in gemms]


def group_quant_bytes(width: float) -> float:
    """Bytes per token of one per_token_group_quant_fp8 over `width` activations: 16-bit values
    read, FP8 values and a 4-byte scale per 128 written."""
    return width * (ACTIVATION_BYTES + 1 + 4 / 128)


def group_quant_kernels(model: ModelSpec, tp: int) -> list[tuple[int, float]]:
    """(layers, bytes per token on one rank) of the activation quantization block-scaled FP8
    GEMMs need (per_token_group_quant_fp8, one per GEMM input: 16-bit activations read, FP8 values
    and a 4-byte scale per 128 written), as DeepSeek's checkpoints run in vLLM and SGLang:
    attention's input (the fused query and KV down-projections'), the query up-projection's and
    the output projection's; the MLP's input and its down-projection's (a MoE layer: each routed
    copy of a token's, and the shared experts')."""
    quant = group_quant_bytes
    layers, h = model.num_attention_layers, model.hidden_size
    out = (model.v_head_dim if model.is_mla else model.head_dim) * model.num_heads / tp
    kernels = [(layers, quant(h)), (layers, quant(out))]
    if model.is_mla and model.q_lora_rank:
        kernels.append((layers, quant(model.q_lora_rank)))
    dense = model.num_dense_mlp_layers
    if dense:
        kernels += [(dense, quant(h)), (dense, quant(model.intermediate_size / tp))]
    if model.num_moe_layers:
        kernels += [(model.num_moe_layers, quant(width)) for width in moe_quant_widths(model, tp)]
    return kernels


def moe_quant_widths(model: ModelSpec, tp: int) -> tuple[float, float]:
    """The activations a MoE layer's block-scaled FP8 GEMMs quantize per token on one rank: its
    input, and its down-projections' (each routed copy of a token's, and the shared experts')."""
    experts = model.num_active_experts + model.num_shared_experts
    return model.hidden_size, experts * model.expert_intermediate_size / tp


def mla_gemms(model: ModelSpec, tp: int) -> list[tuple[float, float]]:
    """MLA's projections (n, k) on one rank: the down-projections of queries and of the KV latent
    are replicated on every rank (ReplicatedLinear in vLLM and SGLang), the up-projections and the
    output projection split their heads across the TP group. The KV up-projection (kv_b_proj) runs
    absorbed, as two batched products over the heads: W_UK on the queries' non-rotary part before
    attention, W_UV on its output after (vLLM's and SGLang's MLA decode, torch.bmm; TensorRT-LLM's
    UK_BGEMM and UV_GEMM kernels in its B200 trace, validation/SOURCES.md). A prefill running
    kv_b_proj as one GEMM over the new latents does the same work in one kernel, not modelled
    apart (one fixed cost a layer more in kvsim)."""
    h, heads = model.hidden_size, model.num_heads / tp
    qk = model.qk_nope_head_dim + model.qk_rope_head_dim
    latent = model.kv_lora_rank + model.qk_rope_head_dim
    if model.q_lora_rank:
        gemms = [(model.q_lora_rank + latent, h), (heads * qk, model.q_lora_rank)]
    else:
        gemms = [(latent, h), (heads * qk, h)]
    absorbed = [(heads * model.kv_lora_rank, model.qk_nope_head_dim), (heads * model.v_head_dim, model.kv_lora_rank)]
    return gemms + absorbed + [(h, heads * model.v_head_dim)]

