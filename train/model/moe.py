"""The routed-expert MoE layer as pure array functions: router, dropless dispatch, reference, losses.

Shape suffixes follow the dimension key of `upcycler.train.model`; the ones used here:
    T tokens (B·L flattened), D model width, F expert width, U gate and up stacked (2F), E experts,
    k experts per token, C token copies (T·k), X rows of the expert-sorted buffer (one per copy).

Expert weights: gate and up input dimension first, stacked along the output dimension (U = 2F) so one
grouped matmul computes both; down as stored (Hugging Face's `[out, in]`), which the grouped matmul reads
transposed (`transpose_rhs`), so the weight FSDP gathers reaches the kernel without a relayout in HBM:
    w_gate_up_EDU [E, D, 2F]   [..., :F] is gate_proj[e]^T, [..., F:] is up_proj[e]^T  (`fuse_gate_up`)
    w_down_EDF    [E, D, F]    down_proj[e]
    expert e computes  (silu(x @ gate_e) * (x @ up_e)) @ w_down_EDF[e]^T

Pipeline of `dropless_moe` (Megablocks-style, no capacity, no dropped tokens):
    route -> stable argsort of the C copies by expert -> gather rows -> one grouped matmul for gate and
    up -> silu(gate) * up -> grouped matmul for down -> gather back per copy with an fp32 weighted sum
    over k. Both gathers have custom VJPs that are gathers too (no scatter-add in the backward pass).
"""

from __future__ import annotations

from functools import partial
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from upcycler.spec import ROUTER_KINDS, RouterKind
from upcycler.train.model.gmm import DEFAULT_TILE_ROWS, Backend, gmm
from upcycler.train.model.remat import EXPERT_OUT, FFN_HIDDEN, MOE_DISPATCHED, MOE_ROUTING

LossScope = Literal["batch", "sequence"]


class Routing(NamedTuple):
    """The router's decision per token: chosen experts (by decreasing selection score) and their weights."""

    expert_Tk: jax.Array  # int32
    weight_Tk: jax.Array  # float32


class Dispatch(NamedTuple):
    """Where each token copy goes in the expert-sorted buffer, and back.

    Copy c = t·k + j. `pos_C[c]` is its row in the buffer; `copy_X[x]` is the copy held by row x. Rows
    hold experts 0, 1, ... in order, `group_sizes_E` rows each. The gathers below read an out-of-range
    index (a row past the buffer, a copy past C) as 0, unless told every index is in range (`in_bounds`:
    the dropless buffer, one row per copy), which spares the fill's select.
    """

    group_sizes_E: jax.Array
    pos_C: jax.Array
    copy_X: jax.Array


# ----------------------------------------------------------------------------------------------- router


def router_logits(x_TD: jax.Array, w_router_ED: jax.Array) -> jax.Array:
    """Router logits `x @ w_router^T` computed in fp32; `w_router_ED` keeps the HF `[E, D]` orientation."""
    return jnp.einsum("td,ed->te", x_TD.astype(jnp.float32), w_router_ED.astype(jnp.float32))


def router_probs(logits_TE: jax.Array, router_kind: RouterKind) -> jax.Array:
    """Per-token scores over all experts in fp32: softmax, or sigmoid for the sigmoid router."""
    logits_TE = logits_TE.astype(jnp.float32)
    if router_kind == "sigmoid":
        return jax.nn.sigmoid(logits_TE)
    return jax.nn.softmax(logits_TE, axis=-1)


