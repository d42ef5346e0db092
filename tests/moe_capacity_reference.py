"""A capacity-limited (token-dropping) MoE layer, kept for tests only.

The library's layer is dropless (`upcycler.train.model.moe.dropless_moe`). This module checks that its
building blocks (`dispatch_rows`, `combine_rows`, `gmm`) also handle a buffer with fewer rows than token
copies: each expert keeps its first `capacity` copies in token order and a dropped copy contributes 0.
Shape suffixes follow the dimension key of `upcycler.train.model`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from upcycler.train.model import moe
from upcycler.train.model.gmm import DEFAULT_TILE_ROWS, Backend, gmm


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Rows per expert under a capacity: ceil(capacity_factor · T·k / E), at least 1."""
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def plan_capacity_dispatch(expert_Tk: jax.Array, num_experts: int, capacity: int) -> moe.Dispatch:
    """Like `moe.plan_dispatch`, but each expert keeps only its first `capacity` copies.

    The buffer has X = min(C, E·capacity) rows; a dropped copy's row is X and an empty row's copy is C
    (both out of range, so the gathers read them as 0).
    """
    full = moe.plan_dispatch(expert_Tk, num_experts)
    expert_C = expert_Tk.reshape(-1)
    n = expert_C.shape[0]
    counts_E = full.group_sizes_E
    rows = min(n, num_experts * capacity)
    rank_C = full.pos_C - (jnp.cumsum(counts_E) - counts_E)[expert_C]
    sizes_E = jnp.minimum(counts_E, capacity)
    kept_pos_C = (jnp.cumsum(sizes_E) - sizes_E)[expert_C] + rank_C
    pos_C = jnp.where(rank_C < capacity, kept_pos_C, rows)
    copy_X = jnp.full(rows, n, jnp.int32).at[pos_C].set(jnp.arange(n, dtype=jnp.int32), mode="drop")
    return moe.Dispatch(sizes_E, pos_C, copy_X)


def capacity_moe(
    x_TD: jax.Array,
    w_gate_up_EDU: jax.Array,
    w_down_EDF: jax.Array,
    routing: moe.Routing,
    *,
    backend: Backend = "auto",
    capacity_factor: float,
    tile_rows: tuple[int, ...] = DEFAULT_TILE_ROWS,
) -> jax.Array:
    """`moe.dropless_moe` with at most ceil(capacity_factor · T·k / E) copies per expert.

    The earliest tokens are kept; a dropped copy contributes 0 (the token keeps its other experts).
    """
    t, top_k = routing.expert_Tk.shape
    num_experts = w_gate_up_EDU.shape[0]
    capacity = expert_capacity(t, top_k, num_experts, capacity_factor)
    plan = plan_capacity_dispatch(routing.expert_Tk, num_experts, capacity)
    pos_Tk = plan.pos_C.reshape(t, top_k)
    x_XD = moe.dispatch_rows(x_TD, plan.copy_X, pos_Tk)
    h_XU = gmm(x_XD, w_gate_up_EDU, plan.group_sizes_E, backend=backend, tile_rows=tile_rows)
    y_XD = gmm(moe.swiglu(h_XU), w_down_EDF, plan.group_sizes_E, backend=backend, tile_rows=tile_rows,
               transpose_rhs=True)
    y_TD = moe.combine_rows(y_XD, routing.weight_Tk, pos_Tk, plan.copy_X)
    return y_TD.astype(x_TD.dtype)
