"""`model=hf:PATH/config.json`: a model spec from a Hugging Face config.

Families: llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe, gemma2, gemma3 (and its
text_config), gemma3n, gpt_oss, llama4 (text_config), deepseek_v2, deepseek_v3, deepseek_v32,
deepseek_v4, nemotron_h (Mamba-2 hybrids: hybrid_override_pattern's M, *, - and E layers; its
Mamba-2 widths are required, never defaulted). A field the config omits takes Transformers' default for that model type (head_dim =
hidden / heads, num_key_value_heads = heads, ...). MLA is recognised by `kv_lora_rank`. Fields that
change neither the KV size nor the step time (norm epsilons, RoPE scaling, token ids, ...) are
ignored; any other field the parser does not interpret is named on stderr, never guessed.
DeepSeek-V3.2 and V4 entries take the bytes vLLM stores (REFERENCE.md section 8).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from sim.errors import ConfigError
from sim.kv_layout import LayerGroup

# Fields that change neither KV size nor step time, in any family.
IGNORED = {
    "architectures", "auto_map", "transformers_version", "model_type", "_name_or_path", "bos_token_id",
    "eos_token_id", "pad_token_id", "initializer_range", "rms_norm_eps", "layer_norm_eps", "rope_theta",
    "rope_scaling", "rope_parameters", "rope_local_base_freq", "use_cache", "attention_dropout",
    "hidden_dropout", "attention_bias", "mlp_bias", "pretraining_tp", "hidden_act",
    "hidden_activation", "bos_token", "eos_token", "output_router_logits", "router_aux_loss_coef",
    "router_z_loss_coef", "aux_loss_alpha", "seq_aux", "norm_topk_prob", "scoring_func",
    "topk_method", "routed_scaling_factor", "n_group", "topk_group", "query_pre_attn_scalar",
    "attn_logit_softcapping", "final_logit_softcapping", "use_qk_norm", "qk_layernorm",
    "ep_size", "num_nextn_predict_layers", "image_token_index", "boi_token_index",
    "eoi_token_index", "mm_tokens_per_image", "vision_config", "vision_feature_layer",
    "vision_feature_select_strategy", "image_token_id", "initializer_factor", "tokenizer_class",
    "swiglu_limit", "attn_temperature_tuning", "floor_scale", "attn_scale", "rope_interleave",
    "attention_sink_size", "sliding_window_pattern_offset", "torch_dtype", "dtype",
    "use_sliding_window", "max_window_layers", "router_jitter_noise", "rope_type", "partial_rotary_factor",
    "sliding_window_size", "cache_implementation", "initial_context_length", "compress_rope_theta",
    "hc_eps", "hc_sinkhorn_iters", "expand", "mamba_hidden_act", "use_conv_bias", "use_bias",
    "residual_in_fp32", "rescale_prenorm_residual", "time_step_min", "time_step_max", "time_step_floor",
    "time_step_limit", "time_step_rank", "mamba_proj_bias", "layer_norm_epsilon",
}
# What each Transformers config class assumes for a field the config leaves out (read from the
# configuration_*.py files; see tests/data/hf/SOURCES.md). A field given as null keeps null.
_DEEPSEEK = {"first_k_dense_replace": 3, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
             "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256, "num_experts_per_tok": 8,
             "n_shared_experts": 1, "moe_intermediate_size": 2048, "max_position_embeddings": 4096}
DEFAULTS = {
    "llama": {"max_position_embeddings": 2048},
    "mistral": {"sliding_window": 4096, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32},
    "qwen2": {"use_sliding_window": False, "max_window_layers": 28},
    "qwen3": {"head_dim": 128, "use_sliding_window": False, "max_window_layers": 28},
    "qwen3_moe": {"use_sliding_window": False, "max_window_layers": 28},
    "gemma2": {"head_dim": 256, "num_key_value_heads": 4, "sliding_window": 4096, "tie_word_embeddings": True},
    "gemma3": {"head_dim": 256, "num_key_value_heads": 4, "sliding_window": 4096, "sliding_window_pattern": 6,
               "vocab_size": 262208, "max_position_embeddings": 131072, "tie_word_embeddings": True},
    "gemma3n": {"head_dim": 256, "sliding_window": 512, "num_kv_shared_layers": 15, "tie_word_embeddings": True},
    "gpt_oss": {"head_dim": 64, "num_key_value_heads": 8, "sliding_window": 128},
    "deepseek_v3": _DEEPSEEK,
    "deepseek_v32": {**_DEEPSEEK, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64,
                     "max_position_embeddings": 163840},
    "deepseek_v4": {"head_dim": 512, "qk_rope_head_dim": 64, "num_key_value_heads": 1, "q_lora_rank": 1024,
                    "sliding_window": 128, "index_topk": 512, "index_n_heads": 64, "index_head_dim": 128},
    "llama4": {"head_dim": 128, "num_key_value_heads": 8, "attention_chunk_size": 8192, "num_local_experts": 16,
               "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "intermediate_size_mlp": 16384},
}
DTYPES = {"bfloat16": "bf16", "float16": "fp16", None: "bf16"}  # others (float32) are named, counted BF16
V4_ENTRY_BYTES, INDEXER_ENTRY_BYTES, V32_LATENT_BYTES = 584, 132, 656  # vLLM, REFERENCE.md section 8
FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma2", "gemma3",
            "gemma3_text", "gemma3n", "gemma3n_text", "gpt_oss", "llama4", "llama4_text", "deepseek_v2",
            "deepseek_v3", "deepseek_v32", "deepseek_v4", "nemotron_h")
# hybrid_override_pattern's layer symbols (Nemotron-H): Mamba-2 mixer, attention, MLP, MoE.
NEMOTRON_H_LAYERS = {"M": "state", "*": "full", "-": "mlp", "E": "moe"}
SSM_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", None: ""}


class _Reader:
    """The config's fields, recording which were read."""

    def __init__(self, values: dict, defaults: dict):
        self.values, self.defaults, self.read = values, defaults, set()

    def get(self, key: str, default=None):
        """The config's value (null stays None); Transformers' default when the key is absent."""
        self.read.add(key)
        if key in self.values:
            return self.values[key]
        return self.defaults.get(key, default)

    def need(self, key: str, where: str):
        value = self.get(key)
        if value is None:
            raise ConfigError(f"{where} has no {key}, which a {self.values.get('model_type')} config "
                              f"needs, fix the config.json")
        return value

    def not_interpreted(self) -> list[str]:
        return sorted(set(self.values) - self.read - IGNORED)


