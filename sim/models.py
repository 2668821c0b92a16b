"""Model specs and their KV-cache footprint.

KV bytes = 2 * B * L * H_kv * d_h * t * s (REFERENCE.md section 1). The four shrinking axes map
onto the spec: GQA/MQA lower `num_kv_heads`; CLA divides the layers that store KV by
`cla_share_factor`; MLA replaces 2 * H_kv * d_h by `kv_lora_rank + qk_rope_head_dim`; FP8 halves s.
Models whose layers differ (sliding windows, chunked-local, DeepSeek-V4's compressed layers, V3.2's
DSA, shared or state layers) list them in `layers` (sim.kv_layout); without it every layer is of
the `attention` kind (CLA: every c-th layer stores, the others share).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources

from omegaconf import OmegaConf

from sim.errors import ConfigError, UnknownNameError
from sim.kv_layout import (DTYPE_BYTES, NO_ATTENTION, PLAIN_ATTENTION, KindUsage, LayerGroup, attention_token_page,
                           kind_usage, layer_group, padded_layer_counts, state_block_size)

ATTENTION_KINDS = ("mha", "gqa", "mqa", "mla", "cla")
WEIGHT_DTYPES = ("bf16", "fp16", "fp8", "nvfp4")
QUANTIZED_WEIGHTS = ("fp8", "nvfp4")  # checkpoints that keep the embeddings and LM head 16-bit
# vLLM's kv_cache_dtype values; "auto" keeps the model's own KV dtype.
KV_CACHE_DTYPES = {"auto": None, "bf16": "bf16", "fp16": "fp16", "fp8": "fp8",
                   "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_params: float
    attention: str = "gqa"
    gated_mlp: bool = True
    # MLA (DeepSeek-V2/V3): the cached latent and the decoupled RoPE key.
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # CLA: only every c-th layer produces K/V.
    cla_share_factor: int = 1
    # Mixture of experts; layers before num_dense_layers use intermediate_size.
    num_experts: int = 0
    num_active_experts: int = 0
    num_shared_experts: int = 0
    expert_intermediate_size: int = 0
    num_dense_layers: int = 0
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    max_position_embeddings: int = 0
    # FP8 weights scaled per block of weight_block_size x weight_block_size (0: per tensor or row),
    # as a checkpoint's quantization_config.weight_block_size says.
    weight_block_size: int = 0
    tie_word_embeddings: bool = False  # the LM head is the embedding matrix (one copy of its weights)
    # Per-layer kinds (sim.kv_layout.LayerGroup), in order; () = all layers of `attention`.
    layers: tuple[LayerGroup, ...] = ()
    source: str = ""  # where the figures come from (a config.json, a paper)
    substituted: str = ""  # what the spec counts otherwise than the checkpoint (said by every run)

    def __post_init__(self):
        where = f"model '{self.name}'"
        if self.attention not in ATTENTION_KINDS:
            raise ConfigError(f"attention kind '{self.attention}' is not one of "
                              f"{', '.join(ATTENTION_KINDS)}, {where}, fix the model YAML")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ConfigError(f"weight_dtype '{self.weight_dtype}' is not one of {', '.join(WEIGHT_DTYPES)}, "
                              f"{where}, fix the model YAML")
        if self.kv_dtype not in ("bf16", "fp16", "fp8"):
            raise ConfigError(f"kv_dtype '{self.kv_dtype}' is not bf16, fp16 or fp8, {where}, "
                              f"fix the model YAML")
        if self.attention == "mla" and self.kv_lora_rank <= 0:
            raise ConfigError(f"mla needs kv_lora_rank > 0, {where}, fix the model YAML")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads "
                              f"{self.num_kv_heads}, {where}, fix the model YAML")
        if self.layers and sum(g.count for g in self.layers) != self.num_layers:
            raise ConfigError(f"layers count {sum(g.count for g in self.layers)} layers, not "
                              f"num_layers={self.num_layers}, {where}, fix the model YAML")
        if self.num_moe_layers > self.num_mlp_layers:
            raise ConfigError(f"{self.num_moe_layers} MoE layers but only {self.num_mlp_layers} layers carry an MLP "
                              f"block, {where}, fix num_dense_layers or the layers' mlp flags")

    @property
    def layer_groups(self) -> tuple[LayerGroup, ...]:
        """The layers by kind: `layers`, or all of `attention` (CLA: the non-storing ones shared)."""
        if self.layers:
            return self.layers
        kind = "mla" if self.is_mla else "full"
        stored = LayerGroup(kind, self.num_kv_layers)
        shared = self.num_layers - self.num_kv_layers
        return (stored, LayerGroup("shared", shared)) if shared else (stored,)

    @property
    def untimed_layers(self) -> str:
        """Why the simulator cannot time these layers ('' when it can): state layers given only
        their state's bytes; `sim kv` prices them all the same."""
        if any(g.kind == "state" and not g.has_mixer_widths for g in self.layer_groups):
            return "state layers without their Mamba-2 widths (ssm_heads, ssm_head_dim, ssm_state_size)"
        return ""

    @property
    def num_state_layers(self) -> int:
        return sum(g.count for g in self.layer_groups if g.kind == "state")

    @property
    def num_attention_layers(self) -> int:
        """Layers whose mixer is attention (all but state and MLP-only layers)."""
        return sum(g.count for g in self.layer_groups if g.kind not in NO_ATTENTION)

    @property
    def num_mlp_layers(self) -> int:
        """Layers that carry an MLP block (dense or MoE); Nemotron-H's mixer layers carry none."""
        return sum(g.count for g in self.layer_groups if g.mlp or g.kind == "mlp")

    @property
    def num_dense_mlp_layers(self) -> int:
        """Layers whose MLP block is dense (not MoE)."""
        return self.num_mlp_layers - self.num_moe_layers

    @property
    def num_blocks(self) -> int:
        """Blocks of the forward pass, each followed by a norm and (under TP) an all-reduce: every
        layer's mixer (attention or state) and MLP (two a layer; Nemotron-H's layers hold one)."""
        return self.num_attention_layers + self.num_state_layers + self.num_mlp_layers

    @property
    def attention_groups(self) -> tuple[LayerGroup, ...]:
        """The layer groups, when they read different parts of the context (else ())."""
        plain = all(g.kind in PLAIN_ATTENTION for g in self.layer_groups)
        return () if plain else self.layer_groups

    def entry_bytes(self, group: LayerGroup, kv_dtype: str | None = None) -> float:
        """Bytes of one stored entry of one layer of `group` (given bytes win over the dtype)."""
        if group.entry_bytes:
            return group.entry_bytes
        if group.kind == "state":  # its state, per sequence
            return group.mamba_state_bytes()
        if group.kind in ("shared", "mlp"):
            return 0.0
        s = DTYPE_BYTES[kv_dtype or self.kv_dtype]
        if group.kind == "mla" or (group.kind in ("dsa", "compressed") and self.kv_lora_rank):
            return (self.kv_lora_rank + self.qk_rope_head_dim) * s  # one latent (pooled, if compressed)
        return 2 * self.num_kv_heads * self.head_dim * s  # K and V of every KV head

    def engine_block_size(self, block_size: int, kv_dtype: str | None = None, tensor_parallel_size: int = 1) -> int:
        """The attention block size vLLM runs: block_size, raised for state layers so that one
        attention page holds a state on one rank (sim.kv_layout.state_block_size)."""
        return state_block_size(self.layer_groups, [self.entry_bytes(g, kv_dtype) for g in self.layer_groups],
                                block_size, self.kv_replication(tensor_parallel_size))

    def kv_usage(self, tokens: int, batch: int = 1, block_size: int = 16,
                 kv_dtype: str | None = None, tensor_parallel_size: int = 1) -> list[KindUsage]:
        """Each layer group's KV for `batch` sequences of `tokens` tokens (sim.kv_layout), in one
        copy of the cache (a TP group keeps kv_replication copies; a state counts its share)."""
        groups = self.layer_groups
        copies = self.kv_replication(tensor_parallel_size)
        entries = [self.entry_bytes(g, kv_dtype) / (copies if g.kind == "state" else 1) for g in groups]
        block_size = self.engine_block_size(block_size, kv_dtype, tensor_parallel_size)
        token_page = attention_token_page(groups, entries)  # state pages pad to block_size of it
        sizes = [token_page if g.kind == "state" else e + g.indexer_entry_bytes for g, e in zip(groups, entries)]
        padded = padded_layer_counts(groups, sizes)
        return [kind_usage(g, e, tokens, batch, block_size, layers, block_size * token_page)
                for g, e, layers in zip(groups, entries, padded)]

    @property
    def is_mla(self) -> bool:
        return self.attention == "mla"

    @property
    def num_kv_layers(self) -> int:
        """Layers that store KV (CLA: every c-th; a layered model: all but shared and state)."""
        if self.layers:
            return sum(g.count for g in self.layers if g.kind not in ("shared", "state", "mlp"))
        return math.ceil(self.num_layers / self.cla_share_factor)

    @property
    def kv_elements_per_token_per_layer(self) -> int:
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, kv_dtype: str | None = None) -> float:
        """Bytes of KV cache one more token of context adds across the whole model (one copy):
        the layers that keep the whole history (a compressed layer 1/ratio of an entry and its
        indexer key); windows and states, fixed per sequence, are left out (see kv_usage)."""
        if not self.layers:
            dtype = kv_dtype or self.kv_dtype
            return self.num_kv_layers * self.kv_elements_per_token_per_layer * DTYPE_BYTES[dtype]
        total = 0.0
        for g in self.layers:
            if g.kind in ("full", "mla", "dsa", "compressed"):
                total += g.count * (self.entry_bytes(g, kv_dtype) + g.indexer_entry_bytes) / g.ratio
        return total

    def kv_replication(self, tensor_parallel_size: int) -> float:
        """How many copies of each token's KV a TP group stores (REFERENCE.md section 1).

        KV heads split across ranks when TP <= H_kv; beyond that each rank keeps a whole head, so
        heads are replicated TP / H_kv times; MLA's single latent lives on every rank.
        """
        if self.is_mla:
            return float(tensor_parallel_size)
        return max(1.0, tensor_parallel_size / self.num_kv_heads)

    @property
    def weight_bytes(self) -> float:
        if self.weight_dtype not in QUANTIZED_WEIGHTS:
            return self.num_params * DTYPE_BYTES[self.weight_dtype]
        kept = min(self.num_params, self.unquantized_params)
        return kept * DTYPE_BYTES["bf16"] + (self.num_params - kept) * DTYPE_BYTES[self.weight_dtype]

    def stored_weight_bytes(self, data_parallel_size: int = 1) -> float:
        """Weight bytes one replica stores: with data-parallel attention each rank keeps all but
        the routed experts, which are spread once over every rank (vLLM's DP + EP)."""
        routed = self.num_moe_layers * self.num_experts * self.expert_params * DTYPE_BYTES[self.weight_dtype]
        return self.weight_bytes + (data_parallel_size - 1) * (self.weight_bytes - routed)

    @property
    def unquantized_params(self) -> float:
        """Parameters a quantized checkpoint keeps in 16 bits: the embeddings and the LM head
        (vLLM's Fp8Config quantizes linear layers only, not ParallelLMHead; ModelOpt leaves lm_head
        out; one matrix where they are tied) and, in NVFP4 on MLA models, the attention layers
        (NVIDIA's DeepSeek-R1 NVFP4 checkpoints list self_attn in hf_quant_config.json's
        exclude_modules). Norms and routers are a rounding error."""
        kept = (1.0 if self.tie_word_embeddings else 2.0) * self.vocab_size * self.hidden_size
        if self.weight_dtype == "nvfp4" and self.is_mla:
            kept += self.num_attention_layers * self.attention_params_per_layer
        return kept

    # Parameters touched by one token, for FLOPs (2 per multiply-add) and weight traffic.
    @property
    def attention_params_per_layer(self) -> int:
        h, d = self.hidden_size, self.head_dim
        if self.is_mla:
            qk_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = (h * self.q_lora_rank + self.q_lora_rank * self.num_heads * qk_dim
                 if self.q_lora_rank else h * self.num_heads * qk_dim)
            kv = (h * (self.kv_lora_rank + self.qk_rope_head_dim)
                  + self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim))
            return q + kv + self.num_heads * self.v_head_dim * h
        return h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2

    @property
    def mlp_activation_widths(self) -> int:
        """Intermediate widths the MLP's activation kernel reads and writes per token: gate and up
        read, their product written (SiLU-and-mul), or up read and written (squared ReLU, GELU)."""
        return 3 if self.gated_mlp else 2

    def _mlp_params(self, intermediate: int) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden_size * intermediate

    @property
    def dense_mlp_params_per_layer(self) -> int:
        return self._mlp_params(self.intermediate_size)

    @property
    def expert_params(self) -> int:
        return self._mlp_params(self.expert_intermediate_size)

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers if self.num_experts else 0

    @property
    def active_linear_params_per_token(self) -> int:
        """Linear-layer parameters one token multiplies through (no embeddings, no LM head)."""
        dense_layers = self.num_layers - self.num_moe_layers
        moe = self.num_moe_layers * (self.num_active_experts + self.num_shared_experts) * self.expert_params
        return (self.num_layers * self.attention_params_per_layer
                + dense_layers * self.dense_mlp_params_per_layer + moe)

    def attention_dims(self, decode: bool) -> tuple[int, int]:
        """(query-key width, value width) per head, as the attention kernel sees them.

        MLA decodes with absorbed projections in the 512 + 64 latent space and prefills with the
        decompressed 192-wide keys and 128-wide values (REFERENCE.md section 1).
        """
        if self.is_mla:
            if decode:
                return self.kv_lora_rank + self.qk_rope_head_dim, self.kv_lora_rank
            return self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim
        return self.head_dim, self.head_dim


