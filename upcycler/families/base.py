"""What every Hugging Face family adapter is: config fields in, config fields out, and a name table.

An adapter turns a `config.json` into a `ModelSpec` and back, maps each canonical tensor name
(`upcycler.layout`) to the family's on-disk names, and says which specs it cannot hold exactly. The
attention, norm and embedding names are shared by every supported family and live here; an adapter
only adds its MLP/MoE names and config fields.

Adapters read config.json fields through `config_int` / `config_real` / `config_bool` /
`config_mapping`, which check each value's type and range (with the config's own key in the message)
before it is used in any arithmetic; a bad field is a `SpecError`, which the reader prefixes with the
file. `null` means "not set" for every optional field, as in transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from upcycler.layout import ParamDecl
from upcycler.spec import (
    ModelSpec,
    RouterKind,
    SpecError,
    checked_extras,
    freeze_mapping,
    spec_bool,
    spec_int,
    spec_real,
)
from upcycler.untrusted import describe

# canonical suffix (after "layers.{i}.") -> HF suffix (after "model.layers.{i}.")
SHARED_LAYER_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "attn.q_proj": "self_attn.q_proj.weight",
    "attn.k_proj": "self_attn.k_proj.weight",
    "attn.v_proj": "self_attn.v_proj.weight",
    "attn.o_proj": "self_attn.o_proj.weight",
    "attn.q_bias": "self_attn.q_proj.bias",
    "attn.k_bias": "self_attn.k_proj.bias",
    "attn.v_bias": "self_attn.v_proj.bias",
    "attn.o_bias": "self_attn.o_proj.bias",
    "attn.q_norm": "self_attn.q_norm.weight",
    "attn.k_norm": "self_attn.k_norm.weight",
    "mlp.gate_proj": "mlp.gate_proj.weight",
    "mlp.up_proj": "mlp.up_proj.weight",
    "mlp.down_proj": "mlp.down_proj.weight",
    "mlp.gate_bias": "mlp.gate_proj.bias",
    "mlp.up_bias": "mlp.up_proj.bias",
    "mlp.down_bias": "mlp.down_proj.bias",
}
TOP_LEVEL_NAMES = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}

# Config fields we interpret; everything else in config.json is carried through as `extras`.
_INTERPRETED = {
    "architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps", "rope_theta", "rope_scaling",
    "rope_parameters", "partial_rotary_factor", "max_position_embeddings", "hidden_act", "tie_word_embeddings",
    "attention_bias", "mlp_bias", "qkv_bias", "sliding_window", "use_sliding_window", "max_window_layers",
    "layer_types", "num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok",
    "moe_intermediate_size", "norm_topk_prob", "shared_expert_intermediate_size", "n_shared_experts",
    "routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace", "mlp_only_layers",
    "decoder_sparse_step", "use_qk_norm", "num_nextn_predict_layers", "transformers_version",
    "torch_dtype", "dtype", "id2label", "label2id", "output_router_logits",
}
# Config fields about how the source's weights were stored, not about the model: upcycler reads and writes
# plain floating-point tensors, so an output never carries them (a GGUF-dequantised save keeps
# `quantization_config`, and transformers would then treat our float weights as quantized).
_STORAGE_ONLY = {"quantization_config"}


SharedExperts = Literal["none", "gated", "count"]


@dataclass(frozen=True)
class Family:
    """One Hugging Face architecture: its names, its config mapping, its limits and its MoE facts.

    Everything a transform or the registry needs to know about a family is a field here, so adding a
    family never changes a transform: `default_router`, `shared_experts`, `routed_scaling` and
    `auto_rank` say how `dense-to-moe` builds an MoE for it; `neutral_qkv_bias` and `neutral_router_bias`
    name the function-neutral zero tensors `conform` adds when writing it, and `ties_embeddings` whether a
    tied output head is written as a copy instead; `rope_scalings` which RoPE scalings `context` may write;
    `serving_notes` what a serving engine cannot load that the rest runs.
    """

    name: str
    architecture: str
    model_type: str
    config_reader: Callable[[Family, dict[str, Any]], ModelSpec]  # config.json -> spec (family = self.name)
    config_writer: Callable[[Family, ModelSpec], dict[str, Any]]  # spec -> config.json
    moe_names: dict[str, str] = field(default_factory=dict)  # canonical MoE suffix -> HF suffix ({e} = expert)
    limits: Callable[[ModelSpec], list[str]] = lambda spec: []
    is_moe: bool = False
    sliding_window: bool = True  # whether the family can express sliding-window attention
    default_router: RouterKind = "renormalized"  # the router the family computes exactly (MoE only)
    # how S shared shards are stored: "none" (no shared expert), "gated" (fused into one sigmoid-gated
    # expert, Qwen2-MoE) or "count" (S ungated experts of the routed width, fused; GLM-4-MoE)
    shared_experts: SharedExperts = "none"
    routed_scaling: bool = False  # whether the config holds a routed_scaling_factor
    auto_rank: int | None = None  # MoE families: place in `--target auto` (lowest first; None: never)
    neutral_qkv_bias: bool = False  # always stores q/k/v biases: zeros are added to a model without any
    neutral_router_bias: bool = False  # sigmoid router with a selection bias: zeros are added when missing
    # whether the serving engines' implementations honour tie_word_embeddings; False: a tied model is
    # written with an explicit lm_head (a copy of the embedding) and tie_word_embeddings false (vLLM's
    # Glm4MoeForCausalLM always builds its own lm_head)
    ties_embeddings: bool = True
    partial_rotary: bool = False  # whether the config can say that rope turns only part of each head
    # the `rope_scaling` types (rope_type) that both transformers (`ROPE_INIT_FUNCTIONS`, through the
    # family's rotary embedding) and vLLM (`get_rope`) load for this family
    rope_scalings: tuple[str, ...] = ("linear", "dynamic", "yarn", "longrope", "llama3")
    # what a serving engine cannot do with a model of this family that transformers and the trainer run:
    # one line each, reported by the transforms that write such a model
    serving_notes: Callable[[ModelSpec], list[str]] = lambda spec: []

    def read_config(self, cfg: dict[str, Any]) -> ModelSpec:
        """The spec a config.json of this family describes (its fields checked; see the module doc)."""
        return self.config_reader(self, cfg)

    def write_config(self, spec: ModelSpec) -> dict[str, Any]:
        """The config.json of `spec`, which this family holds (see `cannot_hold`)."""
        return self.config_writer(self, spec)

    def hf_names(self, decl: ParamDecl) -> list[str]:
        """On-disk names of one canonical parameter: one name, or one per expert for stacked experts."""
        if decl.name in TOP_LEVEL_NAMES:
            return [TOP_LEVEL_NAMES[decl.name]]
        _, layer, suffix = decl.name.split(".", 2)
        prefix = f"model.layers.{layer}."
        if suffix in SHARED_LAYER_NAMES:
            return [prefix + SHARED_LAYER_NAMES[suffix]]
        template = self.moe_names[suffix]
        if decl.expert_stacked:
            return [prefix + template.format(e=e) for e in range(decl.shape[0])]
        return [prefix + template]

    def cannot_hold(self, spec: ModelSpec) -> list[str]:
        """Reasons this family cannot represent `spec` exactly (empty when it can)."""
        reasons = list(self.limits(spec))
        if self.is_moe and spec.moe is None:
            reasons.append(f"{self.architecture} needs MoE layers; this model is dense")
        if not self.is_moe and spec.moe is not None:
            reasons.append(f"{self.architecture} is dense; this model has MoE layers")
        if spec.partial_rotary_factor != 1.0 and not self.partial_rotary:
            reasons.append(f"{self.architecture} as written here rotates every channel of a head (this model's "
                           f"partial_rotary_factor is {spec.partial_rotary_factor:g})")
        if spec.uses_sliding_window and not self.sliding_window:
            reasons.append(f"{self.architecture} has no sliding-window attention")
        if spec.hidden_act != "silu":
            reasons.append(f"hidden_act {describe(spec.hidden_act)} is not supported (only silu)")
        return reasons


_FIX = "fix config.json"
_REQUIRED: Any = object()


def config_int(cfg: dict[str, Any], key: str, field: str | None = None, *, default: Any = _REQUIRED,
               low: int | None = None, high: int | None = None) -> Any:
    """The integer `cfg[key]`, checked as the spec field `field` (default: `key`; see `spec_int`);
    `default` when it is missing or null (a required field has none)."""
    value = cfg.get(key)
    if value is None:
        if default is _REQUIRED:
            raise SpecError(f"{key} is {'missing' if key not in cfg else 'null'}; {_FIX}")
        return default
    return spec_int(value, key, field or key, low=low, high=high, fix=_FIX)


def config_real(cfg: dict[str, Any], key: str, default: float, field: str | None = None) -> float:
    """The positive finite number `cfg[key]` (see `spec_real`), or `default` when missing or null."""
    value = cfg.get(key)
    return default if value is None else spec_real(value, key, field or key, fix=_FIX)


def config_bool(cfg: dict[str, Any], key: str, default: bool = False) -> bool:
    """`cfg[key]`, which must be true or false, or `default` when missing or null."""
    value = cfg.get(key)
    return default if value is None else spec_bool(value, key, fix=_FIX)


def config_mapping(cfg: dict[str, Any], key: str) -> dict[str, Any] | None:
    """`cfg[key]`, which must be a mapping (or missing or null: None)."""
    value = cfg.get(key)
    if value is not None and not isinstance(value, dict):
        raise SpecError(f"{key} must be a mapping or null, not {describe(value)}; {_FIX}")
    return value


def common_spec_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The attention/embedding/norm fields every supported family shares, read from config.json."""
    hidden = config_int(cfg, "hidden_size")
    heads = config_int(cfg, "num_attention_heads", "num_heads")
    rope = dict(config_mapping(cfg, "rope_parameters") or {})  # transformers v5 keeps theta etc. here
    theta = _rope_field(cfg, rope, "rope_theta", 10000.0)
    partial = _rope_field(cfg, rope, "partial_rotary_factor", 1.0)
    scaling = config_mapping(cfg, "rope_scaling") or None
    if not scaling and rope.get("rope_type", "default") != "default":
        scaling = rope
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    hidden_act = cfg.get("hidden_act")
    return {
        "vocab_size": config_int(cfg, "vocab_size"),
        "hidden_size": hidden,
        "num_layers": config_int(cfg, "num_hidden_layers", "num_layers"),
        "num_heads": heads,
        "num_kv_heads": config_int(cfg, "num_key_value_heads", "num_kv_heads", default=heads),
        "head_dim": config_int(cfg, "head_dim", low=0, default=0) or hidden // heads,  # 0: unset, as in HF
        "rms_norm_eps": config_real(cfg, "rms_norm_eps", 1e-6),
        "rope_theta": theta,
        "rope_scaling": freeze_mapping(scaling),
        "partial_rotary_factor": partial,
        "max_position_embeddings": config_int(cfg, "max_position_embeddings", default=2048),
        "hidden_act": "silu" if hidden_act is None else hidden_act,
        "tie_embeddings": config_bool(cfg, "tie_word_embeddings"),
        "extras": checked_extras({k: v for k, v in cfg.items() if k not in _INTERPRETED | _STORAGE_ONLY}),
    }


