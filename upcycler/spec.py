"""ModelSpec: a frozen, architecture-neutral description of a decoder-only LLM.

Readers produce it from a Hugging Face `config.json` (through a family adapter) or from an Orbax
directory; transforms return a new one; writers turn it back into the target family's config. Every
tensor of the model, with its shape and logical axes, follows from it (`upcycler.layout`), and so do the
exact parameter counts.

- `MoESpec` describes the MoE layers: routed experts, top-k, expert width, router family, shared experts.
- `dense_layers` lists the layers that keep a dense MLP when the model is MoE (dense first layers).
- `extras` carries config fields upcycler does not interpret (token ids, dtype, …) from source to output.

A spec is valid by construction: `__post_init__` checks the type and range of every field (a real int,
not a bool, float or string; positive sizes; kv heads dividing heads; top-k within the experts; finite
floats; known strings) and that the model is not absurdly large, before anything is sized by it. Sizes
have generous limits (`LIMITS`, `MAX_PARAMS`), lifted by `UPCYCLER_LIMITS=off` for a model that really
is larger. A violation is a `SpecError`: a one-line `UpcyclerError` (and a `ValueError`) without the
file name, which the reader of the file prefixes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from upcycler.errors import UpcyclerError
from upcycler.untrusted import describe, integer, parse_json, real


class SpecError(UpcyclerError, ValueError):
    """An invalid model description (what is wrong and how to fix it); the reader adds the file's name."""


RouterKind = Literal["renormalized", "unnormalized", "sigmoid"]
ROUTER_KINDS: tuple[str, ...] = ("renormalized", "unnormalized", "sigmoid")
"""Router families: softmax→top-k→renormalise (Mixtral; Qwen with norm_topk_prob), softmax→top-k without
renormalising (Qwen defaults), sigmoid→top-k→renormalise×routed_scaling_factor (GLM-4-MoE, DeepSeek-V3)."""

LAYER_TYPES: tuple[str, ...] = ("full_attention", "sliding_attention")
ACTIVATIONS: tuple[str, ...] = (  # transformers' ACT2FN names (the families and the trainer support fewer)
    "gelu", "gelu_10", "gelu_accurate", "gelu_fast", "gelu_new", "gelu_python", "gelu_pytorch_tanh",
    "laplace", "leaky_relu", "linear", "mish", "prelu", "quick_gelu", "relu", "relu2", "relu6", "sigmoid",
    "silu", "swish", "tanh", "xielu",
)

LIMITS_ENV = "UPCYCLER_LIMITS"
# Field: (smallest valid value, limit, what the limit counts). The limits are far beyond the largest
# published models (as of 2025: ~126 layers, hidden 18,432, vocab 262,144, 128 heads of 256, MLP width
# 73,728, 384 experts, 10M positions) and catch a typo'd or hostile config before it sizes anything.
LIMITS: dict[str, tuple[int, int, str]] = {
    "vocab_size": (1, 2**24, "tokens"),
    "hidden_size": (1, 131_072, "hidden units"),
    "num_layers": (1, 2048, "layers"),
    "num_heads": (1, 4096, "attention heads"),
    "num_kv_heads": (1, 4096, "attention heads"),
    "head_dim": (1, 4096, "dimensions per head"),
    "intermediate_size": (1, 2**20, "MLP units"),
    "max_position_embeddings": (1, 2**24, "positions"),
    "sliding_window": (0, 2**24, "positions"),  # 0: no sliding window (Qwen2-MoE writes 0)
    "num_experts": (1, 65_536, "experts"),
    "top_k": (1, 65_536, "experts"),
    "expert_width": (1, 2**20, "MLP units"),
    "shared_width": (0, 2**20, "MLP units"),
    "num_shared_experts": (0, 65_536, "experts"),
}
MAX_PARAMS = 2**44  # ≈ 17.6 trillion; the largest published models have about one trillion
MAX_EXPERT_LAYERS = 2**17  # MoE layers × routed experts (Kimi K2: 60 × 384); HF stores a tensor per expert
# Float fields: each must be a finite number > 0 within (low, high); a scale is kept away from 0 and inf
# because weights are multiplied or divided by it.
POSITIVE_REALS: dict[str, tuple[float, float]] = {
    "rms_norm_eps": (0.0, 1.0), "rope_theta": (0.0, 1e300), "partial_rotary_factor": (0.0, 1.0),
    "routed_scaling_factor": (1e-6, 1e6), "rope_scaling.factor": (1e-6, 1e6),
}
_FIX = "fix the model's config"
_LIFT = f"set {LIMITS_ENV}=off if the model really is that large"


