"""The routed-expert MoE layer as pure array functions: router, dropless dispatch, reference, losses.

Shape suffixes (the key for every name below):
    B batch, L length, T tokens (B·L flattened), D model dim, F expert width, E experts, K top-k,
    H gate and up stacked (2F), N token copies (T·K), R rows of the expert-sorted buffer (N, or fewer
    with a capacity).

Expert weights, input dimension first (a model loading Hugging Face `[out, in]` tensors transposes them),
with gate and up stacked along the output dimension (H = 2F) so one grouped matmul computes both:
    w_gate_up_EDH [E, D, 2F]   [..., :F] is gate_proj[e]^T, [..., F:] is up_proj[e]^T  (`fuse_gate_up`)
    w_down_EFD    [E, F, D]    down_proj[e]^T
    expert e computes  (silu(x @ gate_e) * (x @ up_e)) @ w_down_EFD[e]

Pipeline of `dropless_moe` (Megablocks-style, no capacity, no dropped tokens):
    route -> stable argsort of the N copies by expert -> gather rows -> one grouped matmul for gate and
    up -> silu(gate) * up -> grouped matmul for down -> gather back per copy with an fp32 weighted sum
    over K. Both gathers have custom VJPs that are gathers too (no scatter-add in the backward pass).
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from upcycler.train.gmm import DEFAULT_TILE_ROWS, Backend, gmm

RouterKind = Literal["renormalized", "unnormalized", "sigmoid"]
ROUTER_KINDS: tuple[str, ...] = ("renormalized", "unnormalized", "sigmoid")
LossScope = Literal["batch", "sequence"]


class Routing(NamedTuple):
    """The router's decision per token: chosen experts (by decreasing selection score) and their weights."""

    expert_TK: jax.Array  # int32
    weight_TK: jax.Array  # float32


class Dispatch(NamedTuple):
    """Where each token copy goes in the expert-sorted buffer, and back.

    Copy n = t·K + k. `pos_N[n]` is its row in the buffer (R if dropped); `copy_R[r]` is the copy held by
    row r (N if the row is empty). Rows hold experts 0, 1, ... in order, `group_sizes_E` rows each.
    """

    group_sizes_E: jax.Array
    pos_N: jax.Array
    copy_R: jax.Array


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
        weight_TK, expert_TK = lax.top_k(scores_TE, top_k)
    else:
        _, expert_TK = lax.top_k(scores_TE + selection_bias_E.astype(jnp.float32), top_k)
        weight_TK = jnp.take_along_axis(scores_TE, expert_TK, axis=-1)
    if router_kind == "sigmoid":
        weight_TK = weight_TK / (jnp.sum(weight_TK, axis=-1, keepdims=True) + 1e-20)
    elif router_kind == "renormalized":
        weight_TK = weight_TK / jnp.sum(weight_TK, axis=-1, keepdims=True)
    return Routing(expert_TK.astype(jnp.int32), weight_TK * routed_scaling_factor)


