"""The `"mosaic_gpu"` grouped-matmul backend: JAX's Pallas Mosaic GPU kernels for Hopper behind `gmm.py`.

JAX ships two grouped kernels for NVIDIA Hopper GPUs (`jax.experimental.pallas.ops.gpu`, written with
wgmma and the tensor-memory copy engine): `ragged_dot_mgpu.ragged_dot`, rows of group g times `w[g]`
(also against `w[g]` transposed), and `transposed_ragged_dot_mgpu.transposed_ragged_dot`, the per-group
sum of `x[rows of g]ᵀ @ dy[rows of g]`. They are the forward, dx and dW of a grouped matmul; this module
wraps them in one custom VJP, so the weight gradient stays grouped (`lax.ragged_dot`'s on GPU does not:
see `gmm.py`). What this module adds to the kernels:

- Shapes. Both widths are zero-padded to a multiple of 128 (zero columns of x against zero rows of w add
  nothing: exact) and the rows to a multiple of 128 (past sum(group_sizes): no group reads them), so every
  tile is whole; the padding is sliced off the results.
- Rows past sum(group_sizes). The kernels never write them; the output and dx are zeroed there
  (`gmm_rows`). dW needs nothing: it masks each group's first and last row block itself.
- Precision. wgmma takes 16-bit operands and accumulates in fp32; results come out in x's dtype (as the
  tiled backend's). x and w must be bfloat16 or float16: with `model.compute_dtype: float32` use another
  backend.
- Where it runs: NVIDIA Hopper (sm_90) GPUs only; XLA cannot partition the kernel, so it runs whole on
  each device (one device, or inside a `jax.shard_map`), like megablox on TPU.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp

from upcycler.train.model.gmm_rows import round_up, zero_cotangent_past, zero_rows_past

KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
TILE = 128  # rows and both widths are padded to a multiple of this
# tiles of the output (block_m × block_n) and of the contraction (block_k); operands in shared memory
# take (128·64 + 64·128) · 2 bytes = 32 KiB a pipeline stage, 4 stages in flight
KERNEL_OPTIONS = {"block_m": 128, "block_n": 128, "block_k": 64, "max_concurrent_steps": 4, "grid_block_n": 1}


def mosaic_gpu_gmm(x_sorted: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                   all_rows_grouped: bool = False) -> jax.Array:
    """`gmm.gmm`'s contract on the Mosaic GPU kernels: rows of group g times `w[g]`, rows past the groups 0.

    `x_sorted` [M, in] and `w` [G, in, out], both bfloat16 or float16; `group_sizes` [G] int32 with
    sum <= M. Returns [M, out] in `x_sorted.dtype` (fp32 accumulation). Differentiable (reverse mode) in
    `x_sorted` and `w`; dW in `w`'s dtype. Any M, in, out. `all_rows_grouped` (sum(group_sizes) == M,
    promised by the caller): the only rows past the groups are the padding, which the slices drop, so the
    masks are left out.
    """
    for name, arr in (("x_sorted", x_sorted), ("w", w)):
        if jnp.dtype(arr.dtype) not in KERNEL_DTYPES:
            raise ValueError(f"the mosaic_gpu gmm backend runs 16-bit products and takes bfloat16 or float16 "
                             f"{name}, not {arr.dtype}: set model.compute_dtype bfloat16, or use gmm_backend auto")
    if x_sorted.dtype != w.dtype:
        raise ValueError(f"the mosaic_gpu gmm backend wants x_sorted and w in one dtype, not {x_sorted.dtype} "
                         f"and {w.dtype}")
    m, k, n = x_sorted.shape[0], w.shape[1], w.shape[2]
    m_pad, k_pad, n_pad = (round_up(d, TILE) for d in (m, k, n))
    group_sizes = group_sizes.astype(jnp.int32)
    x_padded = jnp.pad(x_sorted, ((0, m_pad - m), (0, k_pad - k)))
    w_padded = jnp.pad(w, ((0, 0), (0, k_pad - k), (0, n_pad - n)))
    if all_rows_grouped:
        return _grouped(x_padded, w_padded, group_sizes, True)[:m, :n]
    total = jnp.sum(group_sizes)
    x_padded = zero_cotangent_past(x_padded, total)
    return zero_rows_past(_grouped(x_padded, w_padded, group_sizes, False), total)[:m, :n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped(x: jax.Array, w: jax.Array, group_sizes: jax.Array, all_rows_grouped: bool) -> jax.Array:
    """x [M, in] @ w[g] per group on padded shapes; rows past the groups unwritten (masked by the caller).
    With `all_rows_grouped` the only rows past the groups are padding, whose cotangent is already zero."""
    return _ragged_dot(x, w, group_sizes, transpose_rhs=False)


def _grouped_fwd(x, w, group_sizes, all_rows_grouped):
    return _grouped(x, w, group_sizes, all_rows_grouped), (x, w, group_sizes)


def _grouped_bwd(all_rows_grouped, residuals, dy):
    x, w, group_sizes = residuals
    dy = dy.astype(x.dtype)
    if not all_rows_grouped:
        dy = zero_rows_past(dy, jnp.sum(group_sizes))
    dx = _ragged_dot(dy, w, group_sizes, transpose_rhs=True)  # dy_g @ w[g]ᵀ; rows past the groups unwritten
    dw = _transposed_ragged_dot(x, dy, group_sizes)  # Σ over rows of g: x_gᵀ dy_g
    return dx, dw.astype(w.dtype), None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def _ragged_dot(lhs, rhs, group_sizes, *, transpose_rhs: bool) -> jax.Array:
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # Mosaic GPU: loaded only when used

    kernel = ragged_dot_mgpu.ragged_dot
    return kernel(lhs, rhs, group_sizes=group_sizes, transpose_rhs=transpose_rhs, **_options_of(kernel))


def _transposed_ragged_dot(lhs, rhs, group_sizes) -> jax.Array:
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

    kernel = transposed_ragged_dot_mgpu.transposed_ragged_dot
    return kernel(lhs, rhs, group_sizes=group_sizes, **_options_of(kernel))


@functools.cache
def _options_of(kernel) -> dict[str, int]:
    """The `KERNEL_OPTIONS` that `kernel` takes (the kernels' tuning arguments vary between JAX releases)."""
    accepted = inspect.signature(kernel).parameters
    return {name: value for name, value in KERNEL_OPTIONS.items() if name in accepted}
