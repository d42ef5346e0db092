"""The decoder-only transformer: pure functions over the parameter tree of `upcycler.train.model.params`.

What it computes is decided by the `ModelSpec` alone (the architecture, read from a checkpoint); how it
computes is decided by `ModelConfig` (declared in `upcycler.train.config`: compute dtype, attention and
MoE implementations, grouped-matmul backend, rematerialisation).
One function covers every supported family:

- GQA attention with RoPE (default, linear, llama3 or yarn scaling; partial rotary), optional q/k/v and o
  biases, optional per-head q/k RMSNorm before RoPE, optional sliding window per layer;
- pre-norm residual blocks with a SwiGLU MLP, or an MoE block (`upcycler.train.model.moe`:
  softmax-renormalised, softmax or sigmoid routers) with an optional shared expert (gated by
  `sigmoid(shared_gate · x)` or not);
- tied or untied embeddings; causal masking, optionally restricted to segments (packing, padding).

Layers of one kind are stacked and run under `jax.lax.scan`, one scan per span of consecutive layers
(dense first layers, then MoE layers: two scans). Parameters stay in their dtype and are cast to the compute
dtype where they are used; norms, softmaxes, routers and logits are computed in fp32.

Shape suffixes follow the dimension key of `upcycler.train.model`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from upcycler.spec import ModelSpec
from upcycler.train.config import ModelConfig  # declared with the training options, without JAX
from upcycler.train.model import expert_parallel, moe, remat, splash
from upcycler.train.model import layers as nn
from upcycler.train.model.params import (
    LayerSpan,
    ParamInfo,
    Params,
    declare_tree,
    layer_spans,
    layers_of_kind,
)
from upcycler.train.model.placement import ONE_DEVICE, Placement

ACTIVATION_AXES = ("batch", "seq", "act_embed")
KV_AXES = ("batch", "kv_seq", None, None)  # keys and values [B, S, K, h]: every query's keys, the whole sequence
MASK_AXES = ("batch", "seq", "kv_seq")


@jax.tree_util.register_dataclass
@dataclass
class Aux:
    """Per-MoE-layer router outputs, for the load-balancing and z losses and expert-load telemetry.

    `router_logits` [M, B, L, E] fp32 (pre-activation, before any selection bias) and `expert_ids`
    [M, B, L, k] int32 (the experts each token was sent to), for the M MoE layers in order; both are
    None for a dense model.
    """

    router_logits: jax.Array | None = None
    expert_ids: jax.Array | None = None


class _Context(NamedTuple):
    """What every layer needs besides its own parameters."""

    cos_BLR: jax.Array
    sin_BLR: jax.Array
    visible_BLS: jax.Array
    distance: jax.Array  # query index − key index: [L, S], or [B, L, S] for tokens out of sequence order
    causal_only: bool  # tokens in order, no segments: plain causal attention unless a layer has a window
    segment_ids_BL: jax.Array | None  # the packed documents (None: one per row), for attention kernels
    placement: Placement  # where activations live on the devices (`placement.py`)
    token_index_BL: jax.Array | None  # each token's index in its sequence (None: tokens in order)


def forward(
    params: Params,
    ids_BL: jax.Array,
    spec: ModelSpec,
    cfg: ModelConfig = ModelConfig(),
    *,
    segment_ids_BL: jax.Array | None = None,
    positions_BL: jax.Array | None = None,
    token_index_BL: jax.Array | None = None,
    placement: Placement = ONE_DEVICE,
) -> tuple[jax.Array, Aux]:
    """Next-token logits [B, L, V] in fp32, and the router outputs of the MoE layers.

    `segment_ids_BL` (optional) confines attention to tokens of the same segment (packed documents; give
    padding its own id); `positions_BL` (optional, default `token_index_BL`) are the RoPE positions, e.g.
    restarting at every packed document. `token_index_BL` (optional, default 0..L-1) is each token's index
    in its sequence when the tokens come in another order (context parallelism's balanced chunks,
    `upcycler.train.loop.context_parallel`): attention's causal and window masks follow it, so every
    token's logits are those it has in sequence order. `placement` lays the computation out over the
    active mesh (given by the caller that built the mesh; the logits are the same with any placement).
    """
    params = weights_for_compute(params, spec, cfg)
    hidden_BLD, aux = hidden_states(
        params, ids_BL, spec, cfg, segment_ids_BL=segment_ids_BL, positions_BL=positions_BL,
        token_index_BL=token_index_BL, placement=placement,
    )
    return unembed(params, hidden_BLD, spec), aux


forward_jit = jax.jit(forward, static_argnames=("spec", "cfg", "placement"))


def weights_for_compute(params: Params, spec: ModelSpec, cfg: ModelConfig) -> Params:
    """The parameters as the forward pass reads them: every weight in `cfg.weights_dtype`, except what
    is declared to stay float32 (`ParamDecl.computed_in_fp32`: the router; buffers).

    Every other weight is cast to the compute dtype where it is used, so with `weights_dtype` equal to
    `compute_dtype` the forward pass computes the same numbers; the cast happens once, on each device's
    shard, before FSDP gathers it. Gradients flow back to the float32 master weights through the cast.
    """
    dtype = jnp.dtype(cfg.weights_dtype)
    if dtype == jnp.float32:
        return params

    def cast(info: ParamInfo, leaf: jax.Array) -> jax.Array:
        return leaf if info.is_buffer or info.computed_in_fp32 else leaf.astype(dtype)

    return jax.tree.map(cast, declare_tree(spec), params, is_leaf=lambda x: isinstance(x, ParamInfo))


def unsupported(spec: ModelSpec) -> list[str]:
    """Reasons this model cannot run `spec` (empty when it can)."""
    reasons = []
    if spec.hidden_act not in nn.ACTIVATIONS:
        reasons.append(f"activation {spec.hidden_act!r} is not supported ({', '.join(nn.ACTIVATIONS)})")
    try:
        nn.rope_frequencies(spec)
    except (ValueError, KeyError) as err:
        reasons.append(f"RoPE: {err}")
    if spec.num_heads % spec.num_kv_heads:
        reasons.append(f"{spec.num_heads} query heads do not group over {spec.num_kv_heads} kv heads")
    return reasons


def hidden_states(
    params: Params,
    ids_BL: jax.Array,
    spec: ModelSpec,
    cfg: ModelConfig = ModelConfig(),
    *,
    segment_ids_BL: jax.Array | None = None,
    positions_BL: jax.Array | None = None,
    token_index_BL: jax.Array | None = None,
    placement: Placement = ONE_DEVICE,
) -> tuple[jax.Array, Aux]:
    """The final-normed hidden states [B, L, D] (compute dtype) and the router outputs; see `forward`."""
    B, L = ids_BL.shape
    ctx = _context(spec, B, L, segment_ids_BL, positions_BL, placement, token_index_BL)
    x_BLD = jnp.take(params["embed"], ids_BL, axis=0).astype(jnp.dtype(cfg.compute_dtype))
    logits, ids = [], []
    for span in layer_spans(spec):
        x_BLD, span_aux = _scan_span(params["layers"][span.kind], x_BLD, span, spec, cfg, ctx)
        if span.kind == "moe":
            logits.append(span_aux[0])
            ids.append(span_aux[1])
    aux = Aux(jnp.concatenate(logits), jnp.concatenate(ids)) if logits else Aux()
    return nn.rms_norm(x_BLD, params["final_norm"], spec.rms_norm_eps), aux


def _context(spec: ModelSpec, B: int, L: int, segment_ids_BL: jax.Array | None,
             positions_BL: jax.Array | None, placement: Placement = ONE_DEVICE,
             token_index_BL: jax.Array | None = None) -> _Context:
    if positions_BL is None:
        positions_BL = jnp.broadcast_to(jnp.arange(L), (B, L)) if token_index_BL is None else token_index_BL
    inv_freq, factor = nn.rope_frequencies(spec)
    cos_BLR, sin_BLR = nn.rope_tables(positions_BL, inv_freq, factor)
    visible_BLS, distance = nn.attention_mask(segment_ids_BL, B, L, token_index_BL)
    visible_BLS = placement.constrain(visible_BLS, MASK_AXES)
    in_order = token_index_BL is None
    return _Context(cos_BLR, sin_BLR, visible_BLS, distance, segment_ids_BL is None and in_order, segment_ids_BL,
                    placement, token_index_BL)


def one_layer(x_BLD: jax.Array, p: Params, spec: ModelSpec, cfg: ModelConfig, *, kind: str, window: int) -> jax.Array:
    """One decoder layer on its own (causal, positions 0..L−1): what `hidden_states` computes for a layer of
    `kind` with sliding `window` (0: full attention) given that layer's parameters, unstacked. For running a
    model one layer at a time (`upcycler.train.evaluation.layerwise`)."""
    B, L, _ = x_BLD.shape
    ctx = _context(spec, B, L, None, None)
    y_BLD, _ = _layer(x_BLD, (p, jnp.int32(window)), kind=kind, spec=spec, cfg=cfg, ctx=ctx, windows=(window,))
    return y_BLD


def unembed(params: Params, hidden_BLD: jax.Array, spec: ModelSpec) -> jax.Array:
    """Logits [B, L, V] in fp32 from final hidden states (the embedding matrix when tied)."""
    w_VD = params["embed"] if spec.tie_embeddings else params["lm_head"]
    return jnp.einsum(
        "bld,vd->blv", hidden_BLD, w_VD.astype(hidden_BLD.dtype), preferred_element_type=jnp.float32
    )


def layer_windows(spec: ModelSpec) -> tuple[int, ...]:
    """Per layer: the sliding-window size, or 0 for full attention."""
    window = spec.sliding_window or 0
    if spec.layer_types is None:
        return (window,) * spec.num_layers
    return tuple(window if t == "sliding_attention" else 0 for t in spec.layer_types)


def _scan_span(stack: Params, x_BLD: jax.Array, span: LayerSpan, spec: ModelSpec, cfg: ModelConfig, ctx: _Context):
    layer_ids = layers_of_kind(spec, span.kind)[span.start : span.start + span.length]
    if span.length != len(layers_of_kind(spec, span.kind)):
        stack = jax.tree.map(lambda a: jax.lax.slice_in_dim(a, span.start, span.start + span.length), stack)
    windows = tuple(layer_windows(spec)[i] for i in layer_ids)
    body = partial(_layer, kind=span.kind, spec=spec, cfg=cfg, ctx=ctx, windows=windows)
    if cfg.remat != "none":
        body = jax.checkpoint(body, prevent_cse=False, policy=remat.policy(cfg.remat))
    return jax.lax.scan(body, x_BLD, (stack, jnp.asarray(windows, jnp.int32)))


def one_layer_ffn_input(x_BLD: jax.Array, p: Params, spec: ModelSpec, cfg: ModelConfig, *, kind: str,
                        window: int) -> tuple[jax.Array, jax.Array]:
    """`one_layer`, and the normalised hidden state its FFN (and its router) reads: (output, FFN input)."""
    B, L, _ = x_BLD.shape
    ctx = _context(spec, B, L, None, None)
    x_BLD, h_BLD = _attention_block(x_BLD, p, spec, cfg, ctx, jnp.int32(window), windows=(window,))
    y_BLD, _ = _ffn_block(x_BLD, h_BLD, p, kind, spec, cfg)
    return y_BLD, h_BLD


def _layer(x_BLD, layer, *, kind: str, spec: ModelSpec, cfg: ModelConfig, ctx: _Context, windows: tuple[int, ...]):
    p, window = layer
    x_BLD, h_BLD = _attention_block(x_BLD, p, spec, cfg, ctx, window, windows=windows)
    return _ffn_block(x_BLD, h_BLD, p, kind, spec, cfg, ctx.placement)


def _attention_block(x_BLD, p: Params, spec: ModelSpec, cfg: ModelConfig, ctx: _Context, window, *,
                     windows: tuple[int, ...]):
    """The residual stream after the layer's attention, and its normalisation for the FFN; `window` (traced)
    is one of `windows`, the sliding windows of the layers run with this one (0: full attention)."""
    x_BLD = ctx.placement.constrain(x_BLD, ACTIVATION_AXES)
    if any(windows):
        visible_BLS = nn.window_mask(ctx.visible_BLS, ctx.distance, window)
    else:
        visible_BLS = None if ctx.causal_only else ctx.visible_BLS
    if cfg.attention == "flexprefill":
        raise ValueError("flexprefill attention chooses its blocks per layer on the host: run it through "
                         "upcycler.train.evaluation.prefill, not the jitted forward")
    q_BLHh, k_BLKh, v_BLKh = _qkv(x_BLD, p, spec, ctx)
    if cfg.attention == "splash":
        out_BLHh = splash.attention(q_BLHh, k_BLKh, v_BLKh, segment_ids_BL=ctx.segment_ids_BL, window=window,
                                    windows=windows, placement=ctx.placement, token_index_BL=ctx.token_index_BL,
                                    exchange=cfg.context_exchange)
    else:
        # split along the sequence (context parallelism), the queries stay local and the keys and values
        # are gathered whole; on one device or an unsplit sequence these constraints move nothing
        k_BLKh, v_BLKh = (ctx.placement.constrain(a, KV_AXES) for a in (k_BLKh, v_BLKh))
        out_BLHh = nn.attention(q_BLHh, k_BLKh, v_BLKh, visible_BLS, impl=cfg.attention, chunk=cfg.attention_chunk)
    return _attention_residual(x_BLD, checkpoint_name(out_BLHh, remat.CONTEXT), p, spec)


def _attention_residual(x_BLD, out_BLHh, p: Params, spec: ModelSpec):
    """The residual stream after adding the attention's output projection, and its normalisation for the FFN."""
    B, L, H, h = out_BLHh.shape
    o_BLD = nn.linear(out_BLHh.reshape(B, L, H * h), p["attn"]["o_proj"], p["attn"].get("o_bias"))
    x_BLD = x_BLD + checkpoint_name(o_BLD, remat.ATTENTION_OUT)
    return x_BLD, checkpoint_name(nn.rms_norm(x_BLD, p["mlp_norm"], spec.rms_norm_eps), remat.FFN_INPUT)


