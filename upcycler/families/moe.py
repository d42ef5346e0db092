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
    read_layer_types,
    sliding_fields,
)
from upcycler.spec import ModelSpec, MoESpec

_QWEN_MOE_NAMES = {
    "moe.router": "mlp.gate.weight",
    "moe.experts.gate_proj": "mlp.experts.{e}.gate_proj.weight",
    "moe.experts.up_proj": "mlp.experts.{e}.up_proj.weight",
    "moe.experts.down_proj": "mlp.experts.{e}.down_proj.weight",
}


def _qwen_dense_layers(cfg: dict[str, Any]) -> tuple[int, ...]:
    step = cfg.get("decoder_sparse_step", 1) or 1
    only = set(cfg.get("mlp_only_layers") or [])
    return tuple(i for i in range(cfg["num_hidden_layers"]) if i in only or (i + 1) % step != 0)


def _num_experts(cfg: dict[str, Any]) -> int:
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if cfg.get(key):
            return int(cfg[key])
    raise KeyError("num_experts")


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
def _read_mixtral(cfg: dict[str, Any]) -> ModelSpec:
    moe = MoESpec(_num_experts(cfg), cfg["num_experts_per_tok"], cfg["intermediate_size"], "renormalized")
    return ModelSpec(family="mixtral", intermediate_size=cfg["intermediate_size"], moe=moe,
                     sliding_window=cfg.get("sliding_window"), **common_spec_fields(cfg))


def _write_mixtral(spec: ModelSpec) -> dict[str, Any]:
    moe = spec.moe
    return {**common_config_fields(spec, MIXTRAL), "intermediate_size": moe.expert_width,
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
def _read_qwen_moe(cfg: dict[str, Any], family: str) -> ModelSpec:
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if family == "qwen2_moe" else 0
    moe = MoESpec(
        _num_experts(cfg), cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
        "renormalized" if cfg.get("norm_topk_prob", False) else "unnormalized",
        shared_width=shared, num_shared_experts=1 if shared else 0, shared_gated=bool(shared),
    )
    if family == "qwen2_moe":
        bias = dict(qkv_bias=bool(cfg.get("qkv_bias", True)))
    else:
        b = bool(cfg.get("attention_bias", False))
        bias = dict(qkv_bias=b, o_bias=b, qk_norm=True)
    return ModelSpec(family=family, intermediate_size=cfg["intermediate_size"], moe=moe,
                     dense_layers=_qwen_dense_layers(cfg), sliding_window=cfg.get("sliding_window"),
                     layer_types=read_layer_types(cfg), **bias, **common_spec_fields(cfg))


def _write_qwen_moe(spec: ModelSpec, family: Family) -> dict[str, Any]:
    moe = spec.moe
    cfg = {**common_config_fields(spec, family), "num_experts": moe.num_experts,
           "num_experts_per_tok": moe.top_k, "moe_intermediate_size": moe.expert_width,
           "norm_topk_prob": moe.router == "renormalized", "decoder_sparse_step": 1,
           "mlp_only_layers": list(spec.dense_layers), **sliding_fields(spec)}
    if family is QWEN2_MOE:
        cfg.update(shared_expert_intermediate_size=moe.shared_width, qkv_bias=spec.qkv_bias)
    else:
        cfg.update(attention_bias=spec.qkv_bias)
    return cfg


def _qwen2_moe_limits(spec: ModelSpec) -> list[str]:
    out = _common_limits(spec, "Qwen2-MoE", qk_norm=False, biases="qkv")
    if spec.moe is not None:
        if spec.moe.router == "sigmoid":
            out.append("Qwen2-MoE's router is a softmax, not a sigmoid")
        if not (spec.moe.shared_width and spec.moe.shared_gated):
            out.append("Qwen2-MoE always has one sigmoid-gated shared expert")
    return out


def _qwen3_moe_limits(spec: ModelSpec) -> list[str]:
    out = _common_limits(spec, "Qwen3-MoE", qk_norm=True, biases="qkvo")
    if spec.moe is not None:
        if spec.moe.router == "sigmoid":
            out.append("Qwen3-MoE's router is a softmax, not a sigmoid")
        if spec.moe.shared_width:
            out.append("Qwen3-MoE has no shared experts")
    return out


# --- GLM-4-MoE -----------------------------------------------------------------------------------------
def _read_glm4_moe(cfg: dict[str, Any]) -> ModelSpec:
    if not cfg.get("norm_topk_prob", True) or int(cfg.get("n_group") or 1) > 1 or int(cfg.get("topk_group") or 1) > 1:
        raise ValueError("only GLM-4-MoE routers with norm_topk_prob true and n_group = topk_group = 1 are supported")
    n_shared = int(cfg.get("n_shared_experts") or 0)
    width = cfg["moe_intermediate_size"]
    moe = MoESpec(
        _num_experts(cfg), cfg["num_experts_per_tok"], width, "sigmoid",
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        shared_width=n_shared * width, num_shared_experts=n_shared, router_bias=True,
    )
    common = common_spec_fields(cfg)
    if "partial_rotary_factor" not in cfg and "partial_rotary_factor" not in (cfg.get("rope_parameters") or {}):
        common["partial_rotary_factor"] = 0.5  # transformers' Glm4MoeConfig default
    b = bool(cfg.get("attention_bias", False))
    return ModelSpec(family="glm4_moe", intermediate_size=cfg["intermediate_size"], moe=moe, qkv_bias=b,
                     qk_norm=bool(cfg.get("use_qk_norm", False)),
                     dense_layers=tuple(range(int(cfg.get("first_k_dense_replace", 0)))), **common)


def _write_glm4_moe(spec: ModelSpec) -> dict[str, Any]:
    moe = spec.moe
    return {**common_config_fields(spec, GLM4_MOE), "n_routed_experts": moe.num_experts,
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

MIXTRAL = Family("mixtral", "MixtralForCausalLM", "mixtral", _read_mixtral, _write_mixtral,
                 _MIXTRAL_NAMES, _mixtral_limits, is_moe=True)
QWEN2_MOE = Family("qwen2_moe", "Qwen2MoeForCausalLM", "qwen2_moe", lambda c: _read_qwen_moe(c, "qwen2_moe"),
                   lambda s: _write_qwen_moe(s, QWEN2_MOE), _QWEN2_NAMES, _qwen2_moe_limits, is_moe=True)
QWEN3_MOE = Family("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe", lambda c: _read_qwen_moe(c, "qwen3_moe"),
                   lambda s: _write_qwen_moe(s, QWEN3_MOE), _QWEN_MOE_NAMES, _qwen3_moe_limits, is_moe=True)
GLM4_MOE = Family("glm4_moe", "Glm4MoeForCausalLM", "glm4_moe", _read_glm4_moe, _write_glm4_moe,
                  _GLM_NAMES, _glm4_moe_limits, is_moe=True, sliding_window=False)
