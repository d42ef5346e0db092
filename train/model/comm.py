"""Collectives over mesh axes inside `jax.shard_map`, with the payload compressed where it carries a sum.

MegaScale-MoE's rule (arXiv 2505.11432 §5): a collective whose result is summed is not run as a
low-precision reduction (a bf16 ring adds in bf16 at every hop). Its payload is cast once, exchanged
with an all-to-all, and summed locally in float32, so the only error is one rounding per addend:

    payload "fp32"  rows travel in their own dtype (a bf16 activation stays bf16; nothing is rounded)
    payload "bf16"  rows cast to bf16 once: relative error ≤ 2⁻⁸ per element before the sum
    payload "fp8"   rows scaled per row (per token) by max|row| / 448, cast to float8 e4m3; the float32
                    scale travels in the same message as four bytes per row. Relative error ≤ 2⁻⁴ per
                    element in e4m3's normal range; smaller elements of a row (below 2⁻⁶ of its scale
                    unit) keep an absolute error ≤ scale·2⁻¹⁰. A zero row stays exactly zero.

Per-row scales follow MegaScale's lesson that SwiGLU outputs have outlier tokens: one scale for a whole
tensor would push every ordinary row into e4m3's subnormals.

The two differentiable collectives here are each other's transpose, written out as custom VJPs:

    all_gather(x)      forward: all-gather of x in its dtype (activations, weights: never compressed)
                       backward: reduce_scatter of the cotangent with the `grad` payload
    reduce_scatter(y)  forward: the sum over the axis of y's blocks, scattered, with the `payload`
                       (fp32: `psum_scatter` in float32; bf16/fp8: all-to-all, then a float32 sum)
                       backward: all-gather of the cotangent, sent with the `grad` payload

Both work along axis 0 over one mesh axis or a tuple of them. Results of a sum are float32.
"""

from __future__ import annotations

from functools import partial
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

from upcycler.train.config import COMM_DTYPES

CommDtype = Literal["fp32", "bf16", "fp8"]
AxisName = str | tuple[str, ...]

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
_SCALE_BYTES = 4  # one float32 scale per row, carried as uint8 after the row's fp8 bytes


def check_comm_dtype(comm: str) -> None:
    if comm not in COMM_DTYPES:
        raise ValueError(f"comm dtype must be one of {COMM_DTYPES}, not {comm!r}")


# ----------------------------------------------------------------------------- encoding of the payload


def encode(rows: jax.Array, comm: CommDtype) -> jax.Array:
    """What travels for `rows` [..., D]: the rows themselves (fp32), bf16 rows, or uint8 rows of D fp8
    bytes followed by the row's float32 scale (fp8)."""
    check_comm_dtype(comm)
    if comm == "fp32":
        return rows
    if comm == "bf16":
        return rows.astype(jnp.bfloat16)
    scale = row_scales(rows)
    q = (rows.astype(jnp.float32) / scale[..., None]).astype(FP8)
    scale_bytes = lax.bitcast_convert_type(scale, jnp.uint8)  # [..., 4]
    return jnp.concatenate([lax.bitcast_convert_type(q, jnp.uint8), scale_bytes], axis=-1)


def decode(payload: jax.Array, comm: CommDtype) -> jax.Array:
    """The float32 rows an `encode`d payload stands for."""
    check_comm_dtype(comm)
    if comm != "fp8":
        return payload.astype(jnp.float32)
    q = lax.bitcast_convert_type(payload[..., :-_SCALE_BYTES], FP8).astype(jnp.float32)
    scale_bytes = payload[..., -_SCALE_BYTES:]
    scale = lax.bitcast_convert_type(scale_bytes, jnp.float32)
    return q * scale[..., None]


def row_scales(rows: jax.Array) -> jax.Array:
    """Per-row fp8 scale max|row| / 448 in float32 (1 for an all-zero row, which then encodes as zeros)."""
    peak = jnp.max(jnp.abs(rows.astype(jnp.float32)), axis=-1)
    return jnp.where(peak > 0, peak / FP8_MAX, 1.0)


def round_trip(rows: jax.Array, comm: CommDtype) -> jax.Array:
    """`decode(encode(rows))`: what the receiver reads, for error bounds and tests."""
    return decode(encode(rows, comm), comm)


# --------------------------------------------------------------------------------- raw collectives


