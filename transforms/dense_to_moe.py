"""`dense-to-moe`: upcycle a dense SwiGLU model into a Mixture-of-Experts that computes the same function.

The maths (upcycling-math §1–4): the dense FFN's F neurons split into the shared expert's and the routed
part, which every *virtual group* of R routed experts covers (`expert_cover`): with `--granularity G`
the members hold G − S contiguous shards of width F/G; with `--expert-width w` they hold windows of w
neurons that may overlap. Routed expert e is member e mod R of group e // R and takes router row
r[e // R]: E = N/R random rows, each repeated R times, bitwise identical, so a group's experts always
tie and top-K (a multiple of R) picks whole groups. The weights of one chosen group sum to 1/R of the
group's share, so the whole correction goes on `down_proj` (never on gate/up: SiLU is not homogeneous),
divided per neuron by how many members hold it:

    renormalised softmax (Mixtral, Qwen with norm_topk_prob)   down_proj × R / c_n              exact
    sigmoid, renormalised × routed_scaling_factor (GLM-4-MoE)  down_proj × R / (c_n · rsf)      exact
    softmax without renormalising (forced --router unnormalized) down_proj × N·R / (K · c_n)    approximate

("exact" up to one rounding of each scaled weight when a scale is not a power of two.) A renormalising
router with top-1 always gives the chosen expert weight 1, so the language-model loss never reaches the
router: refused unless `--allow-untrainable-router`.

Tensors are lazy: expert e's slices are cut from the dense tensor only when a writer asks for
`part(e)`, and a dense tensor is read once for all the experts cut from it (`_Recent`), so memory stays
a few dense tensors whatever the number of experts. A slice that is its source's bytes unchanged (gate
and up rows; a whole unscaled down_proj) also says where it is stored, so an HF writer streams it from
the source file instead. The router is drawn from a numpy Generator seeded by
(seed, layer) and stored in the model's dtype (the routers of the HF families are plain linear layers of
the model dtype; transformers upcasts the logits to fp32 itself).

With `--experts-from NAME=PATH …` (Branch-Train-MiX) each virtual group is cut, exactly as above, from
the dense MLP of one of N models of BASE's architecture, and the other tensors come from BASE, their mean
or one source (`transforms.experts_from`). `--router-init centroids` then points each group's router row
at its source's domain (`transforms.router_init`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from upcycler.errors import UpcyclerError
from upcycler.families import moe_families
from upcycler.io.checkpoint import Checkpoint
from upcycler.layout import layer_prefix
from upcycler.schema import Range
from upcycler.spec import ROUTER_KINDS, ModelSpec, MoESpec, spec_real, within_limit
from upcycler.tensors import LazyTensor, StoredBytes, TensorMap, dtype_name, stack, zeros
from upcycler.transforms.approximate_attention import approximate
from upcycler.transforms.expert_cover import Cover, overlapping, powers_of_two, tiled
from upcycler.transforms.experts_from import Sources, describe_assignment, open_sources
from upcycler.transforms.moe_target import MoERequest, choose_target
from upcycler.transforms.registry import TransformContext, option, record, register, report
from upcycler.transforms.router_init import RouterCalibration, centroid_router

MAX_GROWTH = 10  # refuse results with more than this many times the source's parameters (--allow-large)
MAX_ROUTER_STD = 100.0  # router rows beyond this overflow half-precision weights


CENTROID_SEQUENCES = 128  # default --calibration-sequences: per source, for --router-init centroids
ATTENTION_SEQUENCES = 16  # … in all, for an attention changed under --allow-approximate (as many held out)


@dataclass(frozen=True)
class DenseToMoE:
    """Options of `dense-to-moe`."""

    experts: int = option(help="Routed experts N (a multiple of the virtual group size R).", metavar="N")
    topk: int = option(help="Routed experts per token K (a multiple of R, so whole virtual groups are chosen).",
                       metavar="K")
    granularity: int = option(1, help="Shards G per dense FFN (1: experts are full copies); must divide F; "
                                      "R = G − S.", metavar="G")
    expert_width: int | None = option(None, help="Neurons per expert, any width (instead of --granularity): "
                                                 "the smallest group R dividing N and K with R·W covering the "
                                                 "routed neurons holds overlapping windows.", metavar="W")
    shared_experts: int = option(0, help="Shared experts S (shards of G, or experts of width W) that are "
                                         "always on.", metavar="S")
    dense_layers: int = option(0, help="First D layers keep their dense MLP untouched.", metavar="D")
    router_std: float = option(0.02, help="Std of the random router rows (0: uniform router).", metavar="σ")
    target: str = option("auto", choices=(*moe_families(), "auto"),
                         help="HF MoE family to produce; auto: the first that holds the request exactly.")
    router: str | None = option(None, choices=ROUTER_KINDS,
                                help="Router kind (default: the target's exact one; unnormalized is approximate).")
    routed_scaling_factor: float = option(1.0, help="GLM-4-MoE's routed_scaling_factor (sigmoid router).",
                                          metavar="RSF")
    seed: int = option(0, help="Seed of the router (and of --reinit-ratio).")
    reinit_ratio: float = option(0.0, help="Drop-Upcycling: re-initialise this fraction of each routed "
                                           "expert's neurons (NOT function-preserving).", metavar="r")
    allow_approximate: bool = option(False, help="Accept a target that cannot hold the source's attention "
                                                 "exactly (q/k norms or biases changed).")
    allow_large: bool = option(False, help=f"Allow a result over {MAX_GROWTH}× the source's parameters.")
    allow_untrainable_router: bool = option(False, help="Allow top-1 with a renormalising router, whose "
                                                        "router the language-model loss never trains.")
    experts_from: Mapping[str, Path] | None = option(
        None, help="Branch-Train-MiX: cut the routed experts from these dense models of BASE's architecture "
                   "and tokenizer (NAME=PATH …): virtual group g from source ⌊g·N/groups⌋.", metavar="NAME=PATH")
    expert_sources: tuple[str, ...] | None = option(
        None, help="With --experts-from: the source of every routed expert, by name (comma-separated; the "
                   "experts of one virtual group share a source).", metavar="NAMES")
    shared_params: str = option("base", help="With --experts-from: attention, norms, embeddings and head from "
                                             "base (BASE's), mean (fp32 mean of the sources) or a source's name.",
                                metavar="base|mean|NAME")
    shared_ffn: str = option("base", help="With --experts-from: shared experts and dense first layers from "
                                          "base, mean or a source's name.", metavar="base|mean|NAME")
    router_init: str = option("random", choices=("random", "centroids"),
                              help="random: rows ~ N(0, σ²); centroids (with --experts-from): each group's row "
                                   "points at its source's mean router input on its own --calibration data.")
    calibration: Path | None = option(  # noqa: RUF009 (option is dataclasses.field)
        None, help="Prepared data (`upcycle prepare-data`, the source's tokenizer): with --router-init centroids "
                   "one source per --experts-from name; with --allow-approximate, to fit and measure the changed "
                   "attention (its NAME.heldout sources, when prepared, are the held-out data).", metavar="DIR")
    calibration_sequences: int | None = option(None, range=Range(1, 1 << 16), metavar="n",
                                               help="Sequences of calibration data: per source for --router-init "
                                                    "centroids (default 128), in all for --allow-approximate "
                                                    "(default 16, and as many held out).")
    calibration_length: int = option(256, range=Range(2, 1 << 20), metavar="L",
                                     help="Tokens per calibration sequence.")
    centroid_margin: float = option(2.0, range=Range(0, 100, lo_open=True), metavar="m",
                                    help="With --router-init centroids: the mean logit by which a source's "
                                         "tokens prefer its own groups, on its calibration data.")
    min_agreement: float = option(0.5, range=Range(0, 1), metavar="p",
                                  help="With --allow-approximate: refuse a changed attention whose top-1 agreement "
                                       "with the source on held-out calibration tokens is below p (0: any).")


@register("dense-to-moe", DenseToMoE)
def dense_to_moe(cfg: DenseToMoE, spec: ModelSpec, tensors: TensorMap,
                 context: TransformContext) -> tuple[ModelSpec, TensorMap]:
    """Upcycle a dense model into a fine-grained MoE with virtual groups, shared experts and dense first layers.

    Sparse Upcycling (Komatsuzaki et al., arXiv 2212.05055) for G=1; virtual groups and weight scaling
    (He et al., arXiv 2410.07524), with the whole scale on down_proj; shared experts and dense first
    layers as in DeepSeekMoE (arXiv 2401.06066); `--reinit-ratio` is Drop-Upcycling (arXiv 2502.19261).

    Preserves the function exactly (up to float rounding of a non-power-of-two scale) for renormalising
    and sigmoid routers, whatever the router weights: attention, norms, embeddings and dense layers are
    the source's tensors, untouched. Not preserved: a forced unnormalised router (approximate unless the
    router is uniform and R = 1), `--reinit-ratio` > 0, and attention changes made under
    `--allow-approximate`; each is reported.
    """
    cover = cover_for(cfg, spec)
    request = MoERequest(cfg.experts, cfg.topk, cover.width, cfg.shared_experts, tuple(range(cfg.dense_layers)),
                         cfg.router, cfg.routed_scaling_factor)
    target, why = choose_target(spec, request, cfg.target, allow_approximate=cfg.allow_approximate)
    report(why)
    _check_trainable(cfg, target.spec.moe)  # type: ignore[arg-type]
    if target.lossy:
        report(f"NOT function-preserving: {'; '.join(target.lossy)} to fit {target.family.architecture} "
               "(--allow-approximate)", exact=False)
    out = target.spec
    for note in target.family.serving_notes(out):  # what a serving engine cannot load of this family
        report(note)
    _check_size(cfg, spec, out)
    sources = _sources(cfg, spec, tensors, cover, context.checkpoint, fits_attention=bool(target.lossy))
    routers = _routers(cfg, out, sources, context)  # checked before the attention fit's minutes
    tensors = approximate(target, spec, tensors if sources is None else _shared(cfg, sources, tensors),
                          context, calibration=cfg.calibration,
                          sequences=cfg.calibration_sequences or ATTENTION_SEQUENCES,
                          length=cfg.calibration_length, min_agreement=cfg.min_agreement)
    scaled_dtype = _scaled_dtype(tensors["embed"].dtype, context.output_dtype)
    factor = _scale(out.moe, cover, cfg.router_std, scaled_dtype)  # type: ignore[arg-type]
    if cfg.reinit_ratio > 0:
        n = round(cfg.reinit_ratio * cover.width)
        report(f"NOT function-preserving: Drop-Upcycling re-initialises {n} of the {cover.width} neurons of every "
               f"routed expert ({cfg.reinit_ratio:.0%}, seed {cfg.seed})", exact=False)
    recent = _Recent()
    new: dict[str, LazyTensor] = {}
    for i in out.moe_layers:
        new.update(_moe_layer(cfg, out, cover, factor, _Layer(tensors, sources, cfg.shared_ffn), i, recent, routers,
                              scaled_dtype))
    dense = [layer_prefix(i) + f"mlp.{w}" for i in out.moe_layers for w in ("gate_proj", "up_proj", "down_proj")]
    return out, tensors.without(dense).updated(new)


def _sources(cfg: DenseToMoE, spec: ModelSpec, tensors: TensorMap, cover: Cover, base: Checkpoint | None, *,
             fits_attention: bool) -> Sources | None:
    """The sources of `--experts-from` (None without it), checked against BASE (`base`: its checkpoint as
    read, when this is a recipe's first step); what they change is reported and recorded.
    `fits_attention`: --calibration also serves the changed attention."""
    if cfg.experts_from is None:
        unused = [flag for flag, given in (("--expert-sources", cfg.expert_sources is not None),
                                           ("--shared-params", cfg.shared_params != "base"),
                                           ("--shared-ffn", cfg.shared_ffn != "base"),
                                           ("--router-init centroids", cfg.router_init != "random"),
                                           ("--calibration", cfg.calibration is not None and not fits_attention))
                  if given]
        if unused:
            also = " or to an attention changed under --allow-approximate" if unused[0] == "--calibration" else ""
            raise UpcyclerError(f"{unused[0]} applies to experts from several models{also}; add --experts-from "
                                "NAME=PATH … or drop it")
        return None
    if cfg.router_init == "centroids" and cfg.calibration is None:
        raise UpcyclerError("--router-init centroids needs --calibration DIR (prepared data with one source per "
                            "--experts-from name)")
    if cfg.router_init != "centroids" and cfg.calibration is not None and not fits_attention:
        raise UpcyclerError("--calibration is read by --router-init centroids and by an attention changed under "
                            "--allow-approximate; add --router-init centroids or drop --calibration")
    groups = cfg.experts // cover.group
    sources = open_sources(cfg.experts_from, spec, tensors, groups=groups, group=cover.group,
                           assignment=cfg.expert_sources, base_checkpoint=base,
                           choices={"--shared-params": cfg.shared_params, "--shared-ffn": cfg.shared_ffn})
    report(f"experts from {len(sources.names)} models: {describe_assignment(sources)}; attention, norms, "
           f"embeddings and head from {cfg.shared_params}; shared experts and dense layers from {cfg.shared_ffn}")
    if not sources.identical:
        report(f"NOT function-preserving: the experts come from {len(sources.names)} different models",
               exact=False)
    record(**sources.lineage())
    return sources


def _shared(cfg: DenseToMoE, sources: Sources, tensors: TensorMap) -> TensorMap:
    """BASE's tensors with the non-FFN ones (and the dense layers' MLPs) taken from the chosen source."""
    def choice(name: str) -> str:
        if ".mlp." not in name:
            return cfg.shared_params
        return cfg.shared_ffn if int(name.split(".")[1]) < cfg.dense_layers else "base"  # MoE layers: cut later

    return TensorMap({name: sources.pick(choice(name), tensors, name) for name in tensors})


def _routers(cfg: DenseToMoE, out: ModelSpec, sources: Sources | None,
             context: TransformContext) -> RouterCalibration | None:
    """The centroid calibration shared by every layer's router (None: random routers), measured with the
    router inputs `context` lends."""
    if cfg.router_init != "centroids":
        return None
    assert sources is not None and cfg.calibration is not None
    sequences = cfg.calibration_sequences or CENTROID_SEQUENCES
    if context.router_inputs is None:
        raise UpcyclerError("--router-init centroids runs the JAX model on the calibration data; this command "
                            "cannot (use `upcycle dense-to-moe` or `upcycle run`)")
    if len(sources.names) < 2:
        raise UpcyclerError("--router-init centroids tells sources apart; it needs two or more --experts-from "
                            "sources (use --router-init random)")
    measure = context.router_inputs()
    measure.check(Path(cfg.calibration), sources.names, sources.checkpoints[0], cfg.calibration_length,
                  sequences)
    report(f"router rows point at each source's mean router input on {sequences} × "
           f"{cfg.calibration_length} tokens of its own data in {cfg.calibration} (logit margin "
           f"{cfg.centroid_margin:g}), plus the random rows (σ = {cfg.router_std:g})")
    return RouterCalibration(sources, out.moe_layers, Path(cfg.calibration), sequences,
                             cfg.calibration_length, cfg.centroid_margin, measure)


def cover_for(cfg: DenseToMoE, spec: ModelSpec) -> Cover:
    """The experts' cover of the dense FFN for `cfg` on `spec`; requests that cannot be upcycled are
    refused, with the flag to change."""
    if spec.moe is not None:
        raise UpcyclerError(f"dense-to-moe needs a dense source, but this {spec.family} model is already "
                            "MoE; upcycle its dense original instead")
    G, S, N, K, F = cfg.granularity, cfg.shared_experts, cfg.experts, cfg.topk, spec.intermediate_size
    W = cfg.expert_width
    if G < 1 or N < 1 or K < 1 or S < 0 or cfg.dense_layers < 0 or not 0 <= cfg.seed < 2**64 or (W is not None and W < 1):
        raise UpcyclerError("--experts, --topk, --granularity and --expert-width must be ≥ 1; --shared-experts "
                            "and --dense-layers ≥ 0; --seed between 0 and 2^64 − 1")
    within_limit(N, "num_experts", "--experts")
    _check_rest(cfg, spec)
    if K > N:
        raise UpcyclerError(f"--topk {K} is larger than --experts {N}")
    if W is not None:
        if G != 1:
            raise UpcyclerError(f"--granularity {G} and --expert-width {W} both set the expert width; pass one "
                                "(--granularity G is --expert-width F/G with shards that do not overlap)")
        within_limit(W, "expert_width", "--expert-width")
        return overlapping(F, W, S, N, K)
    if F % G:
        divisors = [d for d in range(2, 65) if F % d == 0]
        raise UpcyclerError(f"--granularity {G} does not divide the intermediate size {F}; choose a divisor "
                            f"({', '.join(map(str, divisors)) or 'none up to 64'})")
    if S >= G:
        raise UpcyclerError(f"--shared-experts {S} must be smaller than --granularity {G} "
                            "(at least one shard must stay routed)")
    R = G - S
    if N % R:
        raise UpcyclerError(f"--experts {N} is not a multiple of the routed group size R = G − S = {R}")
    if K % R:
        raise UpcyclerError(f"--topk {K} is not a multiple of the routed group size R = G − S = {R}; "
                            "top-k must choose whole virtual groups to preserve the function")
    return tiled(F, G, S)


def _check_rest(cfg: DenseToMoE, spec: ModelSpec) -> None:
    """The options that do not depend on how the experts are cut."""
    if cfg.dense_layers >= spec.num_layers:
        raise UpcyclerError(f"--dense-layers {cfg.dense_layers} leaves no MoE layer (the model has "
                            f"{spec.num_layers} layers); use fewer")
    if not 0 <= cfg.reinit_ratio < 1:
        raise UpcyclerError(f"--reinit-ratio {cfg.reinit_ratio} must be in [0, 1)")
    if not 0 <= cfg.router_std <= MAX_ROUTER_STD:
        raise UpcyclerError(f"--router-std {cfg.router_std:g} must be between 0 and {MAX_ROUTER_STD:g}")
    spec_real(cfg.routed_scaling_factor, "--routed-scaling-factor", "routed_scaling_factor",
              fix="choose another --routed-scaling-factor")


def _check_trainable(cfg: DenseToMoE, moe: MoESpec) -> None:
    """Refuse top-1 with a router that renormalises the chosen weights: the one weight is always 1 (or the
    routed scaling factor), so the router gets no gradient from the language-model loss."""
    if moe.top_k == 1 and moe.router in ("renormalized", "sigmoid") and not cfg.allow_untrainable_router:
        raise UpcyclerError(f"--topk 1 with the {moe.router} router of this target gives the chosen expert "
                            "weight 1 whatever the router says, so the router never learns from the "
                            "language-model loss; use --topk 2 or more, --router unnormalized, or pass --allow-untrainable-router")


def _check_size(cfg: DenseToMoE, source: ModelSpec, out: ModelSpec) -> None:
    before, after = source.total_params(), out.total_params()
    if after > MAX_GROWTH * before and not cfg.allow_large:
        raise UpcyclerError(f"dense-to-moe would make {after:,} parameters, {after / before:.0f}× the source's "
                            f"{before:,} (over {MAX_GROWTH}×); lower --experts or pass --allow-large to force")


def router_factor(moe: MoESpec, group: int) -> float:
    """The factor on routed down_proj (before dividing by c_n) that undoes the router's weights: R for a
    renormalising router, R / routed_scaling_factor for GLM's sigmoid, N·R/K for plain softmax (exact only
    for a uniform router with R = 1)."""
    if moe.router == "renormalized":
        return float(group)
    if moe.router == "sigmoid":
        return group / moe.routed_scaling_factor
    return moe.num_experts * group / moe.top_k


def _scale(moe: MoESpec, cover: Cover, router_std: float, dtype: np.dtype) -> float:
    """The router's factor on routed down_proj (before dividing by c_n), reported with its exactness."""
    R = cover.group
    factor = router_factor(moe, R)
    if moe.router == "renormalized":
        how, exact = f"× R = {R} (renormalising router)", True
    elif moe.router == "sigmoid":
        how, exact = f"× R / routed_scaling_factor = {factor:g} (sigmoid router, renormalised)", True
    else:
        how = f"× N·R/K = {factor:g} (router does not renormalise the top-k weights)"
        exact = router_std == 0 and R == 1
    if exact:
        report(f"routed down_proj {how}: function-preserving")
    else:
        report(f"APPROXIMATE: routed down_proj {how} is exact only for a uniform router; the default "
               "renormalising router (norm_topk_prob=true) is exact", exact=False)
    report(cover.describe(factor))
    scales = cover.scales(factor)
    if scales != [1.0] and not powers_of_two(scales):
        report(f"exact up to float rounding: the scale{'s' if len(scales) > 1 else ''} "
               f"{', '.join(f'{s:g}' for s in scales)} {'are' if len(scales) > 1 else 'is'} not a power of two, "
               f"so scaled weights round once in {dtype_name(dtype)}", rounds=True)
    return factor