def limits_on() -> bool:
    """Whether the size limits apply (everything but `UPCYCLER_LIMITS=off`)."""
    return os.environ.get(LIMITS_ENV, "").strip().lower() != "off"


def within_limit(value: int, field: str, name: str) -> int:
    """`value`, refused when it exceeds the limit on `field` (unless UPCYCLER_LIMITS=off); `name` is what
    the message calls it (a config key or an option such as `--layers`)."""
    _, cap, unit = LIMITS[field]
    if value > cap and limits_on():
        raise SpecError(f"{name} {_count(value)} exceeds the limit of {cap:,} {unit}; {_LIFT}")
    return value


def spec_int(value: Any, name: str, field: str | None = None, *, low: int | None = None,
             high: int | None = None, fix: str = _FIX) -> int:
    """`value` as the integer field `field` (default: `name`): a real int, at least its smallest valid
    value (or `low`), at most `high`, within its limit; `name` is what the message calls it."""
    bounds = LIMITS.get(field or name)
    low = low if low is not None else bounds[0] if bounds else 1
    number = _untrusted(integer, value, name, fix, low=low, high=high)
    return within_limit(number, field or name, name) if bounds else number


def spec_real(value: Any, name: str, field: str | None = None, *, fix: str = _FIX) -> float:
    """`value` as the float field `field` (default: `name`): a finite number > 0, within its range."""
    low, high = POSITIVE_REALS[field or name]
    number = _untrusted(real, value, name, fix, low=low, high=high)
    if number <= 0:
        raise SpecError(f"{name} must be greater than 0, not {describe(value)}; {fix}")
    return number


def spec_bool(value: Any, name: str, fix: str = _FIX) -> bool:
    if not isinstance(value, bool):
        raise SpecError(f"{name} must be true or false, not {describe(value)}; {fix}")
    return value


def spec_choice(value: Any, name: str, choices: tuple[str, ...], fix: str = _FIX) -> str:
    if not isinstance(value, str) or value not in choices:
        raise SpecError(f"{name} must be one of {', '.join(choices)}, not {describe(value)}; {fix}")
    return value


def _untrusted(check: Any, value: Any, name: str, fix: str, **bounds: Any) -> Any:
    """`untrusted.integer`/`real`, its message as a SpecError without a file name (the reader adds it)."""
    try:
        return check(value, name, "", fix=fix, **bounds)
    except UpcyclerError as err:
        raise SpecError(str(err).removeprefix(": ")) from None