def _ffn_block(x_BLD, h_BLD, p: Params, kind: str, spec: ModelSpec, cfg: ModelConfig,
               placement: Placement = ONE_DEVICE):
    """The residual stream after the layer's FFN (dense or MoE) and the router's aux outputs (None: dense)."""
    if kind == "dense":
        return x_BLD + checkpoint_name(nn.gated_mlp(h_BLD, p["mlp"], spec.hidden_act), remat.FFN_OUT), None
    y_BLD, router_aux = _moe(h_BLD, p["moe"], spec, cfg, placement)
    return x_BLD + checkpoint_name(y_BLD, remat.FFN_OUT), router_aux


def _qkv(x_BLD, p: Params, spec: ModelSpec, ctx: _Context) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The layer's queries [B, L, H, h] and keys and values [B, L, K, h] (q/k-normed and rotated)."""
    B, L, _ = x_BLD.shape
    H, K, h = spec.num_heads, spec.num_kv_heads, spec.head_dim
    a, x_BLD = p["attn"], nn.rms_norm(x_BLD, p["attn_norm"], spec.rms_norm_eps)
    q_BLHh = nn.linear(x_BLD, a["q_proj"], a.get("q_bias")).reshape(B, L, H, h)
    k_BLKh = nn.linear(x_BLD, a["k_proj"], a.get("k_bias")).reshape(B, L, K, h)
    v_BLKh = nn.linear(x_BLD, a["v_proj"], a.get("v_bias")).reshape(B, L, K, h)
    if spec.qk_norm:
        q_BLHh = nn.rms_norm(q_BLHh, a["q_norm"], spec.rms_norm_eps)
        k_BLKh = nn.rms_norm(k_BLKh, a["k_norm"], spec.rms_norm_eps)
    q_BLHh = checkpoint_name(nn.apply_rope(q_BLHh, ctx.cos_BLR, ctx.sin_BLR), remat.QUERY)
    k_BLKh = checkpoint_name(nn.apply_rope(k_BLKh, ctx.cos_BLR, ctx.sin_BLR), remat.KEY)
    return q_BLHh, k_BLKh, checkpoint_name(v_BLKh, remat.VALUE)