def _rope_field(cfg: dict[str, Any], rope: dict[str, Any], key: str, default: float) -> float:
    """`key` from config.json, else from `rope` (rope_parameters, which loses it), else `default`."""
    nested = rope.pop(key, None)
    return config_real({key: cfg[key] if cfg.get(key) is not None else nested}, key, default)


def common_config_fields(spec: ModelSpec, family: Family | str, model_type: str | None = None) -> dict[str, Any]:
    """config.json fields shared by every family; legacy rope keys so transformers v4 reads them too."""
    arch = family.architecture if isinstance(family, Family) else family
    cfg: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type or (family.model_type if isinstance(family, Family) else None),
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": spec.rope_scaling_dict,
        "max_position_embeddings": spec.max_position_embeddings,
        "hidden_act": spec.hidden_act,
        "tie_word_embeddings": spec.tie_embeddings,
    }
    for key, value in spec.extras:  # token ids, dropout, init range, … carried from the source
        cfg.setdefault(key, value)
    return cfg


def sliding_fields(spec: ModelSpec) -> dict[str, Any]:
    """Qwen2/3-style sliding-window fields, consistent with the per-layer `layer_types`."""
    out: dict[str, Any] = {"sliding_window": spec.sliding_window}
    if spec.layer_types is not None:
        out["layer_types"] = list(spec.layer_types)
        out["use_sliding_window"] = "sliding_attention" in spec.layer_types
    return out