@dataclass(frozen=True)
class _Layer:
    """Where one MoE layer's dense MLP comes from: BASE's (`tensors`), or per expert from `sources`."""

    tensors: TensorMap
    sources: Sources | None
    shared_ffn: str

    def mlp(self, p: str, e: int | None) -> tuple[LazyTensor, LazyTensor, LazyTensor]:
        """gate, up and down of layer prefix `p`: routed expert e's source, or the shared expert's (None)."""
        names = [p + f"mlp.{w}" for w in ("gate_proj", "up_proj", "down_proj")]
        if self.sources is None:
            return tuple(self.tensors[n] for n in names)  # type: ignore[return-value]
        if e is None:
            return tuple(self.sources.pick(self.shared_ffn, self.tensors, n) for n in names)  # type: ignore[return-value]
        return tuple(self.sources.of_expert(e)[n] for n in names)  # type: ignore[return-value]


def _scaled_dtype(source: np.dtype, output: np.dtype | None) -> np.dtype:
    """The dtype the routed down_proj is scaled in: the source's, or the output's (`output`, `--dtype`) where
    that is wider, so a scale that is not a power of two rounds once, in the dtype that is written."""
    return np.dtype(output) if output is not None and np.dtype(output).itemsize > np.dtype(source).itemsize \
        else np.dtype(source)


