"""The `"megablox"` grouped-matmul backend: JAX's Pallas TPU kernels behind the contract of `gmm.py`.

`jax.experimental.pallas.ops.tpu.megablox` computes only the tiles that hold rows of some group (a tile
crossing a group boundary is visited once per group it holds): `gmm` for the forward product and for dx
(against the transposed weights), `tgmm` for dW. This module calls those two kernels with a VJP of its own,
so each of the three gets tiles chosen for its shape and the chip's VMEM and rates (`gmm_tiles`), and fits our
arguments to what the kernels accept:

- Shapes. The kernels want the rows a multiple of the row tile, and the in/out widths multiples of their
  tiles, which TPU wants to be multiples of 128. Widths are zero-padded up to a multiple of 128 (zero
  columns of x against zero rows of w add nothing: exact) and rows up to a multiple of 128 (the padded
  rows lie past sum(group_sizes), so no group reads them); the padding is sliced off the result. With the
  rows and widths of the reference MoE nothing is padded and these are no-ops.
- Rows past sum(group_sizes). The kernels never write them (they hold whatever the buffer held, NaN in
  interpret mode), and the dx they compute has the same hole. When some rows of the buffer may lie past
  the groups (a capacity buffer, expert parallelism's worst-case buffers), the output is masked to zero
  there and so is the cotangent reaching x. When the caller knows every row belongs to a group
  (`all_rows_grouped`: the dropless layer, whose buffer holds exactly its T·k token copies), the only
  rows past the groups are the padding, which the slices drop: no mask, no pass over the rows. dW needs
  nothing: `tgmm` selects (not multiplies) the rows of each group.
- Precision. The kernels accumulate in an fp32 scratch whatever their output dtype, so the output is
  asked for in x's dtype directly. That also keeps the cotangent of the backward pass in x's dtype (as
  the tiled backend casts dy): with bf16 activations and weights, dx and dW run as bf16 products with
  fp32 accumulation. Inputs must be float32 or bfloat16 (the kernels' dtypes).
- `interpret=True` runs the kernels through the Pallas interpreter on any platform. It is for tests on
  hosts without a TPU, and slow; `gmm.gmm` sets it whenever the target platform is not TPU.
"""

from __future__ import annotations

import functools
import importlib
import os
import re

import jax
import jax.numpy as jnp

from upcycler.train.model.gmm_rows import round_up, zero_cotangent_past, zero_rows_past
from upcycler.train.model.gmm_tiles import (
    DEFAULT_FLOPS_PER_BYTE,
    DEFAULT_SCOPED_VMEM,
    LANE,
    PhaseTiles,
    phase_tiles,
)

# the kernels themselves (the package's `gmm` name is the op with megablox's own VJP, which would give the
# three kernels one tiling)
_kernels = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def megablox_gmm(x_sorted: jax.Array, w: jax.Array, group_sizes: jax.Array, *, interpret: bool,
                 all_rows_grouped: bool = False, vmem: int | None = None, transpose_rhs: bool = False) -> jax.Array:
    """`gmm.gmm`'s contract on the megablox kernels: rows of group g times `w[g]`, rows past the groups 0.

    `x_sorted` [M, in], `w` [G, in, out] (or [G, out, in] with `transpose_rhs`: the kernels read it
    transposed, and dW comes out in that layout from tgmm of dyᵀ and x), `group_sizes` [G] int32 with sum <= M (== M when
    `all_rows_grouped`, which the caller promises); returns [M, out] in `x_sorted.dtype` (products
    accumulate in fp32). Differentiable (reverse mode) in `x_sorted` and `w`, with finite gradients for
    rows past sum(group_sizes) (zero for x, no contribution to w). Any M, in, out: padding is added and
    removed here, never visible in the result. `vmem`: the scoped VMEM the tiles may use (default: the
    target chip's, `scoped_vmem`).
    """
    for name, arr in (("x_sorted", x_sorted), ("w", w)):
        if jnp.dtype(arr.dtype) not in KERNEL_DTYPES:
            raise ValueError(f"the megablox gmm backend takes float32 or bfloat16 {name}, not {arr.dtype}")
    m, k, n = x_sorted.shape[0], x_sorted.shape[1], w.shape[1 if transpose_rhs else 2]
    m_pad, k_pad, n_pad = (round_up(d, LANE) for d in (m, k, n))
    itemsize = jnp.dtype(x_sorted.dtype).itemsize
    tiles = phase_tiles(m_pad, k_pad, n_pad, w.shape[0], in_bytes=max(itemsize, jnp.dtype(w.dtype).itemsize),
                        out_bytes=itemsize, vmem=scoped_vmem() if vmem is None else vmem,
                        flops_per_byte=flops_per_byte(), transpose_rhs=transpose_rhs)
    group_sizes = group_sizes.astype(jnp.int32)

    x_padded = _pad_to(x_sorted, (m_pad, k_pad))
    w_padded = _pad_to(w, (w.shape[0], n_pad, k_pad) if transpose_rhs else (w.shape[0], k_pad, n_pad))

    def grouped(x, w, group_sizes):
        return _grouped(x, w, group_sizes, tiles, interpret, transpose_rhs)

    if all_rows_grouped:
        return grouped(x_padded, w_padded, group_sizes)[:m, :n]
    total = jnp.sum(group_sizes)
    out_padded = grouped(zero_cotangent_past(x_padded, total), w_padded, group_sizes)
    return zero_rows_past(out_padded, total)[:m, :n]


