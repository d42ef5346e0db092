"""MoE families: Mixtral, Qwen2-MoE, Qwen3-MoE and GLM-4-MoE (per-expert tensor names on disk).

| family    | router                          | shared expert          | dense layers            |
|-----------|---------------------------------|------------------------|-------------------------|
| mixtral   | softmax → top-k → renormalise   | none                   | none                    |
| qwen2_moe | softmax → top-k (norm_topk_prob)| one, sigmoid-gated     | `mlp_only_layers`       |
| qwen3_moe | softmax → top-k (norm_topk_prob)| none                   | `mlp_only_layers`       |
| glm4_moe  | sigmoid → top-k → renorm × rsf  | n ungated, fused       | first `first_k_dense_replace` |

Per-expert names (`experts.{e}.gate_proj`, Mixtral's `w1/w3/w2`) are what transformers v4 and v5 both load.
"""

from __future__ import annotations

from typing import Any

from upcycler.families.base import (
    Family,
    common_config_fields,
    common_spec_fields,
    config_bool,
    config_int,
    config_real,
    implied_head_dim,
    no_served_o_bias,
    read_layer_types,
    sliding_fields,
)
from upcycler.spec import ModelSpec, MoESpec, SpecError, spec_int
from upcycler.untrusted import describe

_QWEN_MOE_NAMES = {
    "moe.router": "mlp.gate.weight",
    "moe.experts.gate_proj": "mlp.experts.{e}.gate_proj.weight",
    "moe.experts.up_proj": "mlp.experts.{e}.up_proj.weight",
    "moe.experts.down_proj": "mlp.experts.{e}.down_proj.weight",
}


def _qwen_dense_layers(cfg: dict[str, Any]) -> tuple[int, ...]:
    """Layers listed in `mlp_only_layers` or skipped by `decoder_sparse_step`, which keep a dense MLP."""
    layers = config_int(cfg, "num_hidden_layers", "num_layers")
    step = config_int(cfg, "decoder_sparse_step", low=0, default=1) or 1  # as transformers: 0 = every layer
    only = [] if cfg.get("mlp_only_layers") is None else cfg["mlp_only_layers"]
    if not isinstance(only, list):
        raise SpecError(f"mlp_only_layers must be a list of layers, not {describe(only)}; fix config.json")
    listed = {spec_int(i, "mlp_only_layers entry", low=0, high=layers - 1, fix="fix config.json")
              for i in only}
    return tuple(i for i in range(layers) if i in listed or (i + 1) % step != 0)


def _num_experts(cfg: dict[str, Any]) -> int:
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if cfg.get(key) not in (None, 0):
            return config_int(cfg, key, "num_experts")
    raise SpecError("num_experts (or num_local_experts, n_routed_experts) is missing; fix config.json")


def _common_limits(spec: ModelSpec, name: str, *, qk_norm: bool | None, biases: str) -> list[str]:
    out = []
    if qk_norm is not None and spec.qk_norm != qk_norm:
        out.append(f"{name} {'always has' if qk_norm else 'has no'} q/k norms")
    if biases == "none" and (spec.qkv_bias or spec.o_bias):
        out.append(f"{name} has no attention biases")
    if biases == "qkv" and spec.o_bias:
        out.append(f"{name} has no o_proj bias")
    if biases == "qkvo" and spec.qkv_bias != spec.o_bias:
        out.append(f"{name} biases q, k, v and o together")
    if spec.mlp_bias:
        out.append(f"{name} has no MLP biases")
    return out


# --- Mixtral ---------------------------------------------------------------------------------------
def _read_mixtral(family: Family, cfg: dict[str, Any]) -> ModelSpec:
    width = config_int(cfg, "intermediate_size")
    moe = MoESpec(_num_experts(cfg), config_int(cfg, "num_experts_per_tok", "top_k"), width, "renormalized")
    return ModelSpec(family=family.name, intermediate_size=width, moe=moe,
                     sliding_window=config_int(cfg, "sliding_window", default=None),
                     **common_spec_fields(cfg))


def _write_mixtral(family: Family, spec: ModelSpec) -> dict[str, Any]:
    moe = spec.moe
    return {**common_config_fields(spec, family), "intermediate_size": moe.expert_width,
            "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
            "sliding_window": spec.sliding_window}


def _mixtral_limits(spec: ModelSpec) -> list[str]:
    out = _common_limits(spec, "Mixtral", qk_norm=False, biases="none")
    if spec.moe is not None:
        if spec.moe.router != "renormalized":
            out.append("Mixtral's router always renormalises the top-k weights")
        if spec.moe.shared_width:
            out.append("Mixtral has no shared experts")
        if spec.dense_layers:
            out.append("Mixtral has no dense layers (every layer is MoE)")
    return out


