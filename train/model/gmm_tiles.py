"""Tiles for the megablox grouped-matmul kernels, chosen per call shape from the chip's VMEM and rates.

A megablox call computes an [M, K] × [G, K, N] grouped product in tiles (tm, tk, tn). What it moves through
HBM is set by the tiles, and the kernel says so in its own cost estimate (which the compile report charges):

    gmm   (forward, and dx with the weights transposed)
          lhs·(N / tn) + one group's [K, N] weight·(M / tm + G − 1) + out
          the rows are re-read once per column tile, a weight once per row tile it meets
    tgmm  (dW)
          lhs·(N / tn) + rhs·(K / tk) + out [G, K, N]

What it computes is set by the row tile too: its grid has M / tm + G − 1 row steps, each multiplying a
whole tm-row tile and keeping the rows of one group, so a tile a group boundary crosses is multiplied once
per group it holds. With routed tokens nearly every boundary falls inside a tile, and the kernel computes

    2 · (M / tm + G − 1) · tm · K · N   FLOPs, against the 2·M·K·N of the product

(the compile report charges this too: `hbm_traffic.grid_repeats`). Tall row tiles move the fewest bytes
and waste the most compute: at the reference MoE's 131,072 rows and 64 experts, 4096-row tiles multiply
(32 + 63) / 32 ≈ 3× the product's FLOPs. So the tiles are chosen by time, as a roofline would: the larger
of the bytes moved and the FLOPs computed over the chip's FLOPs per byte of HBM bandwidth
(`flops_per_byte`, v5e's by default). What fits is the kernel's scoped VMEM, measured by compiling for v5e
(sizes from the compiler's "Scoped allocation with size …"):

    gmm   2·(tm·tk + tk·tn)·in + tm·tn·4 (the fp32 accumulator), tm·tn·4 more when K is split, and
          tm·tn·out (the output tile: counted by the compiler at the largest tiles, 72 MB for
          (4096, 1152, 1792) under a 64 MiB limit, not at small ones; always counted here)
    tgmm  2·(tm·tk + tm·tn)·in + 2·tk·tn·out + tk·tn·4

against the chip's default scoped limit (`hardware.Chip.scoped_vmem_bytes`: 16 MiB on v4, v5e, v5p; 32 MiB
on v6e), less a margin. Among the tiles that fit and take within 10% of the least time, the deepest
contraction wins (each extra k tile is a read-modify-write of the fp32 accumulator), then the fewest grid
steps. Forward, dx and dW have different shapes and kernels, so each gets its own tiles (`PhaseTiles`).
Tiles only change the speed and the order of the fp32 accumulation, never which products are summed.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

LANE = 128  # TPU tiles of the minor dimensions are multiples of this
ROW_TILES = (128, 256, 512, 1024, 2048, 4096)
NEAR_LEAST = 1.1  # tiles within this factor of the least time count as equal; the deepest contraction wins
VMEM_MARGIN = 0.8  # of the scoped limit: what the kernel's own bookkeeping may need beside the tiles
DEFAULT_SCOPED_VMEM = 16 << 20  # v4, v5e, v5p; chips without a figure get this
DEFAULT_FLOPS_PER_BYTE = 197e12 / 819e9  # v5e's bf16 peak over its HBM bandwidth; chips without figures get this


class Tiles(NamedTuple):
    tm: int
    tk: int
    tn: int


class PhaseTiles(NamedTuple):
    """The tiles of the three kernels one grouped matmul runs: forward, dx (gmm against the transposed
    weights, contracting over N) and dW (tgmm)."""

    forward: Tiles
    dx: Tiles
    dw: Tiles


def phase_tiles(m: int, k: int, n: int, groups: int, *, in_bytes: int, out_bytes: int,
                vmem: int = DEFAULT_SCOPED_VMEM, flops_per_byte: float = DEFAULT_FLOPS_PER_BYTE,
                transpose_rhs: bool = False) -> PhaseTiles:
    """The tiles of out[M, N] = x[M, K] @ w[G, K, N] and its two gradients (M, K, N multiples of `LANE`).
    With `transpose_rhs` the weight is stored [G, N, K]: the products tile alike, and dW ([G, N, K], tgmm
    of dyᵀ and x) gets the tiles of its own orientation."""
    rates = {"vmem": vmem, "flops_per_byte": flops_per_byte}
    dw_kn = (n, k) if transpose_rhs else (k, n)
    return PhaseTiles(forward=gmm_tiles(m, k, n, groups, in_bytes=in_bytes, out_bytes=out_bytes, **rates),
                      dx=gmm_tiles(m, n, k, groups, in_bytes=in_bytes, out_bytes=in_bytes, **rates),
                      dw=tgmm_tiles(m, *dw_kn, groups, in_bytes=in_bytes, out_bytes=out_bytes, **rates))


def computed_flops(m: int, k: int, n: int, groups: int, tm: int) -> int:
    """FLOPs a megablox kernel multiplies for an [m, k] × [groups, k, n] product with row tile `tm`, when
    no group boundary falls on a tile's edge: every one of its grid's m / tm + groups − 1 row steps."""
    return 2 * (m // tm + groups - 1) * tm * k * n


def gmm_tiles(m: int, k: int, n: int, groups: int, *, in_bytes: int, out_bytes: int,
              vmem: int = DEFAULT_SCOPED_VMEM, flops_per_byte: float = DEFAULT_FLOPS_PER_BYTE) -> Tiles:
    """Tiles for megablox `gmm` of [m, k] rows against [groups, k, n] weights (the least time first: its
    estimate's bytes, or its grid's FLOPs over `flops_per_byte`, whichever is larger)."""
    def traffic(t: Tiles) -> float:
        return max(m * k * in_bytes * (n // t.tn) + k * n * in_bytes * (m // t.tm + groups - 1)
                   + m * n * out_bytes, computed_flops(m, k, n, groups, t.tm) / flops_per_byte)

    def scoped(t: Tiles) -> int:
        acc = t.tm * t.tn * 4
        return 2 * (t.tm * t.tk + t.tk * t.tn) * in_bytes + acc * (1 + (t.tk < k)) + t.tm * t.tn * out_bytes

    return _best(m, k, n, traffic, scoped, vmem)


def tgmm_tiles(m: int, k: int, n: int, groups: int, *, in_bytes: int, out_bytes: int,
               vmem: int = DEFAULT_SCOPED_VMEM, flops_per_byte: float = DEFAULT_FLOPS_PER_BYTE) -> Tiles:
    """Tiles for megablox `tgmm`: dW[g] = x[rows of g]^T @ dy[rows of g], x [m, k], dy [m, n] (the least
    time first, as `gmm_tiles`)."""
    def traffic(t: Tiles) -> float:
        return max(m * k * in_bytes * (n // t.tn) + m * n * in_bytes * (k // t.tk) + groups * k * n * out_bytes,
                   computed_flops(m, k, n, groups, t.tm) / flops_per_byte)

    def scoped(t: Tiles) -> int:
        return 2 * (t.tm * t.tk + t.tm * t.tn) * in_bytes + 2 * t.tk * t.tn * out_bytes + t.tk * t.tn * 4

    return _best(m, k, n, traffic, scoped, vmem)


def _best(m: int, k: int, n: int, traffic, scoped, vmem: int) -> Tiles:
    for size in (m, k, n):
        if size % LANE:
            raise ValueError(f"grouped-matmul tiles want dimensions that are multiples of {LANE}, got {(m, k, n)}")
    budget = vmem * VMEM_MARGIN
    candidates = [Tiles(tm, tk, tn)
                  for tm, tk, tn in itertools.product(_divisors(m, ROW_TILES), _lane_divisors(k), _lane_divisors(n))]
    fitting = [t for t in candidates if scoped(t) <= budget]
    if not fitting:  # nothing fits: the smallest tiles, as the kernel's own default
        return Tiles(LANE, LANE, LANE)
    least = min(traffic(t) for t in fitting)
    near = [t for t in fitting if traffic(t) <= NEAR_LEAST * least]
    return min(near, key=lambda t: (-t.tk, (m // t.tm) * (k // t.tk) * (n // t.tn), traffic(t)))


def _divisors(size: int, choices: tuple[int, ...]) -> list[int]:
    return [c for c in choices if size % c == 0] or [LANE]


def _lane_divisors(size: int) -> list[int]:
    """The multiples of `LANE` that divide `size` (a multiple of `LANE`)."""
    return [t for t in range(LANE, size + 1, LANE) if size % t == 0]
