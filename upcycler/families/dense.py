"""Dense families: Llama, Mistral, Qwen2 and Qwen3 (same tensor names; they differ in biases and norms).

- Llama: `attention_bias` puts biases on q, k, v **and** o; `mlp_bias` on the MLP.
- Mistral: no biases; `sliding_window`.
- Qwen2: q/k/v biases always, no o bias; per-layer `layer_types`.
- Qwen3: per-head q/k RMSNorm; `attention_bias` on q, k, v and o; explicit `head_dim`.
"""

from __future__ import annotations

from typing import Any

from upcycler.families.base import (
    Family,
    common_config_fields,
    common_spec_fields,
    config_bool,
    config_int,
    implied_head_dim,
    no_served_o_bias,
    read_layer_types,
    sliding_fields,
)
from upcycler.spec import ModelSpec


def _read_llama(family: Family, cfg: dict[str, Any]) -> ModelSpec:
    bias = config_bool(cfg, "attention_bias")
    return ModelSpec(
        family=family.name, intermediate_size=config_int(cfg, "intermediate_size"), qkv_bias=bias, o_bias=bias,
        mlp_bias=config_bool(cfg, "mlp_bias"), **common_spec_fields(cfg),
    )


def _write_llama(family: Family, spec: ModelSpec) -> dict[str, Any]:
    return {**common_config_fields(spec, family), "attention_bias": spec.qkv_bias, "mlp_bias": spec.mlp_bias}


def _llama_limits(spec: ModelSpec) -> list[str]:
    out = []
    if spec.qkv_bias != spec.o_bias:
        out.append("Llama biases q, k, v and o together; this model has q/k/v biases without an o bias")
    if spec.qk_norm:
        out.append("Llama has no q/k norms")
    return out


def _read_mistral(family: Family, cfg: dict[str, Any]) -> ModelSpec:
    return ModelSpec(
        family=family.name, intermediate_size=config_int(cfg, "intermediate_size"),
        sliding_window=config_int(cfg, "sliding_window", default=None),
        **common_spec_fields(cfg),
    )


def _write_mistral(family: Family, spec: ModelSpec) -> dict[str, Any]:
    return {**common_config_fields(spec, family), "sliding_window": spec.sliding_window}


def _mistral_limits(spec: ModelSpec) -> list[str]:
    out = []
    if spec.qkv_bias or spec.o_bias or spec.mlp_bias:
        out.append("Mistral has no biases")
    if spec.qk_norm:
        out.append("Mistral has no q/k norms")
    return out


def _read_qwen2(family: Family, cfg: dict[str, Any]) -> ModelSpec:
    return ModelSpec(
        family=family.name, intermediate_size=config_int(cfg, "intermediate_size"), qkv_bias=True,
        sliding_window=config_int(cfg, "sliding_window", default=None), layer_types=read_layer_types(cfg),
        **common_spec_fields(cfg),
    )


def _write_qwen2(family: Family, spec: ModelSpec) -> dict[str, Any]:
    return {**common_config_fields(spec, family), **sliding_fields(spec)}


def _qwen2_limits(spec: ModelSpec) -> list[str]:
    out = []
    if spec.o_bias or spec.mlp_bias:
        out.append("Qwen2 has no o_proj or MLP biases")
    if spec.qk_norm:
        out.append("Qwen2 has no q/k norms")
    return out + implied_head_dim(spec, "Qwen2")


def _read_qwen3(family: Family, cfg: dict[str, Any]) -> ModelSpec:
    bias = config_bool(cfg, "attention_bias")
    return ModelSpec(
        family=family.name, intermediate_size=config_int(cfg, "intermediate_size"), qkv_bias=bias, o_bias=bias,
        qk_norm=True, sliding_window=config_int(cfg, "sliding_window", default=None),
        layer_types=read_layer_types(cfg), **common_spec_fields(cfg),
    )


def _write_qwen3(family: Family, spec: ModelSpec) -> dict[str, Any]:
    return {**common_config_fields(spec, family), "attention_bias": spec.qkv_bias, **sliding_fields(spec)}


def _qwen3_limits(spec: ModelSpec) -> list[str]:
    out = []
    if not spec.qk_norm:
        out.append("Qwen3 always has q/k norms; this model has none")
    if spec.qkv_bias != spec.o_bias or spec.mlp_bias:
        out.append("Qwen3 biases q, k, v and o together and has no MLP bias")
    return out + no_served_o_bias(spec, "Qwen3")


LLAMA = Family(name="llama", architecture="LlamaForCausalLM", model_type="llama", config_reader=_read_llama,
               config_writer=_write_llama, limits=_llama_limits, sliding_window=False)
MISTRAL = Family(name="mistral", architecture="MistralForCausalLM", model_type="mistral",
                 config_reader=_read_mistral, config_writer=_write_mistral, limits=_mistral_limits)
QWEN2 = Family(name="qwen2", architecture="Qwen2ForCausalLM", model_type="qwen2", config_reader=_read_qwen2,
               config_writer=_write_qwen2, limits=_qwen2_limits, neutral_qkv_bias=True)
QWEN3 = Family(name="qwen3", architecture="Qwen3ForCausalLM", model_type="qwen3", config_reader=_read_qwen3,
               config_writer=_write_qwen3, limits=_qwen3_limits)