# --------------------------------------------------------------------------------------------- dispatch


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Rows per expert under a capacity: ceil(capacity_factor · T·K / E), at least 1."""
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def plan_dispatch(expert_TK: jax.Array, num_experts: int, capacity: int | None = None) -> Dispatch:
    """Sort the T·K token copies by expert (stable, so ties keep token order).

    Without a capacity every copy gets a row (R = N). With one, each expert keeps its first `capacity`
    copies in token order and the rest are dropped (R = min(N, E·capacity)).
    """
    expert_N = expert_TK.reshape(-1)
    n = expert_N.shape[0]
    order_N = jnp.argsort(expert_N, stable=True).astype(jnp.int32)
    counts_E = jnp.bincount(expert_N, length=num_experts).astype(jnp.int32)
    pos_N = jnp.zeros(n, jnp.int32).at[order_N].set(jnp.arange(n, dtype=jnp.int32), unique_indices=True)
    if capacity is None:
        return Dispatch(counts_E, pos_N, order_N)
    rows = min(n, num_experts * capacity)
    rank_N = pos_N - (jnp.cumsum(counts_E) - counts_E)[expert_N]
    sizes_E = jnp.minimum(counts_E, capacity)
    kept_pos_N = (jnp.cumsum(sizes_E) - sizes_E)[expert_N] + rank_N
    pos_N = jnp.where(rank_N < capacity, kept_pos_N, rows)
    copy_R = jnp.full(rows, n, jnp.int32).at[pos_N].set(jnp.arange(n, dtype=jnp.int32), mode="drop")
    return Dispatch(sizes_E, pos_N, copy_R)


def _take_rows(src_AD: jax.Array, index_B: jax.Array) -> jax.Array:
    """src_AD[index_B], with 0 for out-of-range indices (the sentinels for empty rows and dropped copies)."""
    return jnp.take(src_AD, index_B, axis=0, mode="fill", fill_value=0)


def _sum_rows(src_AD: jax.Array, index_TK: jax.Array, weight_TK: jax.Array | None = None) -> jax.Array:
    """Σ_k weight_TK[:, k] · src_AD[index_TK[:, k]] in fp32, one k at a time (no [T, K, D] intermediate)."""
    total_TD = None
    for k in range(index_TK.shape[1]):
        rows_TD = _take_rows(src_AD, index_TK[:, k]).astype(jnp.float32)
        if weight_TK is not None:
            rows_TD = rows_TD * weight_TK[:, k, None].astype(jnp.float32)
        total_TD = rows_TD if total_TD is None else total_TD + rows_TD
    return total_TD


@jax.custom_vjp
def dispatch_rows(x_TD: jax.Array, copy_R: jax.Array, pos_TK: jax.Array) -> jax.Array:
    """The expert-sorted buffer x_RD: row r holds the token of copy `copy_R[r]` (0 for an empty row).

    `pos_TK` must be the inverse map (the row of copy t·K + k); the backward pass uses it to sum each
    token's K row gradients with gathers instead of a scatter-add.
    """
    return _take_rows(x_TD, copy_R // pos_TK.shape[1])


def _dispatch_rows_fwd(x_TD, copy_R, pos_TK):
    return dispatch_rows(x_TD, copy_R, pos_TK), pos_TK


def _dispatch_rows_bwd(pos_TK, g_RD):
    return _sum_rows(g_RD, pos_TK).astype(g_RD.dtype), None, None


dispatch_rows.defvjp(_dispatch_rows_fwd, _dispatch_rows_bwd)


@jax.custom_vjp
def combine_rows(y_RD: jax.Array, weight_TK: jax.Array, pos_TK: jax.Array, copy_R: jax.Array) -> jax.Array:
    """y_TD[t] = Σ_k weight_TK[t, k] · y_RD[pos_TK[t, k]] in fp32 (a dropped copy, pos = R, adds 0).

    Undoes the expert sort and applies the combine weights in one gather-and-reduce. The backward pass is
    gathers too: d y_RD[r] = weight(copy_R[r]) · g_TD[token(copy_R[r])], d weight_TK = <y_RD[pos], g_TD>.
    """
    return _sum_rows(y_RD, pos_TK, weight_TK)


def _combine_rows_fwd(y_RD, weight_TK, pos_TK, copy_R):
    return combine_rows(y_RD, weight_TK, pos_TK, copy_R), (y_RD, weight_TK, pos_TK, copy_R)


def _combine_rows_bwd(residuals, g_TD):
    y_RD, weight_TK, pos_TK, copy_R = residuals
    top_k = pos_TK.shape[1]
    g_TD = g_TD.astype(jnp.float32)
    weight_R = _take_rows(weight_TK.reshape(-1).astype(jnp.float32), copy_R)
    d_y_RD = (_take_rows(g_TD, copy_R // top_k) * weight_R[:, None]).astype(y_RD.dtype)
    d_weight_K = [
        jnp.sum(_take_rows(y_RD, pos_TK[:, k]).astype(jnp.float32) * g_TD, axis=-1) for k in range(top_k)
    ]
    return d_y_RD, jnp.stack(d_weight_K, axis=1).astype(weight_TK.dtype), None, None


combine_rows.defvjp(_combine_rows_fwd, _combine_rows_bwd)


# ------------------------------------------------------------------------------------------------ layers


def fuse_gate_up(w_gate_EDF: jax.Array, w_up_EDF: jax.Array) -> jax.Array:
    """Stack gate and up weights `[E, D, F]` into the `w_gate_up_EDH` layout `[E, D, 2F]` (gate first)."""
    return jnp.concatenate([w_gate_EDF, w_up_EDF], axis=-1)


def split_gate_up(w_gate_up_EDH: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inverse of `fuse_gate_up`: (w_gate_EDF, w_up_EDF)."""
    width = w_gate_up_EDH.shape[-1] // 2
    return w_gate_up_EDH[..., :width], w_gate_up_EDH[..., width:]


@jax.custom_vjp
def swiglu(h_RH: jax.Array) -> jax.Array:
    """silu(gate) * up for rows holding [gate | up] side by side: [..., 2F] -> [..., F].

    The custom VJP keeps only `h_RH` for the backward pass and recomputes the sigmoid there, so no
    [..., F] sigmoid or silu is stored; forward and backward are each one pass over memory.
    """
    gate, up = _halves(h_RH)
    return jax.nn.silu(gate) * up


