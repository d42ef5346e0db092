"""ModelSpec: a frozen, architecture-neutral description of a decoder-only LLM.

Readers produce it from a Hugging Face `config.json` (through a family adapter) or from an Orbax
directory; transforms return a new one; writers turn it back into the target family's config. Every
tensor of the model, with its shape and logical axes, follows from it (`upcycler.layout`), and so do the
exact parameter counts.

- `MoESpec` describes the MoE layers: routed experts, top-k, expert width, router family, shared experts.
- `dense_layers` lists the layers that keep a dense MLP when the model is MoE (dense first layers).
- `extras` carries config fields upcycler does not interpret (token ids, dtype, …) from source to output.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

RouterKind = Literal["renormalized", "unnormalized", "sigmoid"]
ROUTER_KINDS: tuple[str, ...] = ("renormalized", "unnormalized", "sigmoid")
"""Router families: softmax→top-k→renormalise (Mixtral; Qwen with norm_topk_prob), softmax→top-k without
renormalising (Qwen defaults), sigmoid→top-k→renormalise×routed_scaling_factor (GLM-4-MoE, DeepSeek-V3)."""


@dataclass(frozen=True)
class MoESpec:
    """The MoE part of every MoE layer (all MoE layers of a model share it)."""

    num_experts: int
    top_k: int
    expert_width: int
    router: RouterKind = "renormalized"
    routed_scaling_factor: float = 1.0
    shared_width: int = 0  # width of the (fused) shared-expert MLP; 0 = no shared expert
    num_shared_experts: int = 0  # how many experts of `expert_width` the shared MLP stands for (GLM)
    shared_gated: bool = False  # Qwen2-MoE: shared output × sigmoid(shared_gate · x)
    router_bias: bool = False  # GLM-4-MoE / DeepSeek-V3: e_score_correction_bias (selection only)

    def __post_init__(self) -> None:
        if self.router not in ROUTER_KINDS:
            raise ValueError(f"router must be one of {ROUTER_KINDS}, not {self.router!r}")


@dataclass(frozen=True)
class ModelSpec:
    """Everything about a model's architecture that decides its tensors and its function."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # width of the dense MLPs
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # sorted items of the HF rope_scaling dict
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None  # per layer "full_attention" / "sliding_attention"
    moe: MoESpec | None = None
    dense_layers: tuple[int, ...] = ()  # layers that keep a dense MLP when `moe` is set
    extras: tuple[tuple[str, Any], ...] = field(default=(), compare=False)  # raw JSON values

    # --- structure -------------------------------------------------------------------------------
    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.dense_layers

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    @property
    def uses_sliding_window(self) -> bool:
        """True when some layer attends through a sliding window (Mistral-style, or per `layer_types`)."""
        if not self.sliding_window:
            return False
        return self.layer_types is None or "sliding_attention" in self.layer_types

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @property
    def extras_dict(self) -> dict[str, Any]:
        return dict(self.extras)

    def replace(self, **changes: Any) -> ModelSpec:
        return dataclasses.replace(self, **changes)

    # --- parameter counts --------------------------------------------------------------------------
    def total_params(self) -> int:
        """Exact number of parameters, counting tied embeddings once."""
        from upcycler.layout import declare_params

        return sum(p.numel for p in declare_params(self) if not p.is_buffer)

    def active_params(self) -> int:
        """Parameters used per token: everything but the routed experts, plus `top_k` routed experts."""
        from upcycler.layout import declare_params

        total = 0
        for p in declare_params(self):
            if p.is_buffer:
                continue
            if p.expert_stacked:
                total += p.numel // p.shape[0] * self.moe.top_k  # type: ignore[union-attr]
            else:
                total += p.numel
        return total

    # --- serialisation -----------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(_to_plain(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelSpec:
        data = json.loads(text)
        moe = data.pop("moe", None)
        if data.get("rope_scaling") is not None:
            data["rope_scaling"] = _freeze_items(data["rope_scaling"])
        data["extras"] = tuple(data.get("extras", {}).items())
        for key in ("layer_types", "dense_layers"):
            if data.get(key) is not None:
                data[key] = tuple(data[key])
        return cls(**data, moe=MoESpec(**moe) if moe else None)


def freeze_mapping(mapping: dict[str, Any] | None) -> tuple[tuple[str, Any], ...] | None:
    """Turn a JSON-like dict into sorted, hashable items (nested lists become tuples)."""
    if mapping is None:
        return None
    return _freeze_items(mapping)


def _freeze_items(mapping: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, _freeze(v)) for k, v in mapping.items()))


def _freeze(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return _freeze_items(value)
    return value


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        out = {}
        for f in dataclasses.fields(value):
            v = getattr(value, f.name)
            out[f.name] = dict(v) if f.name in ("rope_scaling", "extras") and v is not None else _to_plain(v)
        return out
    if isinstance(value, tuple):
        return [_to_plain(v) for v in value]
    return value