def _count(value: int) -> str:
    return f"{value:,}" if value.bit_length() < 128 else describe(value)


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
        for name in ("num_experts", "expert_width", "shared_width", "num_shared_experts"):
            spec_int(getattr(self, name), name)
        spec_int(self.top_k, "top_k", high=self.num_experts,
                 fix="top_k (num_experts_per_tok) cannot exceed the number of experts")
        spec_choice(self.router, "router", ROUTER_KINDS)
        spec_real(self.routed_scaling_factor, "routed_scaling_factor")
        for name in ("shared_gated", "router_bias"):
            spec_bool(getattr(self, name), name)


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

    def __post_init__(self) -> None:
        """Refuse a spec with a field of the wrong type or out of range, or a model beyond the limits.

        `family` must be a short name; whether a family of that name is registered is the registry's
        question (`upcycler.families.family_named`), asked where the spec is read or written.
        """
        if not isinstance(self.family, str) or not 0 < len(self.family) <= 64:
            raise SpecError(f"family must be a family name, not {describe(self.family)}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "intermediate_size",
                     "max_position_embeddings"):
            spec_int(getattr(self, name), name)
        spec_int(self.num_kv_heads, "num_kv_heads", high=self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise SpecError(f"num_kv_heads (num_key_value_heads) {self.num_kv_heads} does not divide "
                            f"num_heads (num_attention_heads) {self.num_heads}; {_FIX}")
        if self.sliding_window is not None:
            spec_int(self.sliding_window, "sliding_window")
        for name in ("rms_norm_eps", "rope_theta", "partial_rotary_factor"):
            spec_real(getattr(self, name), name)
        spec_choice(self.hidden_act, "hidden_act", ACTIVATIONS)
        for name in ("tie_embeddings", "qkv_bias", "o_bias", "mlp_bias", "qk_norm"):
            spec_bool(getattr(self, name), name)
        _check_rope_scaling(self.rope_scaling)
        _check_layer_types(self.layer_types, self.num_layers)
        if self.moe is not None and not isinstance(self.moe, MoESpec):
            raise SpecError(f"moe must be a mapping of MoE fields or null, not {describe(self.moe)}; {_FIX}")
        _check_dense_layers(self.dense_layers, self.num_layers)
        if not _is_items(self.extras):
            raise SpecError(f"extras must be a mapping of config fields; {_FIX}")
        self._check_size()

    def _check_size(self) -> None:
        """Refuse a model whose fields are each within their limits but whose total is not."""
        if not limits_on():
            return
        n_moe = self._num_moe_layers()
        if self.moe is not None and n_moe * self.moe.num_experts > MAX_EXPERT_LAYERS:
            raise SpecError(f"{n_moe:,} MoE layers × {self.moe.num_experts:,} experts exceeds "
                            f"the limit of {MAX_EXPERT_LAYERS:,} experts in all; {_LIFT}")
        total = self.total_params()
        if total > MAX_PARAMS:
            raise SpecError(f"the model would have {total:,} parameters, over the limit of {MAX_PARAMS:,}; "
                            f"{_LIFT}")

    # --- structure -------------------------------------------------------------------------------
    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.dense_layers

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    def _num_moe_layers(self) -> int:
        return 0 if self.moe is None else self.num_layers - len(self.dense_layers)  # distinct, in range

    @property
    def uses_sliding_window(self) -> bool:
        """True when some layer attends through a sliding window (Mistral-style, or per `layer_types`)."""
        if not self.sliding_window:
            return False
        return self.layer_types is None or "sliding_attention" in self.layer_types

    def attention_windows(self) -> tuple[int | None, ...]:
        """The window each layer attends through (None: the whole prefix): what `sliding_window` and
        `layer_types` mean together, so configs that spell the same attention differently compare equal
        (no `layer_types` with no window, or every layer "full_attention", or a window no layer uses)."""
        sliding = [self.sliding_window if self.sliding_window and
                   (self.layer_types is None or kind == "sliding_attention") else None
                   for kind in (self.layer_types or ("sliding_attention",) * self.num_layers)]
        return tuple(sliding)

    def differences(self, other: ModelSpec) -> list[str]:
        """The fields in which `other` is another model than this one: every field (`extras` too) by value,
        but `sliding_window` and `layer_types` by the attention they give each layer (`attention_windows`)."""
        attention = ("sliding_window", "layer_types")
        differ = [f.name for f in dataclasses.fields(self) if f.name not in attention
                  and getattr(self, f.name) != getattr(other, f.name)]
        if self.attention_windows() != other.attention_windows():
            differ.extend(name for name in attention if getattr(self, name) != getattr(other, name))
        return differ

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
        """Exact number of parameters, counting tied embeddings once (what `declare_params` declares,
        computed from the sizes alone, so it is instant whatever the size)."""
        return self._counts()[0]

    def active_params(self) -> int:
        """Parameters used per token: everything but the routed experts, plus `top_k` routed experts."""
        return self._counts()[1]

    def _counts(self) -> tuple[int, int]:
        """(total, active) parameters; the sigmoid router's selection bias is a buffer, not counted."""
        D, V, hd, F = self.hidden_size, self.vocab_size, self.head_dim, self.intermediate_size
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        attention = (2 * q * D + 2 * kv * D + (q + 2 * kv if self.qkv_bias else 0) + (D if self.o_bias else 0)
                     + (2 * hd if self.qk_norm else 0))
        shared = 2 * D + attention  # two norms and the attention of every layer
        dense_mlp = 3 * F * D + (2 * F + D if self.mlp_bias else 0)
        outside = V * D + D + (0 if self.tie_embeddings else V * D)  # embedding, final norm, head
        n_moe = self._num_moe_layers()
        total = active = outside + self.num_layers * shared + (self.num_layers - n_moe) * dense_mlp
        if self.moe is not None:
            m = self.moe
            gate = D if m.shared_width and m.shared_gated else 0
            always = m.num_experts * D + 3 * m.shared_width * D + gate  # router and shared expert
            expert = 3 * m.expert_width * D
            total += n_moe * (always + m.num_experts * expert)
            active += n_moe * (always + m.top_k * expert)
        return total, active

    # --- serialisation -----------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(_to_plain(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelSpec:
        """The spec `to_json` wrote; any other text is refused with a SpecError (never another exception)."""
        try:
            data = parse_json(text, "spec", _FIX)
        except UpcyclerError as err:
            raise SpecError(str(err).removeprefix("spec: ")) from None
        if not isinstance(data, dict):
            raise SpecError(f"a spec is a JSON object, not {describe(data)}; {_FIX}")
        data = dict(data)
        moe = data.pop("moe", None)
        _known_fields(cls, data, "spec")
        if moe is not None:
            if not isinstance(moe, dict):
                raise SpecError(f"moe must be a mapping of MoE fields or null, not {describe(moe)}; {_FIX}")
            _known_fields(MoESpec, moe, "moe")
        for key in ("rope_scaling", "extras"):
            if data.get(key) is not None and not isinstance(data[key], dict):
                raise SpecError(f"{key} must be a mapping, not {describe(data[key])}; {_FIX}")
        for key in ("layer_types", "dense_layers"):
            if data.get(key) is not None and not isinstance(data[key], list):
                raise SpecError(f"{key} must be a list, not {describe(data[key])}; {_FIX}")
            if data.get(key) is not None:
                data[key] = tuple(data[key])
        if data.get("rope_scaling") is not None:
            data["rope_scaling"] = _freeze_items(data["rope_scaling"])
        data["extras"] = checked_extras(data.get("extras") or {})
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in data
                   and f.default is dataclasses.MISSING and f.name != "moe"]
        if missing:
            raise SpecError(f"{missing[0]} is missing; {_FIX}")
        moe_spec = None
        if moe:
            missing = [f.name for f in dataclasses.fields(MoESpec) if f.name not in moe
                       and f.default is dataclasses.MISSING]
            if missing:
                raise SpecError(f"moe.{missing[0]} is missing; {_FIX}")
            moe_spec = MoESpec(**moe)
        return cls(**data, moe=moe_spec)