def _halves(h_RH: jax.Array) -> tuple[jax.Array, jax.Array]:
    h_R2F = h_RH.reshape(*h_RH.shape[:-1], 2, h_RH.shape[-1] // 2)
    return h_R2F[..., 0, :], h_R2F[..., 1, :]


def _swiglu_fwd(h_RH):
    return swiglu(h_RH), h_RH


def _swiglu_bwd(h_RH, g_RF):
    gate, up = (half.astype(jnp.float32) for half in _halves(h_RH))
    g = g_RF.astype(jnp.float32)
    # sigmoid written through tanh so XLA does not share it with the forward pass and store it
    sig = 0.5 + 0.5 * jnp.tanh(0.5 * gate)
    d_gate_up = jnp.stack([g * up * sig * (1 + gate * (1 - sig)), g * gate * sig], axis=-2)
    return (d_gate_up.reshape(h_RH.shape).astype(h_RH.dtype),)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def dropless_moe(
    x_TD: jax.Array,
    w_gate_up_EDH: jax.Array,
    w_down_EFD: jax.Array,
    routing: Routing,
    *,
    backend: Backend = "auto",
    capacity_factor: float | None = None,
    tile_rows: tuple[int, ...] = DEFAULT_TILE_ROWS,
) -> jax.Array:
    """y_TD = Σ_k weight_TK[:, k] · expert_{expert_TK[:, k]}(x_TD), every token copy computed once.

    Equals `onehot_moe_reference` (up to fp32 summation order). With `capacity_factor`, each expert
    processes at most ceil(capacity_factor · T·K / E) copies, the earliest tokens first; a dropped copy
    contributes 0 (the token keeps its other experts, and the residual path outside this layer).
    Output dtype is `x_TD.dtype`; jit-friendly (all shapes static) and differentiable in every input.
    """
    _check_expert_shapes(x_TD, w_gate_up_EDH, w_down_EFD, routing)
    t, top_k = routing.expert_TK.shape
    num_experts = w_gate_up_EDH.shape[0]
    capacity = None
    if capacity_factor is not None:
        capacity = expert_capacity(t, top_k, num_experts, capacity_factor)
    plan = plan_dispatch(routing.expert_TK, num_experts, capacity)
    pos_TK = plan.pos_N.reshape(t, top_k)
    x_RD = dispatch_rows(x_TD, plan.copy_R, pos_TK)
    h_RH = gmm(x_RD, w_gate_up_EDH, plan.group_sizes_E, backend=backend, tile_rows=tile_rows)
    y_RD = gmm(swiglu(h_RH), w_down_EFD, plan.group_sizes_E, backend=backend, tile_rows=tile_rows)
    y_TD = combine_rows(y_RD, routing.weight_TK, pos_TK, plan.copy_R)
    return y_TD.astype(x_TD.dtype)


def onehot_moe_reference(
    x_TD: jax.Array,
    w_gate_up_EDH: jax.Array,
    w_down_EFD: jax.Array,
    routing: Routing,
) -> jax.Array:
    """The same layer computed the plain way: every expert on every token, masked by its combine weight.

    A loop over experts (`lax.scan`) so memory holds one expert's activations at a time in the forward
    pass. Costs E/K times the FLOPs of the dropless path; for tests and benchmarks only.
    """
    _check_expert_shapes(x_TD, w_gate_up_EDH, w_down_EFD, routing)
    num_experts = w_gate_up_EDH.shape[0]
    onehot_TKE = jax.nn.one_hot(routing.expert_TK, num_experts, dtype=jnp.float32)
    combine_ET = jnp.einsum("tke,tk->et", onehot_TKE, routing.weight_TK.astype(jnp.float32))

    def one_expert(y_TD, expert):
        w_gate_up_DH, w_down_FD, combine_T = expert
        y_e_TD = (swiglu(x_TD @ w_gate_up_DH) @ w_down_FD).astype(jnp.float32)
        return y_TD + combine_T[:, None] * y_e_TD, None

    init = jnp.zeros(x_TD.shape, jnp.float32)
    y_TD, _ = lax.scan(one_expert, init, (w_gate_up_EDH, w_down_EFD, combine_ET))
    return y_TD.astype(x_TD.dtype)


def _check_expert_shapes(x_TD, w_gate_up_EDH, w_down_EFD, routing: Routing) -> None:
    e, d, h = w_gate_up_EDH.shape
    if h % 2 or w_down_EFD.shape != (e, h // 2, d) or x_TD.shape[-1] != d:
        raise ValueError(
            f"expert weights want w_gate_up_EDH [E, D, 2F] and w_down_EFD [E, F, D] for x [T, D]; "
            f"got {w_gate_up_EDH.shape}, {w_down_EFD.shape}, x {x_TD.shape}"
        )
    if routing.expert_TK.shape[0] != x_TD.shape[0]:
        raise ValueError(f"routing is for {routing.expert_TK.shape[0]} tokens, x has {x_TD.shape[0]}")


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

    f_e: fraction of the K·(valid tokens) assignments that went to e (a count, no gradient).
    P_e: mean router probability of e (softmax; for the sigmoid router, scores divided by their sum).
    1.0 when assignments are uniform, E when every token goes to one expert with probability 1.
    Positions with mask 0 change nothing. Shapes: logits [..., E], topk_idx [..., K], mask [...] (or None).
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
    """Token copies routed to each expert over the unmasked tokens: int32 [E], summing to K·(valid tokens)."""
    valid = _valid_mask(mask, topk_idx.shape[:-1])
    weights = jnp.broadcast_to(valid[..., None], topk_idx.shape).reshape(-1)
    counts = jnp.bincount(topk_idx.reshape(-1), weights=weights, length=num_experts)
    return jnp.round(counts).astype(jnp.int32)