def read_hf_config(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"no config file {path}, key model=hf:PATH, give a config.json path")
    try:
        values = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}), key model=hf:PATH, fix the file") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path} is not a JSON object, key model=hf:PATH, give a config.json")
    return values


def model_fields_from_hf(values: dict, where: str) -> tuple[dict, list[str]]:
    """ModelSpec fields (num_params left out) and the notes to say (fields not interpreted)."""
    model_type = values.get("model_type")
    text = values.get("text_config")
    if isinstance(text, dict):  # multimodal wrappers keep the language model in text_config
        values = {**{k: v for k, v in values.items() if k != "text_config"}, **text}
        model_type = text.get("model_type", model_type)
    if model_type not in FAMILIES:
        raise ConfigError(f"model_type '{model_type}' in {where} is not a family the parser reads, "
                          f"key model=hf:PATH, use one of: {', '.join(FAMILIES)}")
    family = model_type.removesuffix("_text")
    r = _Reader(values, DEFAULTS.get(family, {}))
    heads = r.need("num_attention_heads", where)
    hidden = r.need("hidden_size", where)
    fields = {
        "num_layers": r.need("num_hidden_layers", where), "hidden_size": hidden, "num_heads": heads,
        "num_kv_heads": r.get("num_key_value_heads") or heads,
        "head_dim": r.get("head_dim") or r.get("attention_head_dim") or hidden // heads,
        "intermediate_size": r.get("intermediate_size", 0) or 0, "vocab_size": r.need("vocab_size", where),
        "max_position_embeddings": r.get("max_position_embeddings", 0) or 0,
    }
    notes: list[str] = []
    fields.update(_dtypes(r, notes))
    fields.update(_moe(r, family, notes))
    if r.get("kv_lora_rank"):  # MLA: one latent per token, head_dim the value width
        fields.update(attention="mla", kv_lora_rank=r.get("kv_lora_rank"), num_kv_heads=1,
                      qk_rope_head_dim=r.get("qk_rope_head_dim"), q_lora_rank=r.get("q_lora_rank") or 0,
                      qk_nope_head_dim=r.get("qk_nope_head_dim"), v_head_dim=r.get("v_head_dim"),
                      head_dim=r.get("v_head_dim"))
    elif family == "deepseek_v4":  # one head_dim-wide latent that includes its RoPE part (K = V)
        rope = r.get("qk_rope_head_dim")
        fields.update(attention="mla", num_kv_heads=1, kv_lora_rank=fields["head_dim"] - rope,
                      qk_rope_head_dim=rope, qk_nope_head_dim=fields["head_dim"] - rope,
                      v_head_dim=fields["head_dim"], q_lora_rank=r.get("q_lora_rank") or 0, kv_dtype="fp8")
    else:
        kv = fields["num_kv_heads"]
        fields["attention"] = "mha" if kv == heads else "mqa" if kv == 1 else "gqa"
    if family in ("deepseek_v32", "deepseek_v4") or r.get("index_topk"):
        fields["kv_dtype"] = "fp8"  # vLLM's FP8 latent layout (entry bytes given per layer group)
    layers = _nemotron_h_layers(r, fields, where) if family == "nemotron_h" else _layers(r, family, fields["num_layers"], notes)
    if layers:
        fields["layers"] = layers
    fields["tie_word_embeddings"] = bool(r.get("tie_word_embeddings", False))
    for key in r.not_interpreted():
        notes.append(f"field {key} not interpreted (it may change KV size or step time)")
    return fields, notes


