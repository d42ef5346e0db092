"""What FlexPrefill's attention kernels cost on a chip, counted from the block masks: the one model behind
the compile bound (`bench/prefill_roofline.py`) and the device prefill's choice of kernel per batch.

A kernel is charged its arithmetic, its HBM traffic and its steps:

    seconds = max(FLOPs / peak bf16 FLOP/s, bytes / HBM bandwidth) + steps × step cost

- FLOPs: 4·rows·keys·h per score tile computed (QKᵀ and PV), masked parts of a computed tile included.
- bytes: every key and value block each tile fetches, and each query block read and output written once,
  in the inputs' dtype (bf16 on an accelerator).
- steps: on a TPU a Pallas grid step costs about 0.35 µs whatever it computes (the Pallas TPU pipelining
  guide's figure), empty steps included. The grouped kernel (`flexprefill_tpu`) has one grid step per
  (key head, query block) and one loop iteration per slab of `SLAB` key blocks; an iteration is charged the
  grid step's cost too (it does about the work of a 512 × 512 dense tile, and the cost covers its DMA
  issue and waits), which errs against the sparse kernel. A GPU launches its thread blocks concurrently: no step cost.

The dense baseline on a TPU is splash attention as `flexprefill_splash.dense_attention` runs it:
512-token tiles, one query head per grid row, `nt` kv steps per row (the causal row's width; the steps
above the diagonal compute nothing but are grid steps all the same), keys and values fetched per query
head. Whether an empty step costs a whole step is not known here, so the device prefill chooses the
sparse kernel only where it beats dense charged its computed tiles alone. On a GPU the baseline is a fused
flash attention (cuDNN's) in 128-token tiles.

These are estimates from published peaks, not measurements: the bound they give is reached only by a
kernel that hides its DMAs behind its matmuls. At head size 64 the MXU runs half full on both kernels
alike, so the ratio holds where the absolute times do not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import jax.numpy as jnp

from upcycler import hardware

TPU_STEP_S = 0.35e-6  # a Pallas TPU grid step's fixed cost (JAX's Pallas TPU pipelining guide)


@dataclass(frozen=True)
class ChipRates:
    """The figures the model needs: peak bf16 FLOP/s, HBM bytes/s and the cost of one kernel step (s)."""

    peak_flops: float
    hbm_bandwidth: float
    step_s: float

    @classmethod
    def of(cls, chip: hardware.Chip) -> ChipRates:
        return cls(float(chip.peak_bf16_flops), float(chip.hbm_bandwidth), TPU_STEP_S if chip.name.startswith("TPU") else 0.0)


class KernelWork(NamedTuple):
    """A kernel's FLOPs, HBM bytes, grid steps and loop iterations (jnp scalars when counted from a traced
    mask)."""

    flops: object
    bytes: object
    grid_steps: object
    iterations: object

    def seconds(self, rates: ChipRates):
        """The model's time: roofline plus every step and iteration at the step cost."""
        roofline = jnp.maximum(self.flops / rates.peak_flops, self.bytes / rates.hbm_bandwidth)
        return roofline + (self.grid_steps + self.iterations) * rates.step_s


def dense_causal(batch: int, n_tokens: int, heads: int, head_dim: int, tile: int, *, empty_steps: bool = True,
                 itemsize: int = 2) -> KernelWork:
    """Dense causal attention in `tile`-token tiles over `batch` prompts: splash on a TPU, a fused flash
    kernel on a GPU (module docstring). `empty_steps`: the grid steps include the empty ones above the
    diagonal, as splash runs them; without, only the computed tiles are steps (the strictest dense figure,
    which the device prefill's choice of kernel compares against)."""
    T, nt = tile, math.ceil(n_tokens / tile)
    rows = batch * heads * nt
    tiles = batch * heads * nt * (nt + 1) // 2
    flops = 4.0 * T * T * head_dim * tiles
    bytes_ = 2.0 * T * head_dim * itemsize * tiles + 2.0 * T * head_dim * itemsize * rows
    return KernelWork(flops, bytes_, rows * nt if empty_steps else tiles, 0)


def grouped_sparse(mask_BHnn, kv_heads: int, block: int, head_dim: int, slab: int, itemsize: int = 2
                   ) -> KernelWork:
    """`flexprefill_tpu`'s kernel over the block masks [B, H, nb, nb] (numpy or traced): per (prompt, key
    head, query block) the union of its G heads' blocks and the diagonal, rounded up to whole slabs, each
    slab a [G·block, slab·block] tile whose keys and values are fetched once."""
    B, H, nb, _ = mask_BHnn.shape
    G = H // kv_heads
    union = (jnp.asarray(mask_BHnn).reshape(B, kv_heads, G, nb, nb).any(2) | jnp.eye(nb, dtype=bool)).sum(-1)
    slabs = ((union + slab - 1) // slab).sum()
    rows = B * kv_heads * nb
    flops = 4.0 * (G * block) * (slab * block) * head_dim * slabs
    bytes_ = 2.0 * slab * block * head_dim * itemsize * slabs + 2.0 * G * block * head_dim * itemsize * rows
    return KernelWork(flops, bytes_, rows, slabs)


def per_head_sparse(mask_BHnn, block: int, head_dim: int, itemsize: int = 2) -> KernelWork:
    """A per-head block-sparse kernel (splash over the selection, or the GPU kernel): one [block, block]
    tile per selected block and the diagonal, keys and values fetched per query head, one grid step per
    selected block (splash's fixed-width grid has more: `grid_steps` is a floor)."""
    B, H, nb, _ = mask_BHnn.shape
    tiles = (jnp.asarray(mask_BHnn) | jnp.eye(nb, dtype=bool)).sum()
    rows = B * H * nb
    flops = 4.0 * block * block * head_dim * tiles
    bytes_ = 2.0 * block * head_dim * itemsize * tiles + 2.0 * block * head_dim * itemsize * rows
    return KernelWork(flops, bytes_, tiles, 0)