# --- Qwen2-MoE / Qwen3-MoE ---------------------------------------------------------------------------
def _read_qwen_moe(family: Family, cfg: dict[str, Any]) -> ModelSpec:
    """Qwen2-MoE (a gated shared expert; q/k/v biases) or Qwen3-MoE (q/k norms; `attention_bias`)."""
    shared = 0
    if family.shared_experts == "gated":
        shared = config_int(cfg, "shared_expert_intermediate_size", "shared_width", default=0)
    moe = MoESpec(
        _num_experts(cfg), config_int(cfg, "num_experts_per_tok", "top_k"),
        config_int(cfg, "moe_intermediate_size", "expert_width"),
        "renormalized" if config_bool(cfg, "norm_topk_prob") else "unnormalized",
        shared_width=shared, num_shared_experts=1 if shared else 0, shared_gated=bool(shared),
    )
    if family.neutral_qkv_bias:  # Qwen2-style attention: q/k/v biases, no q/k norms
        bias = {"qkv_bias": config_bool(cfg, "qkv_bias", True)}
    else:
        b = config_bool(cfg, "attention_bias")
        bias = {"qkv_bias": b, "o_bias": b, "qk_norm": True}
    return ModelSpec(family=family.name, intermediate_size=config_int(cfg, "intermediate_size"), moe=moe,
                     dense_layers=_qwen_dense_layers(cfg),
                     sliding_window=config_int(cfg, "sliding_window", default=None),
                     layer_types=read_layer_types(cfg), **bias, **common_spec_fields(cfg))


def _write_qwen_moe(family: Family, spec: ModelSpec) -> dict[str, Any]:
    moe = spec.moe
    cfg = {**common_config_fields(spec, family), "num_experts": moe.num_experts,
           "num_experts_per_tok": moe.top_k, "moe_intermediate_size": moe.expert_width,
           "norm_topk_prob": moe.router == "renormalized", "decoder_sparse_step": 1,
           "mlp_only_layers": list(spec.dense_layers), **sliding_fields(spec)}
    if family.shared_experts == "gated":
        cfg.update(shared_expert_intermediate_size=moe.shared_width)
    cfg.update({"qkv_bias" if family.neutral_qkv_bias else "attention_bias": spec.qkv_bias})
    return cfg


def _qwen2_moe_limits(spec: ModelSpec) -> list[str]:
    out = _common_limits(spec, "Qwen2-MoE", qk_norm=False, biases="qkv") + implied_head_dim(spec, "Qwen2-MoE")
    if spec.moe is not None:
        if spec.moe.router == "sigmoid":
            out.append("Qwen2-MoE's router is a softmax, not a sigmoid")
        if not (spec.moe.shared_width and spec.moe.shared_gated):
            out.append("Qwen2-MoE always has one sigmoid-gated shared expert")
    return out


def _qwen3_moe_limits(spec: ModelSpec) -> list[str]:
    out = _common_limits(spec, "Qwen3-MoE", qk_norm=True, biases="qkvo") + no_served_o_bias(spec, "Qwen3-MoE")
    if spec.moe is not None:
        if spec.moe.router == "sigmoid":
            out.append("Qwen3-MoE's router is a softmax, not a sigmoid")
        if spec.moe.shared_width:
            out.append("Qwen3-MoE has no shared experts")
    return out


# --- GLM-4-MoE -----------------------------------------------------------------------------------------
def _read_glm4_moe(family: Family, cfg: dict[str, Any]) -> ModelSpec:
    groups = config_int(cfg, "n_group", low=0, default=1), config_int(cfg, "topk_group", low=0, default=1)
    if not config_bool(cfg, "norm_topk_prob", True) or max(groups) > 1:
        raise SpecError("only GLM-4-MoE routers with norm_topk_prob true and n_group = topk_group = 1 are "
                        "supported")
    n_shared = config_int(cfg, "n_shared_experts", "num_shared_experts", default=0)
    width = config_int(cfg, "moe_intermediate_size", "expert_width")
    moe = MoESpec(
        _num_experts(cfg), config_int(cfg, "num_experts_per_tok", "top_k"), width, "sigmoid",
        routed_scaling_factor=config_real(cfg, "routed_scaling_factor", 1.0),
        shared_width=n_shared * width, num_shared_experts=n_shared, router_bias=True,
    )
    common = common_spec_fields(cfg)
    if "partial_rotary_factor" not in cfg and "partial_rotary_factor" not in (cfg.get("rope_parameters") or {}):
        common["partial_rotary_factor"] = 0.5  # transformers' Glm4MoeConfig default
    b = config_bool(cfg, "attention_bias")
    first_dense = config_int(cfg, "first_k_dense_replace", low=0, high=common["num_layers"], default=0)
    return ModelSpec(family=family.name, intermediate_size=config_int(cfg, "intermediate_size"), moe=moe,
                     qkv_bias=b, qk_norm=config_bool(cfg, "use_qk_norm"),
                     dense_layers=tuple(range(first_dense)), **common)