def _dtypes(r: _Reader, notes: list[str]) -> dict:
    dtype = r.values.get("torch_dtype", r.values.get("dtype"))
    out = {"weight_dtype": DTYPES.get(dtype, "bf16"), "kv_dtype": DTYPES.get(dtype, "bf16")}
    if dtype not in DTYPES:
        notes.append(f"torch_dtype {dtype} is not modelled: weights and KV counted in bf16")
    elif dtype is None:
        notes.append("no torch_dtype: weights and KV counted in bf16")
    quant = r.get("quantization_config")
    if isinstance(quant, dict):
        method = quant.get("quant_method")
        algo = str((quant.get("quantization") or quant).get("quant_algo") or "").upper()
        if method == "fp8":
            out["weight_dtype"] = "fp8"
            block = quant.get("weight_block_size") or [0]
            out["weight_block_size"] = int(block[0])
        elif method == "modelopt" and algo in ("NVFP4", "FP8"):  # NVIDIA ModelOpt exports, as vLLM reads them
            out["weight_dtype"] = "nvfp4" if algo == "NVFP4" else "fp8"
            notes.append(f"ModelOpt {algo} checkpoint: its exclude_modules and kv_cache_quant_algo are not read "
                         "(kv_cache_dtype sets the KV's type)")
        else:
            notes.append(f"quantization_config quant_method={method} is not modelled: weights counted "
                         f"in {out['weight_dtype']}")
    return out


def _moe(r: _Reader, family: str, notes: list[str]) -> dict:
    experts = r.get("n_routed_experts") or r.get("num_local_experts") or r.get("num_experts") or 0
    if not experts:
        return {}
    active = r.get("num_experts_per_tok") or 0
    if r.get("experts_per_token") not in (None, active):  # gpt-oss's hub file carries both
        notes.append(f"experts_per_token {r.get('experts_per_token')} differs from num_experts_per_tok "
                     f"{active}: num_experts_per_tok used")
    if family.startswith("deepseek"):
        shared, size = r.get("n_shared_experts", 0) or 0, r.get("moe_intermediate_size")
        dense = r.get("first_k_dense_replace", 0) or 0
        if (r.get("moe_layer_freq", 1) or 1) != 1:
            notes.append("moe_layer_freq != 1 is not modelled: every layer after first_k_dense_replace "
                         "counted as MoE")
    elif family.startswith("qwen"):
        size, dense = r.get("moe_intermediate_size"), len(r.get("mlp_only_layers") or [])
        shared = 1 if r.get("shared_expert_intermediate_size") else 0
        if shared and r.get("shared_expert_intermediate_size") != size:
            notes.append("shared_expert_intermediate_size differs from moe_intermediate_size: "
                         "the shared expert counted at moe_intermediate_size")
        if (r.get("decoder_sparse_step", 1) or 1) != 1:
            notes.append("decoder_sparse_step != 1 is not modelled: every layer counted as MoE")
    elif family == "nemotron_h":  # MoE on the pattern's E layers only; a shared expert of k x the routed width
        size, dense = r.get("moe_intermediate_size"), r.get("num_hidden_layers") - r.get("hybrid_override_pattern", "").count("E")
        shared_size, shared = r.get("moe_shared_expert_intermediate_size") or 0, r.get("n_shared_experts") or 0
        if shared and size and shared_size % size == 0:
            shared *= shared_size // size  # (the same FLOPs and bytes as one expert of shared_size)
        elif shared:
            notes.append("moe_shared_expert_intermediate_size is not a multiple of moe_intermediate_size: "
                         "the shared expert counted at moe_intermediate_size")
    elif family == "llama4":
        size, shared, dense = r.get("intermediate_size"), 1, 0
        step = r.get("interleave_moe_layer_step", 1) or 1
        if step != 1:
            notes.append(f"interleave_moe_layer_step={step} is not modelled: every layer counted as MoE")
        r.get("intermediate_size_mlp")  # the dense MLP of non-MoE layers: Scout has none (step 1)
    else:  # mixtral, gpt_oss: experts of intermediate_size, no shared expert
        size, shared, dense = r.get("intermediate_size"), 0, 0
    return {"num_experts": experts, "num_active_experts": active, "num_shared_experts": shared,
            "expert_intermediate_size": size or 0, "num_dense_layers": dense}