def route(
    logits_TE: jax.Array,
    top_k: int,
    router_kind: RouterKind,
    routed_scaling_factor: float = 1.0,
    selection_bias_E: jax.Array | None = None,
) -> Routing:
    """Choose `top_k` experts per token and their combine weights, in fp32.

    - "renormalized": softmax, top-k, weights divided by their sum (Mixtral; Qwen with norm_topk_prob).
    - "unnormalized": softmax, top-k, weights kept as they are (Qwen default).
    - "sigmoid": sigmoid scores; top-k on scores + `selection_bias_E`; the unbiased scores of the chosen
      experts, divided by their sum (GLM-4-MoE / DeepSeek-V3 e_score_correction_bias, norm_topk_prob).
    The bias, when given, only changes which experts are chosen, for every kind. Weights are finally
    multiplied by `routed_scaling_factor` (1.0 for Mixtral and Qwen). Differentiable in the logits.
    """
    if router_kind not in ROUTER_KINDS:
        raise ValueError(f"router_kind must be one of {ROUTER_KINDS}, not {router_kind!r}")
    scores_TE = router_probs(logits_TE, router_kind)
    if selection_bias_E is None:
        weight_Tk, expert_Tk = lax.top_k(scores_TE, top_k)
    else:
        _, expert_Tk = lax.top_k(scores_TE + selection_bias_E.astype(jnp.float32), top_k)
        weight_Tk = jnp.take_along_axis(scores_TE, expert_Tk, axis=-1)
    if router_kind == "sigmoid":
        weight_Tk = weight_Tk / (jnp.sum(weight_Tk, axis=-1, keepdims=True) + 1e-20)
    elif router_kind == "renormalized":
        weight_Tk = weight_Tk / jnp.sum(weight_Tk, axis=-1, keepdims=True)
    return Routing(expert_Tk.astype(jnp.int32), weight_Tk * routed_scaling_factor)


# --------------------------------------------------------------------------------------------- dispatch


def plan_dispatch(expert_Tk: jax.Array, num_experts: int) -> Dispatch:
    """Sort the T·k token copies by expert (stable, so ties keep token order); every copy gets a row."""
    expert_C = expert_Tk.reshape(-1)
    n = expert_C.shape[0]
    order_C = jnp.argsort(expert_C, stable=True).astype(jnp.int32)
    counts_E = jnp.bincount(expert_C, length=num_experts).astype(jnp.int32)
    pos_C = jnp.zeros(n, jnp.int32).at[order_C].set(jnp.arange(n, dtype=jnp.int32), unique_indices=True)
    return Dispatch(counts_E, pos_C, order_C)


def take_rows(src: jax.Array, index: jax.Array, in_bounds: bool = False) -> jax.Array:
    """src[index] along the first axis (index of any shape), with 0 for out-of-range indices; with
    `in_bounds` the caller promises every index is in range and the gather has no fill."""
    if in_bounds:
        return src.at[index].get(mode="promise_in_bounds")
    return jnp.take(src, index, axis=0, mode="fill", fill_value=0)