def scoped_vmem() -> int:
    """The scoped VMEM of the TPU being compiled for (`scoped_vmem_of`)."""
    return scoped_vmem_of(_target_chip())


def flops_per_byte() -> float:
    """The bf16 FLOPs the TPU being compiled for does per byte of HBM bandwidth, which weighs the compute
    a tile wastes against the bytes it saves (`gmm_tiles`); v5e's for what is not a TPU the table knows."""
    chip = _target_chip()
    if chip is None or not chip.scoped_vmem_bytes:
        return DEFAULT_FLOPS_PER_BYTE
    return chip.peak_bf16_flops / chip.hbm_bandwidth


def _target_chip():
    """The `hardware.Chip` being compiled for: the mesh's device kind, else this host's first device's
    (None when the table does not know it)."""
    from upcycler.hardware import chip_for

    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    kind = getattr(device, "device_kind", None) or jax.devices()[0].device_kind
    return chip_for(kind)


def scoped_vmem_of(chip) -> int:
    """The VMEM a kernel may allocate on `chip` (a `hardware.Chip`): the limit in `LIBTPU_INIT_ARGS`
    (`--xla_tpu_scoped_vmem_limit_kib=N`, which the kernels obey too; the product sets it,
    `topology.libtpu_defaults`) when there is one, at most the chip's whole VMEM, else the chip's default;
    `DEFAULT_SCOPED_VMEM` for what is not a TPU the chip table knows (the interpreter, whatever the flag)."""
    if chip is None or not chip.scoped_vmem_bytes:
        return DEFAULT_SCOPED_VMEM
    if found := re.search(r"--xla_tpu_scoped_vmem_limit_kib=(\d+)", os.environ.get("LIBTPU_INIT_ARGS", "")):
        limit = int(found.group(1)) << 10
        return min(limit, chip.vmem_bytes) if chip.vmem_bytes else limit
    return chip.scoped_vmem_bytes


def _pad_to(a: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    if a.shape == tuple(shape):
        return a
    return jnp.pad(a, [(0, want - have) for have, want in zip(a.shape, shape)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _grouped(x, w, group_sizes, tiles: PhaseTiles, interpret: bool, transpose_rhs: bool):
    """The forward kernel; the VJP runs dx and dW with their own tiles."""
    return _kernels.gmm(x, w, group_sizes, x.dtype, tiles.forward, None, None, transpose_rhs=transpose_rhs,
                        interpret=interpret)


def _grouped_fwd(x, w, group_sizes, tiles, interpret, transpose_rhs):
    return _grouped(x, w, group_sizes, tiles, interpret, transpose_rhs), (x, w, group_sizes)


def _grouped_bwd(tiles, interpret, transpose_rhs, residuals, dy):
    x, w, group_sizes = residuals
    dy = dy.astype(x.dtype)
    dx = _kernels.gmm(dy, w, group_sizes, x.dtype, tiles.dx, None, None, transpose_rhs=not transpose_rhs,
                      interpret=interpret)
    # tgmm takes its first operand as [K, M] and transposes it back inside: the two swaps cancel, no copy
    # is made. dW in w's layout: xᵀ dy ([G, in, out]), or dyᵀ x ([G, out, in]) for a weight read transposed
    first, second = (dy, x) if transpose_rhs else (x, dy)
    dw = _kernels.tgmm(first.swapaxes(0, 1), second, group_sizes, w.dtype, tiles.dw, None, w.shape[0],
                       interpret=interpret)
    return dx, dw, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)
