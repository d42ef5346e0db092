"""Grouped matrix multiply (GMM): the expert matmul of the dropless MoE layer.

Contract, shared by every backend:

    x_sorted      [M, in]      rows grouped by expert: group 0 first, then group 1, ...
    w             [G, in, out] one `in -> out` matrix per group (expert): rows of g are multiplied by w[g]
    group_sizes   [G] int32    rows per group, sum(group_sizes) <= M
    returns       [M, out]     rows of group g = x_sorted[rows of g] @ w[g]; rows past sum(group_sizes) are 0

The weight layout is `[G, in, out]` (input dimension first, like a Flax kernel). Hugging Face stores expert
projections as `[out, in]`; a caller holding weights in that orientation passes `transpose_rhs=True` (w is
then `[G, out, in]`) rather than swapping the axes itself: megablox reads the weight transposed inside its
kernels, so a weight gathered in the stored layout reaches them without a relayout copy in HBM (on the
reference MoE's step for v5e-256: 32.8 GB per layer instead of 35.0, MFU bound 68.1% instead of 65.2%).
The other backends swap the axes first, as callers did before: tiled and ragged_dot are XLA programs,
free to fold the swap into their products; before the mosaic_gpu and tokamax kernels it is a copy
(tokamax 0.0.17's VJP of a transposed weight returns dW in the other layout and its API refuses a direct
dW call; its step is compute-bound, so the copy does not move its bound).

Backends:
- `"megablox"`: the Pallas TPU kernels of `jax.experimental.pallas.ops.tpu.megablox` (`gmm`, `tgmm`),
  through the adapter in `gmm_megablox.py` (padding to TPU tiles, masking rows past the groups, tiles
  chosen per kernel from the chip's VMEM by `gmm_tiles.py`). It computes only the row tiles that hold
  some group's rows. On a platform other than TPU it runs in the Pallas
  interpreter: correct but very slow, for tests only.
- `"ragged_dot"`: `jax.lax.ragged_dot`. On an NVIDIA H200 (JAX 0.11.2) its forward is 3.8× the one-hot
  reference's time and its weight gradient compiles to a masked product over all G groups: one layer's
  forward+backward at T=8192, d 512, 64 experts top-8 in bf16 took 0.145 s and 69 GB of temporaries
  (one-hot: 0.021 s, 4.4 GB; tiled: 0.057 s, 1.1 GB), and at the reference MoE's width (T=32768, d 1792,
  width 1152) the compile asked for 144 GiB and failed. Hence tiled on GPU too. On CPU it expands to a masked dense product over
  all G groups (G times the FLOPs and memory), so it is only usable there at toy sizes. On TPU (JAX 0.10
  with its libtpu) the forward product and dx compile to XLA's own grouped kernels, but the weight
  gradient, whose contraction runs over the grouped rows, compiles to a masked dense product over all G
  groups: G times the work of that third of the matmuls. Hence megablox on TPU.
- `"tiled"`: the CPU implementation. Each group's rows are cut into tiles anchored at the group's first
  row, so no tile mixes groups and nothing is padded: whole tiles of the sizes in `tile_rows`,
  largest first (a greedy binary cut), then the rest in masked tiles of the smallest size. The wasted work
  is the masked tail of each group's last tile, under `tile_rows[-1]` rows per group. Each tile is one
  dense matmul against the group's weight, sliced once per group. Loops run over groups and then over that
  group's tiles with data-dependent trip counts, so an empty group costs one weight slice and no matmul.
  A custom VJP makes the backward pass a single loop over the same tiles that computes dx
  (dy_tile @ w[g]^T) and dW[g] (the fp32 sum of x_tile^T @ dy_tile, written once per group).
  The default sizes (512, 256, 128, 64) were the fastest of those tried on a 2-core x86 CPU at
  T·K = 65536 rows and 64 experts: matmuls of a few hundred rows run near peak there, while shallower
  contractions (the dW products) slow down sharply below about 256 rows.
- `"mosaic_gpu"`: JAX's Pallas Mosaic GPU kernels for NVIDIA Hopper (`ragged_dot_mgpu` for the forward
  and dx, `transposed_ragged_dot_mgpu` for dW), through the adapter in `gmm_mosaic_gpu.py`: the weight
  gradient stays grouped. 16-bit operands only, one device per kernel (like megablox). On an H200 one
  layer's forward+backward at the reference MoE's width took 0.027 s (tiled: 0.124 s; a dense FFN of the
  same active FLOPs: 0.015 s) and the reference MoE's step 1.9× less time than with tiled. Chosen
  by `"auto"` on a Hopper GPU for 16-bit operands; its output and gradients are checked against tiled by
  tests/test_gmm_mosaic_gpu.py on such a GPU.
- `"tokamax"`: tokamax's `ragged_dot` (its `gmm_v2`/`tgmm_v2` TPU kernels), through the adapter in
  `gmm_tokamax.py`; installed by the `[tpu]` extra where JAX >= 0.11.1 runs (Python >= 3.12). On the
  reference MoE layer for one v5e chip its forward and backward bound is 0.87× megablox's (26.1 ms against
  29.9, the same peak memory): it rounds each group's rows up to a bucket where megablox revisits a row
  tile per group. One device per kernel, like megablox. Off TPU it runs tokamax's XLA implementation.
- `"auto"`: chosen for the TARGET platform, the one the code is compiled for, not the host's:
  `"tokamax"` on TPU where it is installed, else `"megablox"`, `"tiled"` on CPU, on GPU `"mosaic_gpu"` for bfloat16 or float16 operands on a
  Hopper GPU and `"tiled"` otherwise, `"ragged_dot"` on any other platform. The target is the platform of the mesh
  set by `jax.set_mesh` when there is one (so an ahead-of-time compile for a TPU slice from a CPU host
  gets the TPU kernel), else JAX's default backend. On TPU, one exception: XLA cannot partition a Pallas
  kernel across devices, so megablox needs code that runs whole on each device (a one-device mesh, or
  inside a `jax.shard_map` that makes every mesh axis manual); under automatic partitioning over several
  devices `"auto"` takes `"ragged_dot"` and an explicit `"megablox"` or `"tokamax"` is refused. Likewise on GPU: under
  automatic partitioning `"auto"` takes `"tiled"`. A jit placed on devices
  only by its argument shardings, with no mesh set, is not seen: it gets the default backend's choice.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

from upcycler.train.config import GMM_BACKENDS
from upcycler.train.model.gmm_mosaic_gpu import KERNEL_DTYPES, mosaic_gpu_gmm  # no Pallas import until used
from upcycler.train.model.gmm_tokamax import tokamax_available, tokamax_gmm  # no tokamax import until used

Backend = Literal["auto", "tiled", "ragged_dot", "megablox", "mosaic_gpu", "tokamax"]
BACKENDS: tuple[str, ...] = GMM_BACKENDS  # declared with the config, which must not import JAX
DEFAULT_TILE_ROWS: tuple[int, ...] = (512, 256, 128, 64)
AUTO_BACKENDS: dict[str, str] = {"cpu": "tiled", "gpu": "tiled"}  # TPU: `resolve_backend`; others: "ragged_dot"


def gmm(
    x_sorted: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    backend: Backend = "auto",
    tile_rows: tuple[int, ...] = DEFAULT_TILE_ROWS,
    all_rows_grouped: bool = False,
    transpose_rhs: bool = False,
) -> jax.Array:
    """Grouped matmul: rows of group g of `x_sorted` times `w[g]` (`w` is `[G, in, out]`, or `[G, out, in]`
    multiplied transposed with `transpose_rhs`, its gradient then in that layout too).

    Returns `[M, out]` in `x_sorted.dtype` (products accumulate in fp32). Rows past `sum(group_sizes)`
    come out zero. Differentiable (reverse mode) in `x_sorted` and `w`; `tile_rows` only affects the
    `"tiled"` backend's speed, never its result. `all_rows_grouped` is the caller's promise that
    sum(group_sizes) == M (the dropless layer's buffer): the kernels then skip the passes that zero rows
    past the groups, as there are none.
    """
    _check_shapes(x_sorted, w, group_sizes, transpose_rhs)
    group_sizes = group_sizes.astype(jnp.int32)
    platform = target_platform()
    resolved = resolve_backend(backend, platform, x_sorted.dtype if x_sorted.dtype == w.dtype else None)
    if transpose_rhs and resolved != "megablox":  # the one kernel here that reads w transposed
        w, transpose_rhs = jnp.swapaxes(w, 1, 2), False
    if resolved == "megablox":
        # imported here: the Pallas TPU kernels are only loaded by the code paths that use them
        from upcycler.train.model.gmm_megablox import megablox_gmm

        interpret = platform != "tpu"
        if not interpret and not runs_unpartitioned():
            raise ValueError(
                "the megablox gmm backend is a Pallas kernel XLA cannot partition: call it inside "
                f"jax.shard_map over every axis of the mesh {jax.sharding.get_abstract_mesh()}, on a "
                'one-device mesh, or use backend "auto" or "ragged_dot"'
            )
        return megablox_gmm(x_sorted, w, group_sizes, interpret=interpret, all_rows_grouped=all_rows_grouped,
                            transpose_rhs=transpose_rhs)
    if resolved == "tokamax":
        if platform == "tpu" and not runs_unpartitioned():
            raise ValueError(
                "the tokamax gmm backend is a Pallas kernel XLA cannot partition: call it inside "
                f"jax.shard_map over every axis of the mesh {jax.sharding.get_abstract_mesh()}, on a "
                'one-device mesh, or use backend "auto" or "ragged_dot"'
            )
        return tokamax_gmm(x_sorted, w, group_sizes, platform=platform, all_rows_grouped=all_rows_grouped)
    if resolved == "mosaic_gpu":
        if platform != "gpu":
            raise ValueError(f"the mosaic_gpu gmm backend is a Pallas kernel for NVIDIA Hopper GPUs and cannot run "
                             f"on {platform}: use backend \"auto\"")
        if not runs_unpartitioned():
            raise ValueError(
                "the mosaic_gpu gmm backend is a Pallas kernel XLA cannot partition: call it inside "
                f"jax.shard_map over every axis of the mesh {jax.sharding.get_abstract_mesh()}, on a "
                'one-device mesh, or use backend "auto"'
            )
        return mosaic_gpu_gmm(x_sorted, w, group_sizes, all_rows_grouped=all_rows_grouped)
    if resolved == "ragged_dot":
        out = lax.ragged_dot(x_sorted, w, group_sizes, preferred_element_type=jnp.float32)
        return out.astype(x_sorted.dtype)
    return _tiled_gmm(x_sorted, w, group_sizes, _normalise_tiles(tile_rows, x_sorted.shape[0]))


def resolve_backend(backend: Backend, platform: str | None = None, dtype=None) -> str:
    """The concrete backend `backend` stands for when compiling for `platform` (default: `target_platform()`)
    with operands (x and w) of `dtype` (None: unknown, or x and w differ).

    Only `"auto"` depends on the platform: on TPU tokamax where it is installed (`tokamax_available`), else
    megablox (ragged_dot there when the code is partitioned across devices, see `runs_unpartitioned`), tiled on CPU, on GPU mosaic_gpu for 16-bit operands on a
    Hopper GPU that runs the code whole (tiled otherwise), ragged_dot anywhere else.
    """
    if backend not in BACKENDS:
        raise ValueError(f"gmm backend must be one of {BACKENDS}, not {backend!r}")
    if backend != "auto":
        return backend
    platform = target_platform() if platform is None else platform
    if platform == "tpu":
        return "ragged_dot" if not runs_unpartitioned() else "tokamax" if tokamax_available() else "megablox"
    if platform == "gpu" and dtype is not None and jnp.dtype(dtype) in KERNEL_DTYPES and hopper_here() \
            and runs_unpartitioned():
        return "mosaic_gpu"
    return AUTO_BACKENDS.get(platform, "ragged_dot")


def hopper_here() -> bool:
    """Whether this process's GPUs are NVIDIA Hopper (compute capability 9.x), what the Mosaic GPU kernels need."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError:  # no GPU backend in this process
        return False
    return bool(devices) and str(getattr(devices[0], "compute_capability", "")).startswith("9")


def target_platform() -> str:
    """The platform being compiled for: that of the mesh set by `jax.set_mesh` (also seen while tracing
    under jit and shard_map), else JAX's default backend (the host's, for arrays without a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    platform = getattr(device, "platform", None)
    return platform if platform else jax.default_backend()


def runs_unpartitioned() -> bool:
    """Whether code traced here runs whole on each device (what a Pallas TPU kernel needs): no mesh, a
    one-device mesh, or the body of a `jax.shard_map` that made every mesh axis manual."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return True
    return set(mesh.manual_axes) == set(mesh.axis_names) or (mesh.size == 1 and not mesh.manual_axes)


def _check_shapes(x: jax.Array, w: jax.Array, group_sizes: jax.Array, transpose_rhs: bool = False) -> None:
    shapes = f"x {x.shape}, w {w.shape}, group_sizes {group_sizes.shape}"
    layout = "[G, out, in]" if transpose_rhs else "[G, in, out]"
    if x.ndim != 2 or w.ndim != 3 or group_sizes.ndim != 1:
        raise ValueError(f"gmm wants x [M, in], w {layout}, group_sizes [G]; got {shapes}")
    if x.shape[1] != w.shape[2 if transpose_rhs else 1] or w.shape[0] != group_sizes.shape[0]:
        raise ValueError(f"gmm shapes disagree (w is {layout}): {shapes}")


def _normalise_tiles(tile_rows: tuple[int, ...], m: int) -> tuple[int, ...]:
    """Distinct, decreasing tile sizes no larger than M (a tile must fit inside the rows)."""
    if not tile_rows or min(tile_rows) < 1:
        raise ValueError(f"tile_rows must be positive sizes, got {tile_rows!r}")
    return tuple(sorted({min(t, max(m, 1)) for t in tile_rows}, reverse=True))


def _dot(a: jax.Array, b: jax.Array, contract: tuple[int, int]) -> jax.Array:
    """`a` and `b` contracted on one axis each, accumulated in fp32."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _over_tiles(start, end, tiles: tuple[int, ...], m: int, body, carry):
    """Run `carry = body(begin, size, own, carry)` over the tiles of the group's rows [start, end).

    Every size but the last gives whole tiles inside the group (`own` is None), taken greedily from
    `start`. The last size covers what is left with ceil(rest / size) tiles whose `own` mask selects the
    group's rows: a tile reaching past the group also holds rows of the next groups, and one that would
    run past row M is moved back (`begin` clamped to M - size), so it may start before its first row.
    """
    lo = start
    for i, size in enumerate(tiles):
        last = i == len(tiles) - 1
        count = (end - lo + size - 1) // size if last else (end - lo) // size

        def step(j, carry, lo=lo, size=size, last=last):
            first_row = lo + j * size
            if not last:
                return body(first_row, size, None, carry)
            begin = jnp.minimum(first_row, m - size)
            rows = begin + lax.iota(jnp.int32, size)
            return body(begin, size, (rows >= first_row) & (rows < end), carry)

        carry = lax.fori_loop(0, count, step, carry)
        lo = lo + count * size
    return carry


def _group_bounds(group_sizes: jax.Array) -> tuple[jax.Array, jax.Array]:
    ends = jnp.cumsum(group_sizes)
    return ends - group_sizes, ends


def _forward_loops(x: jax.Array, w: jax.Array, group_sizes: jax.Array, tiles: tuple[int, ...]) -> jax.Array:
    """out rows of g = x rows of g @ w[g]; rows outside every group stay 0."""
    m = x.shape[0]
    starts, ends = _group_bounds(group_sizes)

    def per_group(g, out):
        w_g = lax.dynamic_index_in_dim(w, g, keepdims=False)

        def tile(begin, size, own, out):
            y = _dot(lax.dynamic_slice_in_dim(x, begin, size), w_g, (1, 0)).astype(out.dtype)
            if own is not None:
                y = jnp.where(own[:, None], y, lax.dynamic_slice_in_dim(out, begin, size))
            return lax.dynamic_update_slice_in_dim(out, y, begin, 0)

        return _over_tiles(starts[g], ends[g], tiles, m, tile, out)

    return lax.fori_loop(0, w.shape[0], per_group, jnp.zeros((m, w.shape[2]), x.dtype))


def _backward_loops(x, w, group_sizes, dy, tiles):
    """(dx, dw) of out = gmm(x, w): dx rows of g = dy rows of g @ w[g]^T, dw[g] = x[g rows]^T @ dy[g rows].

    One pass over the tiles computes both; dw[g] accumulates in fp32 and is written once per group.
    """
    m, k, n = x.shape[0], w.shape[1], w.shape[2]
    starts, ends = _group_bounds(group_sizes)

    def per_group(g, carry):
        dx, dw = carry
        w_g = lax.dynamic_index_in_dim(w, g, keepdims=False)

        def tile(begin, size, own, inner):
            dx, acc = inner
            x_t = lax.dynamic_slice_in_dim(x, begin, size)
            dy_t = lax.dynamic_slice_in_dim(dy, begin, size)
            dx_t = _dot(dy_t, w_g, (1, 1)).astype(dx.dtype)
            if own is not None:
                dx_t = jnp.where(own[:, None], dx_t, lax.dynamic_slice_in_dim(dx, begin, size))
                x_t = jnp.where(own[:, None], x_t, jnp.zeros_like(x_t))
            return lax.dynamic_update_slice_in_dim(dx, dx_t, begin, 0), acc + _dot(x_t, dy_t, (0, 0))

        dx, acc = _over_tiles(starts[g], ends[g], tiles, m, tile, (dx, jnp.zeros((k, n), jnp.float32)))
        return dx, lax.dynamic_update_index_in_dim(dw, acc.astype(dw.dtype), g, 0)

    # -0.0: a zero that XLA does not merge with the forward pass's zero-filled output of the same shape
    # (the merged buffer would then be copied for the second loop)
    init = (jnp.full(x.shape, -0.0, x.dtype), jnp.zeros_like(w))
    return lax.fori_loop(0, w.shape[0], per_group, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiled_gmm(x, w, group_sizes, tiles):
    """The tiled backend; its VJP runs `_backward_loops` on the saved (x, w, group_sizes)."""
    return _forward_loops(x, w, group_sizes, tiles)


def _tiled_gmm_fwd(x, w, group_sizes, tiles):
    return _forward_loops(x, w, group_sizes, tiles), (x, w, group_sizes)


def _tiled_gmm_bwd(tiles, residuals, dy):
    x, w, group_sizes = residuals
    dx, dw = _backward_loops(x, w, group_sizes, dy.astype(x.dtype), tiles)
    return dx, dw, None


_tiled_gmm.defvjp(_tiled_gmm_fwd, _tiled_gmm_bwd)
