"""Rows past the groups, for the grouped-matmul kernels that leave them unwritten (megablox, Mosaic GPU).

A kernel computes only the rows some group owns (the first sum(group_sizes)); the rest of its output, and
of the dx its backward pass computes, hold whatever the buffer held. These helpers round shapes up to a
kernel's tiles and zero those rows, in the result and in the cotangent that reaches x, so neither a result
nor a gradient sees them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def round_up(size: int, multiple: int) -> int:
    """`size` rounded up to a multiple of `multiple`, and at least one multiple (an empty axis too)."""
    return max(multiple, -(-size // multiple) * multiple)


def _rows_below(total: jax.Array, rows: int) -> jax.Array:
    """[rows, 1] mask of the rows before `total` (the rows some group owns)."""
    return (lax.iota(jnp.int32, rows) < total)[:, None]


def zero_rows_past(a: jax.Array, total: jax.Array) -> jax.Array:
    """`a` with rows from `total` on set to 0; a select, so whatever they held (NaN included) is dropped,
    and the VJP passes the cotangent of the kept rows only."""
    return jnp.where(_rows_below(total, a.shape[0]), a, jnp.zeros((), a.dtype))


@jax.custom_vjp
def zero_cotangent_past(x: jax.Array, total: jax.Array) -> jax.Array:
    """Identity on `x`; its VJP zeroes the cotangent rows from `total` on (free in the forward pass)."""
    return x


def _zero_cotangent_past_fwd(x, total):
    return x, total


def _zero_cotangent_past_bwd(total, g):
    return zero_rows_past(g, total), None


zero_cotangent_past.defvjp(_zero_cotangent_past_fwd, _zero_cotangent_past_bwd)