def gather_raw(x: jax.Array, axis: AxisName, comm: CommDtype | None = None) -> jax.Array:
    """All-gather along axis 0 (tiled). With `comm`, the payload is encoded and the result is float32."""
    if comm is None:
        return lax.all_gather(x, axis, axis=0, tiled=True)
    return decode(lax.all_gather(encode(x, comm), axis, axis=0, tiled=True), comm)


def reduce_scatter_raw(y: jax.Array, axis: AxisName, comm: CommDtype) -> jax.Array:
    """Σ over the axis of every device's `y` [n·R, ...], block i of R rows kept by device i; float32.

    fp32: one `psum_scatter` in float32. bf16/fp8: the blocks are encoded once, exchanged with an
    all-to-all (block i to device i) and the n received blocks summed in float32 here.
    """
    check_comm_dtype(comm)
    if comm == "fp32":
        return lax.psum_scatter(y.astype(jnp.float32), axis, scatter_dimension=0, tiled=True)
    n = axis_size(axis)
    payload = encode(y, comm)
    blocks = payload.reshape(n, payload.shape[0] // n, *payload.shape[1:])
    received = lax.all_to_all(blocks, axis, split_axis=0, concat_axis=0)
    return jnp.sum(decode(received, comm), axis=0)


def axis_size(axis: AxisName) -> int:
    names = (axis,) if isinstance(axis, str) else axis
    size = 1
    for name in names:
        size *= lax.axis_size(name)
    return size


# ------------------------------------------------------------------------ differentiable collectives


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def all_gather(x: jax.Array, axis: AxisName, grad: CommDtype = "fp32") -> jax.Array:
    """All-gather of `x` along axis 0; its gradient is a `reduce_scatter` with the `grad` payload, cast
    back to `x.dtype`."""
    return gather_raw(x, axis)


def _all_gather_fwd(x, axis, grad):
    return gather_raw(x, axis), jnp.zeros((0,), x.dtype)


def _all_gather_bwd(axis, grad, dtype_witness, g):
    return (reduce_scatter_raw(g, axis, grad).astype(dtype_witness.dtype),)


all_gather.defvjp(_all_gather_fwd, _all_gather_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def reduce_scatter(y: jax.Array, axis: AxisName, payload: CommDtype = "fp32", grad: CommDtype = "fp32") -> jax.Array:
    """`reduce_scatter_raw(y, axis, payload)` (float32); its gradient is the all-gather of the cotangent,
    sent with the `grad` payload and cast to `y.dtype`."""
    return reduce_scatter_raw(y, axis, payload)


def _reduce_scatter_fwd(y, axis, payload, grad):
    return reduce_scatter_raw(y, axis, payload), jnp.zeros((0,), y.dtype)


def _reduce_scatter_bwd(axis, payload, grad, dtype_witness, g):
    sent = None if grad == "fp32" else grad
    return (gather_raw(g, axis, sent).astype(dtype_witness.dtype),)


reduce_scatter.defvjp(_reduce_scatter_fwd, _reduce_scatter_bwd)


def gather_dims(block: jax.Array, dims: dict[int, AxisName], grad: str = "native") -> jax.Array:
    """The whole array from this device's block: dimension d all-gathered over the mesh axes `dims[d]`.

    The gradient leaves as FSDP's reduce-scatter: with `grad` "native", the transpose JAX derives (a
    reduce-scatter in the gradient's dtype, a running bf16 sum for bf16 weights); with "fp32" or "bf16",
    `reduce_scatter` with that payload (bf16: MegaScale's scheme for data-parallel gradients).

    A block split on its first two dimensions that holds one row of the first (the expert weights on a
    mesh with `fsdp_outer`: one expert, a slice of its model width) is one contiguous block of the
    flattened rows, so it is gathered in one collective over both axes, straight into the whole array's
    layout (gathering the second dimension on its own would land it dimension-major, then copy).
    """
    if sorted(dims)[:2] == [0, 1] and block.shape[0] == 1 and all(isinstance(dims[d], str) for d in (0, 1)):
        rest = {d: axis for d, axis in dims.items() if d > 1}
        rows = block.reshape(block.shape[1:])
        whole = gather_dims(rows, {0: (dims[0], dims[1]), **{d - 1: a for d, a in rest.items()}}, grad)
        return whole.reshape(lax.axis_size(dims[0]), -1, *whole.shape[1:])
    for dim, axis in dims.items():
        if grad == "native":
            block = lax.all_gather(block, axis, axis=dim, tiled=True)
            continue
        moved = jnp.moveaxis(block, dim, 0)
        block = jnp.moveaxis(all_gather(moved, axis, grad), 0, dim)
    return block