def resolve_kv_dtype(model: ModelSpec, kv_cache_dtype: str) -> str:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype '{kv_cache_dtype}' is unknown, key kv_cache_dtype, "
                          f"use one of: {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[kv_cache_dtype] or model.kv_dtype


def model_from_dict(values: dict) -> ModelSpec:
    known = set(ModelSpec.__dataclass_fields__)
    unknown = sorted(set(values) - known)
    name = values.get("name", "?")
    if unknown:
        raise ConfigError(f"unknown model field(s) {', '.join(unknown)}, model '{name}', "
                          f"use only: {', '.join(sorted(known))}")
    layers = values.get("layers") or ()
    if not isinstance(layers, (list, tuple)) or not all(isinstance(g, (dict, LayerGroup)) for g in layers):
        raise ConfigError(f"layers must be a list of layer groups ({{kind, count, ...}}), "
                          f"model '{name}', fix the model YAML")
    values = {**values, "layers": tuple(
        g if isinstance(g, LayerGroup) else layer_group(g, f"model '{name}' layers[{i}]")
        for i, g in enumerate(layers))}
    try:
        return ModelSpec(**values)
    except TypeError as exc:
        raise ConfigError(f"incomplete model spec ({exc}), model '{name}', fix the model YAML") from None


def model_from_config(node) -> ModelSpec:
    """A run's or a command's `model` node: a shipped YAML's fields, or `hf_config` (model=hf:PATH)."""
    values = node if isinstance(node, dict) else OmegaConf.to_container(node, resolve=True)
    if "hf_config" in values:
        from sim.hf_config import model_from_hf
        return model_from_hf(values["hf_config"], values.get("name"))
    return model_from_dict(values)


def model_by_name(name: str) -> ModelSpec:
    """A shipped model's name, or hf:PATH for a Hugging Face config."""
    if name.startswith("hf:"):
        from sim.hf_config import model_from_hf
        return model_from_hf(name[3:])
    return load_model(name)


def available_models() -> list[str]:
    folder = resources.files("scenarios") / "model"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml") and p.name != "hf.yaml")


def load_model(name: str) -> ModelSpec:
    """Load `scenarios/model/<name>.yaml` (used by tools that take a model by name)."""
    path = resources.files("scenarios") / "model" / f"{name}.yaml"
    if not path.is_file():
        raise UnknownNameError("model", name, available_models(), "key model")
    return model_from_dict(OmegaConf.to_container(OmegaConf.load(str(path)), resolve=True))