def _layers(r: _Reader, family: str, n: int, notes: list[str]) -> tuple[LayerGroup, ...]:
    """Per-layer kinds, in runs of equal kind collapsed to counts by kind."""
    kinds = _layer_kinds(r, family, n, notes)
    if kinds is None:
        return ()
    window = r.get("sliding_window")
    groups: dict[str, int] = {}
    for kind in kinds:
        groups[kind] = groups.get(kind, 0) + 1
    if family == "deepseek_v4":
        return tuple(_v4_group(kind, count, r) for kind, count in groups.items())
    if family in ("deepseek_v32",) or (family == "deepseek_v3" and r.get("index_topk")):
        return (LayerGroup("dsa", n, top_k=r.get("index_topk"), entry_bytes=V32_LATENT_BYTES,
                           indexer_entry_bytes=INDEXER_ENTRY_BYTES, indexer_heads=r.get("index_n_heads", 64),
                           indexer_head_dim=r.get("index_head_dim", 128)),)
    chunk = r.get("attention_chunk_size")
    out = []
    for kind, count in groups.items():
        size = chunk if kind == "chunked" else window if kind in ("sliding", "shared-sliding") else 0
        out.append(LayerGroup(kind.removesuffix("-sliding"), count, window=size or 0))
    return tuple(out)


def _nemotron_h_layers(r: _Reader, fields: dict, where: str) -> tuple[LayerGroup, ...]:
    """Nemotron-H's layers, one block each (hybrid_override_pattern: M Mamba-2, * attention, - MLP,
    E MoE), by kind in order of first appearance; no mixer layer has an MLP. Its MLPs are squared
    ReLU, not gated."""
    pattern = r.need("hybrid_override_pattern", where)
    if len(pattern) != fields["num_layers"] or set(pattern) - set(NEMOTRON_H_LAYERS):
        raise ConfigError(f"hybrid_override_pattern in {where} must have one of M, *, -, E per layer "
                          f"({fields['num_layers']}), fix the config.json")
    fields["gated_mlp"] = r.get("mlp_hidden_act", "relu2") not in ("relu2", "relu")
    dtype = r.get("mamba_ssm_cache_dtype")
    if dtype not in SSM_DTYPES:
        raise ConfigError(f"mamba_ssm_cache_dtype {dtype} in {where} is not float32, bfloat16 or float16, "
                          f"fix the config.json")
    counts: dict[str, int] = {}
    for symbol in pattern:
        kind = NEMOTRON_H_LAYERS[symbol]
        counts["mlp" if kind == "moe" else kind] = counts.get("mlp" if kind == "moe" else kind, 0) + 1
    widths = dict(ssm_heads=r.need("mamba_num_heads", where), ssm_head_dim=r.need("mamba_head_dim", where),
                  ssm_state_size=r.need("ssm_state_size", where), ssm_groups=r.need("n_groups", where),
                  conv_kernel=r.need("conv_kernel", where), ssm_chunk=r.need("chunk_size", where),
                  ssm_state_dtype=SSM_DTYPES[dtype])
    return tuple(LayerGroup(kind, count, mlp=kind == "mlp", **(widths if kind == "state" else {}))
                 for kind, count in counts.items())