def _write_glm4_moe(family: Family, spec: ModelSpec) -> dict[str, Any]:
    moe = spec.moe
    return {**common_config_fields(spec, family), "n_routed_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k, "moe_intermediate_size": moe.expert_width,
            "n_shared_experts": moe.num_shared_experts, "routed_scaling_factor": moe.routed_scaling_factor,
            "norm_topk_prob": True, "n_group": 1, "topk_group": 1,
            "first_k_dense_replace": len(spec.dense_layers), "use_qk_norm": spec.qk_norm,
            "attention_bias": spec.qkv_bias, "partial_rotary_factor": spec.partial_rotary_factor,
            "num_nextn_predict_layers": 0}


def _glm4_moe_limits(spec: ModelSpec) -> list[str]:
    out = _common_limits(spec, "GLM-4-MoE", qk_norm=None, biases="qkv")
    if spec.moe is not None:
        moe = spec.moe
        if moe.router != "sigmoid":
            out.append("GLM-4-MoE's router is a sigmoid with renormalised top-k weights")
        if moe.shared_gated:
            out.append("GLM-4-MoE's shared experts are not gated")
        if moe.shared_width and moe.shared_width != moe.num_shared_experts * moe.expert_width:
            out.append("GLM-4-MoE's shared MLP is n_shared_experts × moe_intermediate_size wide")
        if spec.dense_layers != tuple(range(len(spec.dense_layers))):
            out.append("GLM-4-MoE's dense layers must be the first k layers (first_k_dense_replace)")
    return out


def _glm4_moe_serving(spec: ModelSpec) -> list[str]:
    """Measured with vLLM 0.32: the server dies on SIGFPE loading a GLM-4-MoE without a shared expert (it
    builds a shared MLP n_shared_experts × moe_intermediate_size wide, 0 neurons); transformers and the
    trainer run it, and aux-free balancing may want no shared expert."""
    if spec.moe is not None and not spec.moe.shared_width:
        return [("vLLM cannot serve this GLM-4-MoE: its GLM-4-MoE builds a shared MLP n_shared_experts × "
                 "moe_intermediate_size wide and fails on 0; transformers and `upcycle continued-pretrain` run "
                 "it, and --shared-experts 1 makes it servable")]
    return []


_GLM_NAMES = {
    **_QWEN_MOE_NAMES,
    "moe.router_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared.gate_proj": "mlp.shared_experts.gate_proj.weight",
    "moe.shared.up_proj": "mlp.shared_experts.up_proj.weight",
    "moe.shared.down_proj": "mlp.shared_experts.down_proj.weight",
}
_QWEN2_NAMES = {
    **_QWEN_MOE_NAMES,
    "moe.shared.gate_proj": "mlp.shared_expert.gate_proj.weight",
    "moe.shared.up_proj": "mlp.shared_expert.up_proj.weight",
    "moe.shared.down_proj": "mlp.shared_expert.down_proj.weight",
    "moe.shared_gate": "mlp.shared_expert_gate.weight",
}
_MIXTRAL_NAMES = {
    "moe.router": "block_sparse_moe.gate.weight",
    "moe.experts.gate_proj": "block_sparse_moe.experts.{e}.w1.weight",
    "moe.experts.up_proj": "block_sparse_moe.experts.{e}.w3.weight",
    "moe.experts.down_proj": "block_sparse_moe.experts.{e}.w2.weight",
}

MIXTRAL = Family(name="mixtral", architecture="MixtralForCausalLM", model_type="mixtral",
                 config_reader=_read_mixtral, config_writer=_write_mixtral, moe_names=_MIXTRAL_NAMES,
                 limits=_mixtral_limits, is_moe=True, auto_rank=0)
QWEN3_MOE = Family(name="qwen3_moe", architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe",
                   config_reader=_read_qwen_moe, config_writer=_write_qwen_moe, moe_names=_QWEN_MOE_NAMES,
                   limits=_qwen3_moe_limits, is_moe=True, auto_rank=1)
QWEN2_MOE = Family(name="qwen2_moe", architecture="Qwen2MoeForCausalLM", model_type="qwen2_moe",
                   config_reader=_read_qwen_moe, config_writer=_write_qwen_moe, moe_names=_QWEN2_NAMES,
                   limits=_qwen2_moe_limits, is_moe=True, shared_experts="gated", auto_rank=2,
                   neutral_qkv_bias=True)
GLM4_MOE = Family(name="glm4_moe", architecture="Glm4MoeForCausalLM", model_type="glm4_moe",
                  config_reader=_read_glm4_moe, config_writer=_write_glm4_moe, moe_names=_GLM_NAMES,
                  limits=_glm4_moe_limits, is_moe=True, sliding_window=False, default_router="sigmoid",
                  shared_experts="count", routed_scaling=True, auto_rank=3, neutral_router_bias=True,
                  partial_rotary=True, ties_embeddings=False, serving_notes=_glm4_moe_serving)