def _moe_layer(cfg: DenseToMoE, out: ModelSpec, cover: Cover, factor: float, source: _Layer, i: int,
               recent: _Recent, routers: RouterCalibration | None, scaled_dtype: np.dtype) -> dict[str, LazyTensor]:
    """Router, routed experts and shared expert of MoE layer `i`, all lazy views of the dense MLPs they are
    cut from (BASE's, or each expert's source's); routed down_proj in `scaled_dtype`."""
    p = layer_prefix(i)
    experts = [source.mlp(p, e) for e in range(out.moe.num_experts)]  # type: ignore[union-attr]
    gate, up, down = source.mlp(p, None)  # the shared expert's
    moe = out.moe
    assert moe is not None
    D, f, R, N = out.hidden_size, cover.width, cover.group, moe.num_experts
    dtype = gate.dtype
    reinit = round(cfg.reinit_ratio * f)
    scales = _MemberScales(cover, factor)

    def rows(e: int, k: int) -> np.ndarray:  # [f, D]: window e mod R of expert e's gate (k=0) or up (k=1)
        w = experts[e][k]
        out_ = recent.get(w)[cover.window(e % R)]
        return _reinit(out_, recent.stats(w), cfg.seed, i, e, k, reinit, axis=0) if reinit else out_

    def cols(e: int) -> np.ndarray:  # [D, f]: window e mod R of expert e's down, scaled
        w = experts[e][2]
        out_ = recent.get(w)[:, cover.window(e % R)]
        if reinit:
            out_ = _reinit(out_, recent.stats(w), cfg.seed, i, e, 2, reinit, axis=1)
        return scale_columns(out_, scales.of(e % R), scaled_dtype)

    # where a slice is its source's bytes unchanged (no re-initialised neurons, no scale), the writer
    # streams it from the file: gate/up rows are one contiguous range, down columns only when all of them
    def rows_stored(e: int, k: int) -> StoredBytes | None:
        window = cover.contiguous(e % R)
        return None if reinit or window is None else experts[e][k].stored_rows(window)

    def cols_stored(e: int) -> StoredBytes | None:
        w, window = experts[e][2], cover.contiguous(e % R)
        whole = window is not None and window.indices(w.shape[1]) == (0, w.shape[1], 1)
        unscaled = cover.overlap == 0 and factor == 1 and scaled_dtype == w.dtype
        return w.stored if whole and unscaled and not reinit else None

    random_rows = _router(cfg.seed, i, N // R, R, D, cfg.router_std, dtype)
    new = {
        p + "moe.router": random_rows if routers is None else centroid_router(routers, i, random_rows, R),
        p + "moe.experts.gate_proj": stack([lambda e=e: rows(e, 0) for e in range(N)], (N, f, D), dtype,
                                           stored=[rows_stored(e, 0) for e in range(N)]),
        p + "moe.experts.up_proj": stack([lambda e=e: rows(e, 1) for e in range(N)], (N, f, D), dtype,
                                         stored=[rows_stored(e, 1) for e in range(N)]),
        p + "moe.experts.down_proj": stack([lambda e=e: cols(e) for e in range(N)], (N, D, f), scaled_dtype,
                                           stored=[cols_stored(e) for e in range(N)]),
    }
    if cover.shared:
        width = cover.shared
        new[p + "moe.shared.gate_proj"] = LazyTensor((width, D), dtype, lambda: recent.get(gate)[:width],
                                                     stored=gate.stored_rows(slice(0, width)))
        new[p + "moe.shared.up_proj"] = LazyTensor((width, D), dtype, lambda: recent.get(up)[:width],
                                                   stored=up.stored_rows(slice(0, width)))
        # a gated shared expert is multiplied by sigmoid(0 · x) = 1/2: double its down_proj (exact)
        double = 2.0 if moe.shared_gated else 1.0
        new[p + "moe.shared.down_proj"] = LazyTensor((D, width), dtype,
                                                     lambda: scale_columns(recent.get(down)[:, :width], double))
        if moe.shared_gated:
            new[p + "moe.shared_gate"] = zeros((1, D), dtype)
    return new


class _MemberScales:
    """The down_proj scale of each group member (the router's factor, or one per column where windows
    overlap), computed when a member's columns are first written and kept: planning the layer (a dry run)
    allocates nothing by the expert width."""

    def __init__(self, cover: Cover, factor: float):
        self.cover, self.factor = cover, factor
        self._by_member: dict[int, np.ndarray] = {}

    def of(self, j: int) -> float | np.ndarray:
        """Member j's scale: `factor` for a tiling cover, else its per-column scales."""
        if self.cover.overlap == 0:
            return self.factor
        if j not in self._by_member:
            self._by_member[j] = self.cover.column_scales(j, self.factor)
        return self._by_member[j]


def _router(seed: int, layer: int, groups: int, R: int, D: int, std: float, dtype: np.dtype) -> LazyTensor:
    """[E·R, D]: E rows ~ N(0, std²) drawn for (seed, layer), each repeated R times (one per group member)."""

    def load() -> np.ndarray:
        rows = np.random.default_rng([seed, layer]).standard_normal((groups, D)) * std
        return np.repeat(rows.astype(np.float32).astype(dtype), R, axis=0)

    return LazyTensor((groups * R, D), np.dtype(dtype), load)


def scale_columns(w: np.ndarray, factor: float | np.ndarray, dtype: np.dtype | None = None) -> np.ndarray:
    """`w` × factor (a scalar, or one per column), computed in fp32 (fp64 for fp64) and cast once to `dtype`
    (default: `w`'s)."""
    dtype = w.dtype if dtype is None else np.dtype(dtype)
    if np.isscalar(factor) and factor == 1:
        return w.astype(dtype, copy=False)
    wide = np.float64 if np.float64 in (w.dtype, dtype) else np.float32
    return (w.astype(wide) * np.asarray(factor, wide)).astype(dtype)


def _reinit(w: np.ndarray, stats: tuple[float, float], seed: int, layer: int, expert: int, which: int,
            count: int, *, axis: int) -> np.ndarray:
    """`w` with `count` neurons (rows for gate/up, columns for down) redrawn from N(mean, std) of the dense
    weight; the neurons are the same for gate, up and down of one expert (seeded by seed, layer, expert)."""
    neurons = np.random.default_rng([seed, layer, expert]).choice(w.shape[axis], size=count, replace=False)
    shape = (count, w.shape[1]) if axis == 0 else (w.shape[0], count)
    fresh = np.random.default_rng([seed, layer, expert, which + 1]).normal(*stats, size=shape)
    out = np.array(w)
    if axis == 0:
        out[neurons] = fresh.astype(np.float32).astype(w.dtype)
    else:
        out[:, neurons] = fresh.astype(np.float32).astype(w.dtype)
    return out


class _Recent:
    """The last few dense tensors loaded, so the N experts cut from one tensor read it once.

    Writers ask for every expert of one stacked tensor in a row (gate, then up, then down, then the shared
    expert), so three entries (one layer's gate, up and down) are enough.
    """

    def __init__(self, size: int = 3):
        self._size = size
        self._arrays: OrderedDict[int, tuple[LazyTensor, np.ndarray, tuple[float, float] | None]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, tensor: LazyTensor) -> np.ndarray:
        with self._lock:
            key = id(tensor)
            if key in self._arrays:
                self._arrays.move_to_end(key)
                return self._arrays[key][1]
            array = tensor.load()
            self._arrays[key] = (tensor, array, None)
            while len(self._arrays) > self._size:
                self._arrays.popitem(last=False)
            return array

    def stats(self, tensor: LazyTensor) -> tuple[float, float]:
        """Mean and std of a dense tensor (for Drop-Upcycling's re-initialisation)."""
        array = self.get(tensor)
        with self._lock:
            entry = self._arrays.get(id(tensor))
            if entry is not None and entry[2] is not None:
                return entry[2]
            wide = array.astype(np.float64)
            stats = (float(wide.mean()), float(wide.std()))
            if entry is not None:
                self._arrays[id(tensor)] = (entry[0], entry[1], stats)
            return stats