def _layer_kinds(r: _Reader, family: str, n: int, notes: list[str]) -> list[str] | None:
    types = r.get("layer_types")
    if family == "deepseek_v4":
        ratios = list(r.get("compress_ratios") or [])[:n]
        if len(ratios) < n:
            raise ConfigError(f"compress_ratios has {len(ratios)} entries for {n} layers, fix the config.json")
        return [{0: "window", 4: "csa", 128: "hca"}.get(int(x), f"ratio{int(x)}") for x in ratios]
    if family == "deepseek_v32" or (family == "deepseek_v3" and r.get("index_topk")):
        return ["dsa"] * n
    if family.startswith("deepseek"):
        return None
    shared_tail = r.get("num_kv_shared_layers", 0) or 0
    if types:
        kinds = ["sliding" if t == "sliding_attention" else "chunked" if t == "chunked_attention" else
                 "full" if t == "full_attention" else t for t in types[:n]]
    elif family == "gemma2":
        kinds = ["sliding" if i % 2 == 0 else "full" for i in range(n)]
    elif family == "gemma3":
        pattern = r.get("sliding_window_pattern")
        kinds = ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(n)]
    elif family == "gemma3n":
        kinds = ["full" if (i + 1) % 5 == 0 else "sliding" for i in range(n)]
    elif family == "gpt_oss":
        kinds = ["sliding" if (i + 1) % 2 else "full" for i in range(n)]
    elif family == "llama4":
        rope = r.get("no_rope_layers") or [int((i + 1) % 4 != 0) for i in range(n)]
        kinds = ["chunked" if rope[i] else "full" for i in range(n)] if r.get("attention_chunk_size") else None
    elif family in ("mistral", "mixtral") and r.get("sliding_window"):
        kinds = ["sliding"] * n
    elif family.startswith("qwen"):  # Transformers drops sliding_window unless use_sliding_window
        window, below = r.get("sliding_window"), r.get("max_window_layers")
        sliding = r.get("use_sliding_window") and window
        kinds = ["full" if i < below else "sliding" for i in range(n)] if sliding else None
    else:
        kinds = None
    unknown = sorted({k for k in kinds or () if k not in ("full", "sliding", "chunked")})
    if unknown:
        raise ConfigError(f"layer_types {', '.join(unknown)} are not modelled, fix the config.json or "
                          f"write the model's layers by hand in a model YAML")
    if shared_tail:  # Gemma 3n: the last layers read the last earlier layer of their own type
        kinds = list(kinds or ["full"] * n)
        kinds[n - shared_tail:] = ["shared-sliding" if k == "sliding" else "shared" for k in kinds[n - shared_tail:]]
    return kinds


def _v4_group(kind: str, count: int, r: _Reader) -> LayerGroup:
    window = r.get("sliding_window")
    layout = dict(entry_bytes=V4_ENTRY_BYTES, block_tokens=256, page_align=576, window_block_tokens=64)
    if kind == "window":  # in the window cache's 64-token blocks
        return LayerGroup("sliding", count, window=window, entry_bytes=V4_ENTRY_BYTES, block_tokens=64,
                          page_align=576)
    if kind == "csa":
        return LayerGroup("compressed", count, window=window, ratio=4, top_k=r.get("index_topk"),
                          indexer_entry_bytes=INDEXER_ENTRY_BYTES, indexer_heads=r.get("index_n_heads", 64),
                          indexer_head_dim=r.get("index_head_dim", 128), **layout)
    if kind == "hca":
        return LayerGroup("compressed", count, window=window, ratio=128, **layout)
    raise ConfigError(f"compress_ratios entry {kind.removeprefix('ratio')} is not 0, 4 or 128, "
                      f"fix the config.json")


def estimated_params(spec, tied_embeddings: bool) -> float:
    """Parameters from the shapes: embeddings (and an untied LM head), attention, MLP or experts
    with their router; norms and biases left out."""
    h = spec.hidden_size
    experts = spec.num_moe_layers * ((spec.num_experts + spec.num_shared_experts) * spec.expert_params
                                     + h * spec.num_experts)
    dense = spec.num_dense_mlp_layers * spec.dense_mlp_params_per_layer
    embeddings = (1 if tied_embeddings else 2) * spec.vocab_size * h
    mamba = sum(g.count * (h * (2 * g.ssm_inner + 2 * g.ssm_groups * g.ssm_state_size + g.ssm_heads)
                           + g.ssm_inner * h + g.conv_kernel * g.conv_channels())
                for g in spec.layer_groups if g.kind == "state")  # in_proj, out_proj, conv
    return embeddings + spec.num_attention_layers * spec.attention_params_per_layer + dense + experts + mamba


def model_from_hf(path: str, name: str | None = None, quiet: bool = False):
    import dataclasses

    from sim.models import model_from_dict

    values = read_hf_config(path)
    fields, notes = model_fields_from_hf(values, path)
    tied = fields["tie_word_embeddings"]
    file = Path(path)
    label = name or f"hf:{file.parent.name if file.name == 'config.json' else file.stem}"
    spec = model_from_dict({"name": label, "num_params": 0.0, "source": f"Hugging Face config {path}",
                            **fields})
    spec = dataclasses.replace(spec, num_params=estimated_params(spec, tied))
    if not quiet:
        for note in notes:
            print(f"note: {path}: {note}", file=sys.stderr)
    return spec