def _known_fields(cls: type, data: dict[str, Any], what: str) -> None:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in names]
    if unknown:
        raise SpecError(f"{what} has an unknown field {describe(unknown[0])}; {_FIX}")


def _check_rope_scaling(items: Any) -> None:
    """rope_scaling: sorted (key, frozen JSON value) pairs; a string type; every number finite; factor > 0."""
    if items is None:
        return
    if not _is_items(items):
        raise SpecError(f"rope_scaling must be a mapping or null, not {describe(items)}; {_FIX}")
    scaling = dict(items)
    for key in ("rope_type", "type"):
        if key in scaling and (not isinstance(scaling[key], str) or not 0 < len(scaling[key]) <= 64):
            raise SpecError(f"rope_scaling.{key} must be a short string, not {describe(scaling[key])}; "
                            f"{_FIX}")
    if "factor" in scaling and scaling["factor"] is not None:
        spec_real(scaling["factor"], "rope_scaling.factor")
    _check_finite(items, "rope_scaling")


def checked_extras(mapping: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """`extras` from the uninterpreted fields of a config: they are written into every output config.json,
    so a NaN or infinity among them (JSON `1e999` reads as one) is refused here, where they are read."""
    for key, value in mapping.items():
        _check_finite(value, key)
    return tuple(mapping.items())


def _check_finite(value: Any, name: str) -> None:
    """Refuse NaN and infinities anywhere in a JSON-like value (lists, tuples, mappings; iteratively)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, float) and not math.isfinite(item):
            raise SpecError(f"{name} holds {describe(item)}; every number must be finite; {_FIX}")


def _is_items(items: Any) -> bool:
    """Whether `items` is a frozen mapping: a tuple of (str key, value) pairs."""
    return isinstance(items, tuple) and all(
        isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) for item in items)


def _check_layer_types(types: Any, layers: int) -> None:
    if types is None:
        return
    if not isinstance(types, tuple):
        raise SpecError(f"layer_types must be a list or null, not {describe(types)}; {_FIX}")
    if len(types) != layers:
        raise SpecError(f"layer_types has {len(types):,} entries but the model has {layers:,} layers; {_FIX}")
    for kind in types:
        spec_choice(kind, "layer_types entry", LAYER_TYPES)


def _check_dense_layers(layers: Any, num_layers: int) -> None:
    if not isinstance(layers, tuple):
        raise SpecError(f"dense_layers must be a list of layers, not {describe(layers)}; {_FIX}")
    previous = -1
    for layer in layers:
        spec_int(layer, "dense_layers entry", low=previous + 1, high=num_layers - 1,
                 fix="list distinct layers of the model in increasing order")
        previous = layer


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