def layer_qkv(x_BLD: jax.Array, p: Params, spec: ModelSpec, cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer's attention inputs on its own (positions 0..L−1): (q [B, L, H, h], k, v [B, L, K, h]) in the
    compute dtype. With `layer_output`, the layer split around its attention, for a prefill that chooses
    how to attend on the host (`upcycler.train.evaluation.prefill`)."""
    B, L, _ = x_BLD.shape
    return _qkv(x_BLD, p, spec, _context(spec, B, L, None, None))


def attention_of(q_BLHh: jax.Array, k_BLKh: jax.Array, v_BLKh: jax.Array, spec: ModelSpec, *,
                 window: int) -> jax.Array:
    """Per-head attention output [B, L, H, h] of queries and keys that are normed but not yet rotated
    (positions 0..L−1, causal, within `window` when it is not 0), as the layer computes it."""
    B, L = q_BLHh.shape[:2]
    ctx = _context(spec, B, L, None, None)
    visible_BLS = nn.window_mask(ctx.visible_BLS, ctx.distance, window) if window else None
    q_BLHh, k_BLKh = nn.apply_rope(q_BLHh, ctx.cos_BLR, ctx.sin_BLR), nn.apply_rope(k_BLKh, ctx.cos_BLR, ctx.sin_BLR)
    return nn.attention(q_BLHh, k_BLKh, v_BLKh, visible_BLS, impl="einsum", chunk=0)


def layer_output(x_BLD: jax.Array, out_BLHh: jax.Array, p: Params, spec: ModelSpec, cfg: ModelConfig, *,
                 kind: str) -> jax.Array:
    """The layer's output given its input and its attention's per-head output: the rest of `one_layer`."""
    x_BLD, h_BLD = _attention_residual(x_BLD, out_BLHh, p, spec)
    y_BLD, _ = _ffn_block(x_BLD, h_BLD, p, kind, spec, cfg)
    return y_BLD


def _moe(
    x_BLD, p: Params, spec: ModelSpec, cfg: ModelConfig, placement: Placement
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Routed (+ shared) experts: y [B, L, D] and (router logits [B, L, E], chosen experts [B, L, k])."""
    moe_spec = spec.moe
    B, L, D = x_BLD.shape
    x_TD = x_BLD.reshape(B * L, D)
    logits_TE = checkpoint_name(moe.router_logits(x_TD, p["router"]), remat.ROUTER_LOGITS)
    routing = moe.route(
        logits_TE, moe_spec.top_k, moe_spec.router, moe_spec.routed_scaling_factor, p.get("router_bias")
    )
    experts = p["experts"]  # canonical [E, out, in]: gate and up fused as [E, in, out], down read as stored
    w_gate_up_EDU = moe.fuse_gate_up(
        *(jnp.swapaxes(experts[name], 1, 2).astype(x_BLD.dtype) for name in ("gate_proj", "up_proj"))
    )
    w_down_EDF = experts["down_proj"].astype(x_BLD.dtype)
    if cfg.moe_impl == "dropless":
        y_TD = expert_parallel.moe_layer(x_TD, w_gate_up_EDU, w_down_EDF, routing, cfg, placement)
    elif cfg.moe_impl == "reference":
        y_TD = moe.onehot_moe_reference(x_TD, w_gate_up_EDU, w_down_EDF, routing)
    else:
        raise ValueError(f"moe_impl must be dropless or reference, not {cfg.moe_impl!r}")
    y_BLD = y_TD.reshape(B, L, D)
    if moe_spec.shared_width:
        shared_BLD = nn.gated_mlp(x_BLD, p["shared"], spec.hidden_act)
        if moe_spec.shared_gated:
            shared_BLD = jax.nn.sigmoid(nn.linear(x_BLD, p["shared_gate"])) * shared_BLD
        y_BLD = y_BLD + shared_BLD
    aux = (logits_TE.reshape(B, L, -1), routing.expert_Tk.reshape(B, L, -1))
    return y_BLD, aux