def _sum_rows(src: jax.Array, index_Tk: jax.Array, weight_Tk: jax.Array | None, in_bounds: bool) -> jax.Array:
    """Σ_k weight_Tk[:, k] · src[index_Tk[:, k]] in fp32: one gather of the T·k rows and one reduction."""
    rows_TkD = take_rows(src, index_Tk, in_bounds).astype(jnp.float32)
    if weight_Tk is None:
        return jnp.sum(rows_TkD, axis=1)
    return jnp.sum(rows_TkD * weight_Tk.astype(jnp.float32)[:, :, None], axis=1)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def dispatch_rows(x_TD: jax.Array, copy_X: jax.Array, pos_Tk: jax.Array, in_bounds: bool = False) -> jax.Array:
    """The expert-sorted buffer x_XD: row x holds the token of copy `copy_X[x]`.

    `pos_Tk` must be the inverse map (the row of copy t·k + j); the backward pass uses it to sum each
    token's k row gradients with a gather instead of a scatter-add. `in_bounds`: every index of both maps
    is in range (see `Dispatch`).
    """
    return take_rows(x_TD, copy_X // pos_Tk.shape[1], in_bounds)


def _dispatch_rows_fwd(x_TD, copy_X, pos_Tk, in_bounds):
    return dispatch_rows(x_TD, copy_X, pos_Tk, in_bounds), pos_Tk


def _dispatch_rows_bwd(in_bounds, pos_Tk, g_XD):
    return _sum_rows(g_XD, pos_Tk, None, in_bounds).astype(g_XD.dtype), None, None


dispatch_rows.defvjp(_dispatch_rows_fwd, _dispatch_rows_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def combine_rows(y_XD: jax.Array, weight_Tk: jax.Array, pos_Tk: jax.Array, copy_X: jax.Array,
                 in_bounds: bool = False) -> jax.Array:
    """y_TD[t] = Σ_k weight_Tk[t, k] · y_XD[pos_Tk[t, k]] in fp32 (an out-of-range pos adds 0).

    Undoes the expert sort and applies the combine weights in one gather-and-reduce. The backward pass is
    gathers too, in y's dtype: d y_XD[x] = weight(copy_X[x]) · g_TD[token(copy_X[x])] (the cotangent
    rounded to y's dtype once, before its rows are gathered: the layer's output is in that dtype, so its
    cotangent is too), d weight_Tk = <y_XD[pos], g_TD> in fp32, from the same gathered rows.
    """
    return _sum_rows(y_XD, pos_Tk, weight_Tk, in_bounds)


def _combine_rows_fwd(y_XD, weight_Tk, pos_Tk, copy_X, in_bounds):
    return combine_rows(y_XD, weight_Tk, pos_Tk, copy_X, in_bounds), (y_XD, weight_Tk, pos_Tk, copy_X)


def _combine_rows_bwd(in_bounds, residuals, g_TD):
    y_XD, weight_Tk, pos_Tk, copy_X = residuals
    top_k = pos_Tk.shape[1]
    weight_X = take_rows(weight_Tk.reshape(-1).astype(jnp.float32), copy_X, in_bounds)
    g_rows_XD = take_rows(g_TD.astype(y_XD.dtype), copy_X // top_k, in_bounds).astype(jnp.float32)
    d_y_XD = (g_rows_XD * weight_X[:, None]).astype(y_XD.dtype)
    # <y_XD[x], g of x's token> row by row, in buffer order, then put in token order: the rows of y are
    # read where they lie rather than gathered into a [T, k, D] copy
    d_weight_X = jnp.sum(y_XD.astype(jnp.float32) * g_rows_XD, axis=-1)
    d_weight_Tk = take_rows(d_weight_X, pos_Tk, in_bounds)
    return d_y_XD, d_weight_Tk.astype(weight_Tk.dtype), None, None


combine_rows.defvjp(_combine_rows_fwd, _combine_rows_bwd)


# ------------------------------------------------------------------------------------------------ layers


def fuse_gate_up(w_gate_EDF: jax.Array, w_up_EDF: jax.Array) -> jax.Array:
    """Stack gate and up weights `[E, D, F]` into the `w_gate_up_EDU` layout `[E, D, 2F]` (gate first)."""
    return jnp.concatenate([w_gate_EDF, w_up_EDF], axis=-1)


def split_gate_up(w_gate_up_EDU: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inverse of `fuse_gate_up`: (w_gate_EDF, w_up_EDF)."""
    width = w_gate_up_EDU.shape[-1] // 2
    return w_gate_up_EDU[..., :width], w_gate_up_EDU[..., width:]


@jax.custom_vjp
def swiglu(h_XU: jax.Array) -> jax.Array:
    """silu(gate) * up for rows holding [gate | up] side by side: [..., 2F] -> [..., F].

    The custom VJP keeps only `h_XU` for the backward pass and recomputes the sigmoid there, so no
    [..., F] sigmoid or silu is stored; forward and backward are each one pass over memory. The halves are
    read as slices and the gradient written as one concatenation (no [..., 2, F] relayout copy).
    """
    gate, up = _halves(h_XU)
    return jax.nn.silu(gate) * up


def _halves(h_XU: jax.Array) -> tuple[jax.Array, jax.Array]:
    width = h_XU.shape[-1] // 2
    return h_XU[..., :width], h_XU[..., width:]


def _swiglu_fwd(h_XU):
    return swiglu(h_XU), h_XU


def _swiglu_bwd(h_XU, g_XF):
    gate, up = (half.astype(jnp.float32) for half in _halves(h_XU))
    g = g_XF.astype(jnp.float32)
    # sigmoid written through tanh so XLA does not share it with the forward pass and store it
    sig = 0.5 + 0.5 * jnp.tanh(0.5 * gate)
    d_gate, d_up = g * up * sig * (1 + gate * (1 - sig)), g * gate * sig
    return (jnp.concatenate([d_gate, d_up], axis=-1).astype(h_XU.dtype),)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def dropless_moe(
    x_TD: jax.Array,
    w_gate_up_EDU: jax.Array,
    w_down_EDF: jax.Array,
    routing: Routing,
    *,
    backend: Backend = "auto",
    tile_rows: tuple[int, ...] = DEFAULT_TILE_ROWS,
) -> jax.Array:
    """y_TD = Σ_k weight_Tk[:, k] · expert_{expert_Tk[:, k]}(x_TD), every token copy computed once.

    Equals `onehot_moe_reference` (up to fp32 summation order): no capacity, no token is dropped.
    Output dtype is `x_TD.dtype`; jit-friendly (all shapes static) and differentiable in every input.
    """
    _check_expert_shapes(x_TD, w_gate_up_EDU, w_down_EDF, routing)
    t, top_k = routing.expert_Tk.shape
    plan = Dispatch(*(checkpoint_name(a, MOE_ROUTING) for a in plan_dispatch(routing.expert_Tk, w_gate_up_EDU.shape[0])))
    pos_Tk = plan.pos_C.reshape(t, top_k)
    # every copy has its row and every row its copy: no gather needs a fill, no kernel a row mask
    x_XD = checkpoint_name(dispatch_rows(x_TD, plan.copy_X, pos_Tk, True), MOE_DISPATCHED)
    grouped = partial(gmm, group_sizes=plan.group_sizes_E, backend=backend, tile_rows=tile_rows, all_rows_grouped=True)
    h_XU = checkpoint_name(grouped(x_XD, w_gate_up_EDU), FFN_HIDDEN)
    y_XD = checkpoint_name(grouped(swiglu(h_XU), w_down_EDF, transpose_rhs=True), EXPERT_OUT)
    y_TD = combine_rows(y_XD, routing.weight_Tk, pos_Tk, plan.copy_X, True)
    return y_TD.astype(x_TD.dtype)


def onehot_moe_reference(
    x_TD: jax.Array,
    w_gate_up_EDU: jax.Array,
    w_down_EDF: jax.Array,
    routing: Routing,
) -> jax.Array:
    """The same layer computed the plain way: every expert on every token, masked by its combine weight.

    A loop over experts (`lax.scan`) so memory holds one expert's activations at a time in the forward
    pass. Costs E/k times the FLOPs of the dropless path; for tests and benchmarks only.
    """
    _check_expert_shapes(x_TD, w_gate_up_EDU, w_down_EDF, routing)
    num_experts = w_gate_up_EDU.shape[0]
    onehot_TkE = jax.nn.one_hot(routing.expert_Tk, num_experts, dtype=jnp.float32)
    combine_ET = jnp.einsum("tke,tk->et", onehot_TkE, routing.weight_Tk.astype(jnp.float32))

    def one_expert(y_TD, expert):
        w_gate_up_DU, w_down_DF, combine_T = expert
        y_e_TD = (swiglu(x_TD @ w_gate_up_DU) @ w_down_DF.T).astype(jnp.float32)
        return y_TD + combine_T[:, None] * y_e_TD, None

    init = jnp.zeros(x_TD.shape, jnp.float32)
    y_TD, _ = lax.scan(one_expert, init, (w_gate_up_EDU, w_down_EDF, combine_ET))
    return y_TD.astype(x_TD.dtype)


def _check_expert_shapes(x_TD, w_gate_up_EDU, w_down_EDF, routing: Routing) -> None:
    e, d, h = w_gate_up_EDU.shape
    if h % 2 or w_down_EDF.shape != (e, d, h // 2) or x_TD.shape[-1] != d:
        raise ValueError(
            f"expert weights want w_gate_up_EDU [E, D, 2F] and w_down_EDF [E, D, F] for x [T, D]; "
            f"got {w_gate_up_EDU.shape}, {w_down_EDF.shape}, x {x_TD.shape}"
        )
    if routing.expert_Tk.shape[0] != x_TD.shape[0]:
        raise ValueError(f"routing is for {routing.expert_Tk.shape[0]} tokens, x has {x_TD.shape[0]}")


# ------------------------------------------------------------------------------------- losses and stats


def _valid_mask(mask: jax.Array | None, shape: tuple[int, ...]) -> jax.Array:
    return jnp.ones(shape, jnp.float32) if mask is None else mask.astype(jnp.float32)


def load_balancing_loss(
    router_logits: jax.Array,
    topk_idx: jax.Array,
    mask: jax.Array | None,
    num_experts: int,
    scope: LossScope = "batch",
    *,
    router_kind: RouterKind = "renormalized",
) -> jax.Array:
    """Switch-style balance loss E · Σ_e f_e · P_e over the unmasked tokens, in fp32.

    f_e: fraction of the k·(valid tokens) assignments that went to e (a count, no gradient).
    P_e: mean router probability of e (softmax; for the sigmoid router, scores divided by their sum).
    1.0 when assignments are uniform, E when every token goes to one expert with probability 1.
    Positions with mask 0 change nothing. Shapes: logits [..., E], topk_idx [..., k], mask [...] (or None).
    scope "batch" pools all tokens; "sequence" wants [B, L, ...], computes the loss per sequence and
    averages over sequences that have a valid token.
    """
    if scope not in ("batch", "sequence"):
        raise ValueError(f"scope must be 'batch' or 'sequence', not {scope!r}")
    probs = router_probs(router_logits, router_kind)
    if router_kind == "sigmoid":
        probs = probs / (jnp.sum(probs, axis=-1, keepdims=True) + 1e-20)
    valid = _valid_mask(mask, router_logits.shape[:-1])
    if scope == "batch":
        probs = probs.reshape(1, -1, num_experts)
        topk_idx = topk_idx.reshape(1, -1, topk_idx.shape[-1])
        valid = valid.reshape(1, -1)
    elif router_logits.ndim != 3:
        raise ValueError(f"scope='sequence' wants logits [B, L, E], got {router_logits.shape}")
    count_BE = jnp.einsum("blke,bl->be", jax.nn.one_hot(topk_idx, num_experts, dtype=jnp.float32), valid)
    tokens_B = jnp.sum(valid, axis=1)
    safe_B = jnp.maximum(tokens_B, 1.0)[:, None]
    f_BE = count_BE / (safe_B * topk_idx.shape[-1])
    p_BE = jnp.einsum("ble,bl->be", probs, valid) / safe_B
    loss_B = num_experts * jnp.sum(f_BE * p_BE, axis=-1)
    has_tokens_B = (tokens_B > 0).astype(jnp.float32)
    return jnp.sum(loss_B * has_tokens_B) / jnp.maximum(jnp.sum(has_tokens_B), 1.0)


def router_z_loss(logits: jax.Array, mask: jax.Array | None) -> jax.Array:
    """Mean over unmasked tokens of logsumexp(logits)², in fp32 (ST-MoE); logits [..., E], mask [...]."""
    z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    valid = _valid_mask(mask, z.shape)
    return jnp.sum(valid * z**2) / jnp.maximum(jnp.sum(valid), 1.0)


def expert_load(topk_idx: jax.Array, mask: jax.Array | None, num_experts: int) -> jax.Array:
    """Token copies routed to each expert over the unmasked tokens: int32 [E], summing to k·(valid tokens)."""
    valid = _valid_mask(mask, topk_idx.shape[:-1])
    weights = jnp.broadcast_to(valid[..., None], topk_idx.shape).reshape(-1)
    counts = jnp.bincount(topk_idx.reshape(-1), weights=weights, length=num_experts)
    return jnp.round(counts).astype(jnp.int32)
