"""The `"megablox"` grouped-matmul backend: JAX's Pallas TPU kernel behind the contract of `gmm.py`.

`jax.experimental.pallas.ops.tpu.megablox.gmm` computes only the tiles that hold rows of some group (a
tile crossing a group boundary is visited once per group it holds) and brings its own VJP: dx is the
same kernel against the transposed weights and dW a transposed grouped matmul (`tgmm`). This module only
fits our arguments to what the kernel accepts and its result to the contract:

- Shapes. The kernel wants the rows a multiple of the row tile `tm`, and the in/out widths multiples of
  their tiles `tk`/`tn`, which TPU wants to be multiples of 128. Widths are zero-padded up to a multiple
  of 128 (zero columns of x against zero rows of w add nothing: exact) and rows up to a multiple of 128
  (the padded rows lie past sum(group_sizes), so no group reads them); the padding is sliced off the
  result. Each tile is the largest of 512, 256, 128 dividing its padded dimension, rows included. With 512
  everywhere, the double-buffered fp32 operand and output tiles plus the accumulator take about 7 MiB
  of VMEM, under the default scoped limit (an fp32 compile for v5e with all three tiles at 512
  succeeds); larger tiles would approach it. Large tiles mean few grid steps and full MXU passes; the
  cost of a large row tile is the shared tile at each group boundary, computed once per group it holds:
  at most (G - 1) extra tiles over the whole matrix.
- Rows past sum(group_sizes). The kernel never writes them (they hold whatever the buffer held, NaN in
  interpret mode), and the dx it computes has the same hole. The output is masked to zero there and the
  cotangent reaching x is masked the same way, so neither the result nor a gradient sees those values.
  dW needs nothing: `tgmm` selects (not multiplies) the rows of each group.
- Precision. The kernels accumulate in an fp32 scratch whatever their output dtype, so the output is
  asked for in x's dtype directly. That also keeps the cotangent of the backward pass in x's dtype (as
  the tiled backend casts dy): with bf16 activations and weights, dx and dW run as bf16 products with
  fp32 accumulation; an fp32 output would make them fp32 products (mixed operands are upcast) and double
  the output's memory traffic. Inputs must be float32 or bfloat16 (the kernels' dtypes).
- `interpret=True` runs the kernel through the Pallas interpreter on any platform. It is for tests on
  hosts without a TPU, and slow; `gmm.gmm` sets it whenever the target platform is not TPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox_ops

from upcycler.train.model.gmm_rows import round_up, zero_cotangent_past, zero_rows_past

LANE = 128  # TPU tiles of the minor dimensions are multiples of this
TILE_SIZES: tuple[int, ...] = (512, 256, 128)  # tried largest first, for rows and both widths
KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def megablox_gmm(x_sorted: jax.Array, w: jax.Array, group_sizes: jax.Array, *, interpret: bool) -> jax.Array:
    """`gmm.gmm`'s contract on the megablox kernel: rows of group g times `w[g]`, rows past the groups 0.

    `x_sorted` [M, in], `w` [G, in, out], `group_sizes` [G] int32 with sum <= M; returns [M, out] in
    `x_sorted.dtype` (products accumulate in fp32). Differentiable (reverse mode) in `x_sorted` and `w`,
    with finite gradients for rows past sum(group_sizes) (zero for x, no contribution to w). Any M, in,
    out: padding is added and removed here, never visible in the result.
    """
    for name, arr in (("x_sorted", x_sorted), ("w", w)):
        if jnp.dtype(arr.dtype) not in KERNEL_DTYPES:
            raise ValueError(f"the megablox gmm backend takes float32 or bfloat16 {name}, not {arr.dtype}")
    m, k, n = x_sorted.shape[0], w.shape[1], w.shape[2]
    m_pad, k_pad, n_pad = (round_up(d, LANE) for d in (m, k, n))
    tiling = (tile_for(m_pad), tile_for(k_pad), tile_for(n_pad))
    group_sizes = group_sizes.astype(jnp.int32)
    total = jnp.sum(group_sizes)

    x_padded = jnp.pad(x_sorted, ((0, m_pad - m), (0, k_pad - k)))
    w_padded = jnp.pad(w, ((0, 0), (0, k_pad - k), (0, n_pad - n)))
    x_padded = zero_cotangent_past(x_padded, total)
    # positional: the kernel's custom VJP marks (preferred_element_type, tiling, transpose_rhs, interpret)
    # as non-differentiable by position; group_offset and existing_out stay None
    out_padded = megablox_ops.gmm(
        x_padded, w_padded, group_sizes, x_sorted.dtype, tiling, None, None, False, interpret
    )
    return zero_rows_past(out_padded, total)[:m, :n]


def tile_for(size: int) -> int:
    """The largest of `TILE_SIZES` dividing `size` (a multiple of `LANE`, so at least `LANE` fits)."""
    if size % LANE:
        raise ValueError(f"tile_for wants a multiple of {LANE}, got {size}")
    return next(t for t in TILE_SIZES if size % t == 0)
