"""Grouped matrix multiply (GMM): the expert matmul of the dropless MoE layer.

Contract, shared by every backend:

    x_sorted      [M, in]      rows grouped by expert: group 0 first, then group 1, ...
    w             [G, in, out] one `in -> out` matrix per group (expert), i.e. `x @ w[g]`
    group_sizes   [G] int32    rows per group, sum(group_sizes) <= M
    returns       [M, out]     rows of group g = x_sorted[rows of g] @ w[g]; rows past sum(group_sizes) are 0

The weight layout is `[G, in, out]` (input dimension first, like a Flax kernel). Hugging Face stores expert
projections as `[out, in]`, so a model feeding HF weights transposes the last two axes once, at load time.

Backends:
- `"ragged_dot"`: `jax.lax.ragged_dot`, native on TPU and GPU. On CPU it expands to a masked dense product
  over all G groups (G times the FLOPs and memory), so it is only usable there at toy sizes.
- `"tiled"`: a CPU implementation. For each group, its rows are cut into tiles that start at the group's
  first row, so a tile never needs to cover two groups and nothing is padded: full tiles of the largest
  tile size first, then the remainder in tiles of the smaller sizes, the last one masked. The only wasted
  work is the masked tail of each group's last tile (fewer than `tile_rows[-1]` rows per group). Each tile
  is one dense matmul against the group's weight, sliced once per group. Trip counts are data dependent
  (while loops), so empty groups and absent rows cost nothing. A custom VJP makes the backward pass one
  more loop over the same tiles, computing dx (tile @ w[g]^T) and dW[g] (sum of tile^T @ dy_tile) together.
- `"auto"`: `"tiled"` on CPU, `"ragged_dot"` elsewhere.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

Backend = Literal["auto", "tiled", "ragged_dot"]
BACKENDS: tuple[str, ...] = ("auto", "tiled", "ragged_dot")
DEFAULT_TILE_ROWS: tuple[int, ...] = (512, 128)


def gmm(
    x_sorted: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    backend: Backend = "auto",
    tile_rows: tuple[int, ...] = DEFAULT_TILE_ROWS,
) -> jax.Array:
    """Grouped matmul: rows of group g of `x_sorted` times `w[g]` (`w` is `[G, in, out]`).

    Returns `[M, out]` in `x_sorted.dtype` (products accumulate in fp32). Rows past `sum(group_sizes)`
    come out zero. Differentiable in `x_sorted` and `w`; `tile_rows` (decreasing sizes) only affects
    the `"tiled"` backend's speed, never its result.
    """
    _check_shapes(x_sorted, w, group_sizes)
    group_sizes = group_sizes.astype(jnp.int32)
    resolved = resolve_backend(backend)
    if resolved == "ragged_dot":
        out = lax.ragged_dot(x_sorted, w, group_sizes, preferred_element_type=jnp.float32)
        return out.astype(x_sorted.dtype)
    return _tiled_gmm(x_sorted, w, group_sizes, _normalise_tiles(tile_rows, x_sorted.shape[0]))


def resolve_backend(backend: Backend) -> str:
    """The concrete backend `backend` stands for on the current default JAX platform."""
    if backend not in BACKENDS:
        raise ValueError(f"gmm backend must be one of {BACKENDS}, not {backend!r}")
    if backend == "auto":
        return "tiled" if jax.default_backend() == "cpu" else "ragged_dot"
    return backend


def _check_shapes(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> None:
    if x.ndim != 2 or w.ndim != 3 or group_sizes.ndim != 1:
        raise ValueError(
            f"gmm wants x [M, in], w [G, in, out], group_sizes [G]; got {x.shape}, {w.shape}, {group_sizes.shape}"
        )
    if x.shape[1] != w.shape[1] or w.shape[0] != group_sizes.shape[0]:
        raise ValueError(
            f"gmm shapes disagree: x {x.shape}, w {w.shape} (layout [G, in, out]), group_sizes {group_sizes.shape}"
        )


def _normalise_tiles(tile_rows: tuple[int, ...], m: int) -> tuple[int, ...]:
    """Distinct, decreasing tile sizes no larger than M (a tile must fit inside the rows)."""
    if not tile_rows or min(tile_rows) < 1:
        raise ValueError(f"tile_rows must be positive sizes, got {tile_rows!r}")
    return tuple(sorted({min(t, max(m, 1)) for t in tile_rows}, reverse=True))


def _dot(a: jax.Array, b: jax.Array, contract: tuple[int, int]) -> jax.Array:
    """`a` and `b` contracted on one axis each, accumulated in fp32."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _group_tiles(start: jax.Array, end: jax.Array, tiles: tuple[int, ...], m: int):
    """The tiling of rows [start, end): per tile size, (size, first row, count, masked).

    Sizes other than the last give whole tiles that lie inside the group. The last size covers the
    remainder with ceil(rest / size) tiles, masked to the group; such a tile may start before `start`
    (clamped so that it ends by row M), its mask then selects only its own rows.
    """
    plan = []
    lo = start
    for size in tiles[:-1]:
        count = (end - lo) // size
        plan.append((size, lo, count, False))
        lo = lo + count * size
    size = tiles[-1]
    plan.append((size, lo, (end - lo + size - 1) // size, True))
    del m
    return plan


def _tile_rows(row0: jax.Array, size: int, end: jax.Array, m: int, masked: bool):
    """Where a tile's slice starts (clamped into [0, M - size]) and, if masked, which rows it owns."""
    if not masked:
        return row0, None
    begin = jnp.minimum(row0, m - size)
    rows = begin + lax.iota(jnp.int32, size)
    return begin, (rows >= row0) & (rows < jnp.minimum(row0 + size, end))


def _forward_loops(x: jax.Array, w: jax.Array, group_sizes: jax.Array, tiles: tuple[int, ...]) -> jax.Array:
    m, n = x.shape[0], w.shape[2]
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes

    def per_group(g, out):
        w_g = lax.dynamic_index_in_dim(w, g, keepdims=False)
        for size, lo, count, masked in _group_tiles(starts[g], ends[g], tiles, m):

            def step(j, out, size=size, lo=lo, masked=masked):
                begin, own = _tile_rows(lo + j * size, size, ends[g], m, masked)
                y = _dot(lax.dynamic_slice_in_dim(x, begin, size), w_g, (1, 0)).astype(out.dtype)
                if own is not None:
                    y = jnp.where(own[:, None], y, lax.dynamic_slice_in_dim(out, begin, size))
                return lax.dynamic_update_slice_in_dim(out, y, begin, 0)

            out = lax.fori_loop(0, count, step, out)
        return out

    return lax.fori_loop(0, w.shape[0], per_group, jnp.zeros((m, n), x.dtype))


def _backward_loops(x, w, group_sizes, dy, tiles):
    """(dx, dw) for out = gmm(x, w): dx rows of g = dy @ w[g]^T, dw[g] = x[rows of g]^T @ dy[rows of g]."""
    m, k, n = x.shape[0], w.shape[1], w.shape[2]
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes

    def per_group(g, carry):
        dx, dw = carry
        w_g = lax.dynamic_index_in_dim(w, g, keepdims=False)
        acc = jnp.zeros((k, n), jnp.float32)
        for size, lo, count, masked in _group_tiles(starts[g], ends[g], tiles, m):

            def step(j, inner, size=size, lo=lo, masked=masked):
                dx, acc = inner
                begin, own = _tile_rows(lo + j * size, size, ends[g], m, masked)
                x_t = lax.dynamic_slice_in_dim(x, begin, size)
                dy_t = lax.dynamic_slice_in_dim(dy, begin, size)
                dx_t = _dot(dy_t, w_g, (1, 1)).astype(dx.dtype)
                if own is not None:
                    dx_t = jnp.where(own[:, None], dx_t, lax.dynamic_slice_in_dim(dx, begin, size))
                    x_t = jnp.where(own[:, None], x_t, jnp.zeros_like(x_t))
                acc = acc + _dot(x_t, dy_t, (0, 0))
                return lax.dynamic_update_slice_in_dim(dx, dx_t, begin, 0), acc

            dx, acc = lax.fori_loop(0, count, step, (dx, acc))
        dw = lax.dynamic_update_index_in_dim(dw, acc.astype(dw.dtype), g, 0)
        return dx, dw

    init = (jnp.zeros_like(x), jnp.zeros_like(w))
    return lax.fori_loop(0, w.shape[0], per_group, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiled_gmm(x, w, group_sizes, tiles):
    return _forward_loops(x, w, group_sizes, tiles)


def _tiled_gmm_fwd(x, w, group_sizes, tiles):
    return _forward_loops(x, w, group_sizes, tiles), (x, w, group_sizes)


def _tiled_gmm_bwd(tiles, residuals, dy):
    x, w, group_sizes = residuals
    dx, dw = _backward_loops(x, w, group_sizes, dy.astype(x.dtype), tiles)
    return dx, dw, None


_tiled_gmm.defvjp(_tiled_gmm_fwd, _tiled_gmm_bwd)