def read_layer_types(cfg: dict[str, Any]) -> tuple[str, ...] | None:
    """The per-layer attention kinds (checked by the spec: known kinds, one per layer), or None."""
    types = cfg.get("layer_types")
    if types is not None and not isinstance(types, list):
        raise SpecError(f"layer_types must be a list or null, not {describe(types)}; {_FIX}")
    return tuple(types) if types else None


def implied_head_dim(spec: ModelSpec, name: str) -> list[str]:
    """The limit of a family whose serving implementations ignore `head_dim` (vLLM's Qwen2 and Qwen2-MoE
    compute hidden_size / num_attention_heads)."""
    implied = spec.hidden_size // spec.num_heads
    if spec.head_dim == implied:
        return []
    return [(f"vLLM's {name} takes head_dim as hidden_size / num_attention_heads = {implied}, and this model's "
            f"is {spec.head_dim}")]


def no_served_o_bias(spec: ModelSpec, name: str) -> list[str]:
    """The limit of a family whose `attention_bias` biases o_proj in transformers but not in vLLM (Qwen3,
    Qwen3-MoE): the two would compute different functions as soon as that bias is not zero."""
    if not spec.o_bias:
        return []
    return [(f"{name}'s attention_bias biases o_proj in transformers and not in vLLM, so its attention biases "
            "cannot be served")]


def no_limits(spec: ModelSpec) -> list[str]:
    return []
