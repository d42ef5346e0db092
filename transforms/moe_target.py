"""Which Hugging Face MoE family an upcycled model is written as, and how it is fitted to it.

Each target family holds a different MoE: Mixtral (no shared experts, no dense layers), Qwen3-MoE (no
shared experts; q/k norms), Qwen2-MoE (one sigmoid-gated shared expert; q/k/v biases), GLM-4-MoE
(sigmoid router, ungated shared experts, dense first layers). `choose_target` builds the MoE spec the
request implies for each candidate from the family's own facts (`Family.default_router`,
`shared_experts`, `routed_scaling`) and asks the family adapter (`Family.cannot_hold`) whether it can hold
it exactly; `auto` takes the first that can, in the order of `auto_order()` (`Family.auto_rank`). No
family is named here: a registered family is a target without any change to this module.

When the family cannot hold the *attention* of the source (q/k norms, biases), `--allow-approximate`
lets `fit_attention` change it the least it can: zero biases are added (exact), biases the family lacks
are dropped and q/k norms are dropped or inserted (these change the function: `approximate_attention`
fits inserted norms on calibration data, measures the change and refuses it when poor).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from upcycler.errors import UpcyclerError
from upcycler.families import Family, auto_order, conform_spec, family_named
from upcycler.layout import layer_prefix
from upcycler.spec import ModelSpec, MoESpec
from upcycler.tensors import LazyTensor, TensorMap, ones, zeros


@dataclass(frozen=True)
class MoERequest:
    """What the user asked for (upcycling-math §1): N routed experts of width f, top-K, S shared shards."""

    num_experts: int  # N
    top_k: int  # K
    expert_width: int  # f = F / G
    shared_shards: int  # S
    dense_layers: tuple[int, ...]
    router: str | None  # None: the family's exact default
    routed_scaling_factor: float


@dataclass(frozen=True)
class Target:
    """The chosen family, the spec written for it, and the attention changes made to fit it."""

    family: Family
    spec: ModelSpec
    attention: tuple[tuple[str, bool], ...] = ()  # (attention property, its new value)
    lossy: tuple[str, ...] = ()  # what the attention changes lose, for the report


def moe_spec(request: MoERequest, family: Family) -> MoESpec:
    """The MoESpec `family` stores for `request` (shared shards: one gated expert or S ungated ones)."""
    r = request
    shared = r.shared_shards * r.expert_width
    gated = family.shared_experts == "gated"
    return MoESpec(
        num_experts=r.num_experts, top_k=r.top_k, expert_width=r.expert_width,
        router=r.router or family.default_router,  # type: ignore[arg-type]
        routed_scaling_factor=r.routed_scaling_factor if family.routed_scaling else 1.0,
        shared_width=shared,
        num_shared_experts=(1 if shared else 0) if gated else r.shared_shards,
        shared_gated=gated and bool(shared),
    )


def candidate(source: ModelSpec, request: MoERequest, family: Family) -> ModelSpec:
    """`source` with the MoE `family` would store for `request` (not yet checked against its limits)."""
    return source.replace(family=family.name, moe=moe_spec(request, family), dense_layers=request.dense_layers)


def reasons(spec: ModelSpec, family: Family) -> list[str]:
    """Why `family` cannot hold `spec` exactly, after the function-neutral fixes the writer makes."""
    return family.cannot_hold(conform_spec(spec, family))


def choose_target(source: ModelSpec, request: MoERequest, name: str, *,
                  allow_approximate: bool) -> tuple[Target, str]:
    """The target family (`name`, or the first of `auto_order()` that fits for "auto") and why it was chosen."""
    names = auto_order() if name == "auto" else (name,)
    refused: dict[str, list[str]] = {}
    fitted: dict[str, Target] = {}
    for fam in names:
        family = family_named(fam)
        spec = candidate(source, request, family)
        why = reasons(spec, family)
        if not why:
            return Target(family, spec), _why(name, fam, refused)
        target = fit_attention(spec, family)
        if target is not None and not target.lossy:
            return target, _why(name, fam, refused)
        if target is not None:
            fitted[fam] = target
        refused[fam] = why
    if allow_approximate and fitted:
        fam = min(fitted, key=lambda f: len(fitted[f].lossy))  # fewest lossy changes, then auto order
        return fitted[fam], _why(name, fam, {k: v for k, v in refused.items() if k != fam})
    hint = ""
    if fitted:
        hint = f"; or pass --allow-approximate to fit {', '.join(fitted)} by changing the attention"
    if name != "auto":
        raise UpcyclerError(f"--target {name} cannot hold this request exactly: {', '.join(refused[name])}; "
                            f"choose another --target or --target auto{hint}")
    detail = "; ".join(f"{fam}: {', '.join(why)}" for fam, why in refused.items())
    raise UpcyclerError(f"no target family can hold this request exactly ({detail}); "
                        f"change --shared-experts or --dense-layers{hint}")


def _why(name: str, chosen: str, refused: dict[str, list[str]]) -> str:
    if name != "auto":
        return f"target {chosen} (as requested)"
    skipped = "; ".join(f"{fam} cannot ({', '.join(why)})" for fam, why in refused.items())
    tail = f"; {skipped})" if skipped else ")"
    return f"target {chosen} (auto: the first of {', '.join(auto_order())} that holds it exactly{tail}"


_ATTENTION = ("qk_norm", "qkv_bias", "o_bias", "mlp_bias")


def fit_attention(spec: ModelSpec, family: Family) -> Target | None:
    """The variant of `spec` with the fewest attention/bias changes that `family` holds, or None."""
    current = dict(zip(_ATTENTION, (getattr(spec, a) for a in _ATTENTION)))
    variants = []
    for values in itertools.product((False, True), repeat=len(_ATTENTION)):
        changed = {a: v for a, v in zip(_ATTENTION, values) if v != current[a]}
        if changed.get("mlp_bias"):
            continue  # never invent MLP biases
        lossy = tuple(_loss(a, v) for a, v in changed.items() if a == "qk_norm" or not v)
        variants.append((len(lossy), len(changed), changed, lossy))
    for _, _, changed, lossy in sorted(variants, key=lambda v: v[:2]):
        fitted = spec.replace(**changed)
        if not reasons(fitted, family):
            return Target(family, fitted, tuple(changed.items()), lossy)
    return None


def _loss(attr: str, value: bool) -> str:
    if attr == "qk_norm":
        return "q/k norms inserted" if value else "q/k norms dropped"
    return f"{attr.replace('_', ' ')}es dropped"


def apply_attention(target: Target, source: ModelSpec, tensors: TensorMap) -> TensorMap:
    """The tensors of `source` with the attention changes of `target` made (zeros or ones added, others dropped)."""
    changes = dict(target.attention)
    if not changes:
        return tensors
    hd, D, F = source.head_dim, source.hidden_size, source.intermediate_size
    q, kv = source.num_heads * hd, source.num_kv_heads * hd
    dtype = tensors["embed"].dtype
    shapes = {"qk_norm": {"attn.q_norm": (hd,), "attn.k_norm": (hd,)},
              "qkv_bias": {"attn.q_bias": (q,), "attn.k_bias": (kv,), "attn.v_bias": (kv,)},
              "o_bias": {"attn.o_bias": (D,)},
              "mlp_bias": {"mlp.gate_bias": (F,), "mlp.up_bias": (F,), "mlp.down_bias": (D,)}}
    added: dict[str, LazyTensor] = {}
    dropped: list[str] = []
    for attr, value in changes.items():
        for i in range(source.num_layers):
            for suffix, shape in shapes[attr].items():
                name = layer_prefix(i) + suffix
                if value:
                    added[name] = ones(shape, dtype) if attr == "qk_norm" else zeros(shape, dtype)
                else:
                    dropped.append(name)
    return tensors.without(dropped).updated(added)
