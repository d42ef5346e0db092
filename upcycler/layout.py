"""The canonical tensors of a model: every parameter declared once with its name, shape and logical axes.

Canonical names are architecture-neutral and are what readers, transforms, writers and the JAX model all
speak (the HF names live in the family adapters). Weights keep the HF `[out, in]` orientation, so HF
round trips are byte copies. Routed experts are stacked on a leading `experts` axis; readers and writers
move them one expert at a time (`LazyTensor.part`).

    embed                              [V, D]          tied to the head when `tie_embeddings`
    layers.{i}.attn_norm               [D]
    layers.{i}.attn.{q,k,v}_proj       [H·hd, D] / [KV·hd, D]   (+ {q,k,v}_bias with `qkv_bias`)
    layers.{i}.attn.o_proj             [D, H·hd]       (+ o_bias with `o_bias`)
    layers.{i}.attn.{q,k}_norm         [hd]            with `qk_norm`
    layers.{i}.mlp_norm                [D]
    layers.{i}.mlp.{gate,up}_proj      [F, D]          dense layers (+ *_bias with `mlp_bias`)
    layers.{i}.mlp.down_proj           [D, F]
    layers.{i}.moe.router              [E, D]
    layers.{i}.moe.router_bias         [E]             sigmoid routers with a selection bias (a buffer)
    layers.{i}.moe.experts.{gate,up}_proj  [E, f, D]
    layers.{i}.moe.experts.down_proj   [E, D, f]
    layers.{i}.moe.shared.{gate,up}_proj   [Fs, D]     with a shared expert
    layers.{i}.moe.shared.down_proj    [D, Fs]
    layers.{i}.moe.shared_gate         [1, D]          gated shared expert (Qwen2-MoE)
    final_norm                         [D]
    lm_head                            [V, D]          untied only
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from math import prod
from typing import Any

from upcycler.errors import UpcyclerError
from upcycler.spec import ModelSpec


@dataclass(frozen=True)
class ParamDecl:
    """One parameter: canonical name, shape, one logical axis name per dimension, whether it is a buffer,
    and whether it is computed in float32.

    A buffer (the sigmoid router's selection bias) is stored, in float32, but not trained, and is not
    counted as a parameter; a float32 weight (the router: its logits choose the experts) is read in float32
    by the forward pass whatever dtype the other weights are read in. The declaration below is the one
    place that says which tensors are either.
    """

    name: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    is_buffer: bool = False
    computed_in_fp32: bool = False

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def expert_stacked(self) -> bool:
        """True for routed-expert weights, whose leading axis is the expert index."""
        return bool(self.axes) and self.axes[0] == "experts"


def layer_prefix(layer: int) -> str:
    return f"layers.{layer}."


def declare_params(spec: ModelSpec) -> list[ParamDecl]:
    """All parameters of `spec`, in a stable order (embedding, layers in order, final norm, head)."""
    D, V = spec.hidden_size, spec.vocab_size
    out = [ParamDecl("embed", (V, D), ("vocab", "embed"))]
    for i in range(spec.num_layers):
        out.extend(declare_layer(spec, i))
    out.append(ParamDecl("final_norm", (D,), ("norm",)))
    if not spec.tie_embeddings:
        out.append(ParamDecl("lm_head", (V, D), ("vocab", "embed")))
    return out


def declare_layer(spec: ModelSpec, layer: int) -> list[ParamDecl]:
    """The parameters of one decoder layer."""
    p = layer_prefix(layer)
    return [
        ParamDecl(p + "attn_norm", (spec.hidden_size,), ("norm",)),
        *_attention(spec, p + "attn."),
        ParamDecl(p + "mlp_norm", (spec.hidden_size,), ("norm",)),
        *(_moe(spec, p + "moe.") if spec.is_moe_layer(layer) else _dense_mlp(spec, p + "mlp.")),
    ]


def _attention(spec: ModelSpec, p: str) -> list[ParamDecl]:
    D, hd = spec.hidden_size, spec.head_dim
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd
    out = [
        ParamDecl(p + "q_proj", (q, D), ("q_heads", "embed")),
        ParamDecl(p + "k_proj", (kv, D), ("kv_heads", "embed")),
        ParamDecl(p + "v_proj", (kv, D), ("kv_heads", "embed")),
        ParamDecl(p + "o_proj", (D, q), ("embed", "q_heads")),
    ]
    if spec.qkv_bias:
        out += [
            ParamDecl(p + "q_bias", (q,), ("q_heads",)),
            ParamDecl(p + "k_bias", (kv,), ("kv_heads",)),
            ParamDecl(p + "v_bias", (kv,), ("kv_heads",)),
        ]
    if spec.o_bias:
        out.append(ParamDecl(p + "o_bias", (D,), ("embed",)))
    if spec.qk_norm:
        out += [ParamDecl(p + "q_norm", (hd,), ("norm",)), ParamDecl(p + "k_norm", (hd,), ("norm",))]
    return out


def _dense_mlp(spec: ModelSpec, p: str) -> list[ParamDecl]:
    D, F = spec.hidden_size, spec.intermediate_size
    out = [
        ParamDecl(p + "gate_proj", (F, D), ("mlp", "embed")),
        ParamDecl(p + "up_proj", (F, D), ("mlp", "embed")),
        ParamDecl(p + "down_proj", (D, F), ("embed", "mlp")),
    ]
    if spec.mlp_bias:
        out += [
            ParamDecl(p + "gate_bias", (F,), ("mlp",)),
            ParamDecl(p + "up_bias", (F,), ("mlp",)),
            ParamDecl(p + "down_bias", (D,), ("embed",)),
        ]
    return out


def _moe(spec: ModelSpec, p: str) -> list[ParamDecl]:
    moe = spec.moe
    assert moe is not None
    D, E, f = spec.hidden_size, moe.num_experts, moe.expert_width
    out = [ParamDecl(p + "router", (E, D), (None, "embed"), computed_in_fp32=True)]
    if moe.router_bias:
        out.append(ParamDecl(p + "router_bias", (E,), (None,), is_buffer=True))
    out += [
        ParamDecl(p + "experts.gate_proj", (E, f, D), ("experts", "expert_mlp", "embed")),
        ParamDecl(p + "experts.up_proj", (E, f, D), ("experts", "expert_mlp", "embed")),
        ParamDecl(p + "experts.down_proj", (E, D, f), ("experts", "embed", "expert_mlp")),
    ]
    if moe.shared_width:
        Fs = moe.shared_width
        out += [
            ParamDecl(p + "shared.gate_proj", (Fs, D), ("mlp", "embed")),
            ParamDecl(p + "shared.up_proj", (Fs, D), ("mlp", "embed")),
            ParamDecl(p + "shared.down_proj", (D, Fs), ("embed", "mlp")),
        ]
        if moe.shared_gated:
            out.append(ParamDecl(p + "shared_gate", (1, D), (None, "embed")))
    return out


def account(spec: ModelSpec, tensors: Mapping[str, Any]) -> None:
    """Refuse tensors that do not match the declared layout of `spec` exactly: a declared tensor missing or
    of another shape, or a tensor nobody declared (one a transform forgot to drop or to transform)."""
    declared = declare_params(spec)
    names = {d.name for d in declared}
    for decl in declared:
        if decl.name not in tensors:
            raise UpcyclerError(f"tensor {decl.name} of the {spec.family} model is missing: nothing produced it")
        shape = tuple(tensors[decl.name].shape)
        if shape != decl.shape:
            raise UpcyclerError(f"tensor {decl.name} has shape {shape}, the {spec.family} model declares "
                                f"{decl.shape}")
    extra = [name for name in tensors if name not in names]
    if extra:
        raise UpcyclerError(f"tensor {extra[0]} is not part of the {spec.family} model"
                            f"{f' (nor are {len(extra) - 1} more)' if len(extra) > 1 else ''}: it was neither "
                            "carried, transformed nor dropped")
