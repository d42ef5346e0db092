"""FlexPrefill on an accelerator: a batch of prompts' selection, the choice of kernel, and the attention,
one jit-able function with one compile per prompt length.

`flexprefill.flexprefill_attention` is shaped for a CPU: the block counts go to the host to choose a
bucket, and the keys of every (head, query block) are gathered. Here everything stays on device:

1. The selection is `flexprefill.select_blocks`, unchanged, one prompt after another (`lax.map`).
2. Fallbacks are decided per prompt: a prompt whose mean density exceeds `dense_above` attends through the
   causal block mask (dense attention inside the sparse kernel, beside the batch's sparse prompts).
3. The kernel is chosen per batch (`lax.cond`): with `kernel="auto"` the sparse kernel runs only where the
   cost model (`flexprefill_cost`, the chip's `ChipRates`) predicts it beats dense attention on these
   masks; with `"sparse"` whenever some prompt is under `dense_above`. `BatchResult.sparse` says which ran.
4. Kernels per platform. TPU: the grouped kernel (`flexprefill_tpu`) against dense splash
   (`flexprefill_splash.dense_attention`, 512-token tiles). GPU: the Triton block-sparse kernel
   (`flexprefill_gpu`) against the platform's fused attention (`jax.nn.dot_product_attention`, cuDNN's
   flash attention), with no step cost (thread blocks run concurrently).

What it preserves: the selection and its masks are those of the CPU path, and the attention over them is
the same exact softmax over the listed blocks; a dense run is dense causal attention (tested in the
interpreters). Short prompts (`runs_dense`) attend densely without selecting.

Shapes: q [B, N, H, h], k and v [B, N, K, h] after RoPE, before the h^-½ scale.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from upcycler import hardware
from upcycler.train.model import flexprefill_cost as cost
from upcycler.train.model import flexprefill_gpu as gpu
from upcycler.train.model import flexprefill_splash as splash
from upcycler.train.model import flexprefill_tpu as tpu
from upcycler.train.model.flexprefill import FlexPrefillOptions, select_blocks
from upcycler.train.model.flexprefill_cost import ChipRates

PLATFORMS = ("tpu", "gpu")
V5E = ChipRates.of(next(c for c in hardware.chips() if c.name == "TPU v5e"))  # when the chip is not known


class BatchResult(NamedTuple):
    """The attention [B, N, H, h]; per prompt and head, the fraction of causal key blocks computed (1 when
    dense) and whether the head was query-aware; whether the sparse kernel ran for the batch (else dense).
    All on device."""

    out_BNHh: jax.Array
    density_BH: jax.Array
    query_aware_BH: jax.Array
    sparse: jax.Array


def check_block(block: int, head_dim: int, platform: str) -> None:
    """The block tiles the platform's kernel: a multiple of 128 on a TPU, a power of two ≥ 16 on a GPU."""
    if platform == "gpu":
        gpu.check_tile(block, head_dim)
    else:
        tpu.check_block(block)


def flexprefill_attention(q_BNHh, k_BNKh, v_BNKh, opts: FlexPrefillOptions, *, rates: ChipRates = V5E,
                          platform: str = "tpu", interpret: bool = False) -> BatchResult:
    """FlexPrefill attention of a batch of prompts of one length (module docstring)."""
    B, N, H, h = q_BNHh.shape
    K = k_BNKh.shape[2]
    check_block(opts.block, h, platform)
    nb = opts.blocks(N)
    dense = lambda: dense_attention(q_BNHh, k_BNKh, v_BNKh, platform=platform, interpret=interpret)
    if opts.runs_dense(N):
        return BatchResult(dense(), jnp.ones((B, H), jnp.float32), jnp.zeros((B, H), bool), jnp.asarray(False))
    # one prompt at a time: the probe's [H, block, N] scores dominate the memory, not the batch's work
    selection = jax.lax.map(lambda qk: select_blocks(*qk, opts), (q_BNHh, k_BNKh))
    causal_blocks = nb * (nb + 1) / 2
    dense_B = selection.mask_Hnn.sum((-1, -2)).mean(-1) / causal_blocks > opts.dense_above
    mask_BHnn = jnp.where(dense_B[:, None, None, None], jnp.tril(jnp.ones((nb, nb), bool)), selection.mask_Hnn)
    if platform == "gpu":
        sparse_s = cost.per_head_sparse(mask_BHnn, opts.block, h).seconds(rates)
        dense_s = cost.dense_causal(B, N, H, h, opts.block).seconds(rates)
        kernel = gpu.block_sparse_attention
    else:
        sparse_s = cost.grouped_sparse(mask_BHnn, K, opts.block, h, tpu.SLAB).seconds(rates)
        dense_s = cost.dense_causal(B, N, H, h, splash.DENSE_TILE, empty_steps=False).seconds(rates)
        kernel = tpu.block_sparse_attention
    sparse = ~dense_B.all() & ((sparse_s < dense_s) if opts.kernel == "auto" else True)
    out = jax.lax.cond(sparse, lambda: kernel(q_BNHh, k_BNKh, v_BNKh, mask_BHnn, opts.block, interpret=interpret),
                       dense)
    density_BH = jnp.where(sparse & ~dense_B[:, None], selection.mask_Hnn.sum((-1, -2)) / causal_blocks, 1.0)
    query_aware_BH = selection.query_aware_H & sparse & ~dense_B[:, None]
    return BatchResult(out, density_BH, query_aware_BH, sparse)


def dense_attention(q_BNHh, k_BNKh, v_BNKh, *, window: int = 0, block: int = tpu.LANES, platform: str = "tpu",
                    interpret: bool = False) -> jax.Array:
    """Dense causal attention [B, N, H, h], `window` > 0 limiting each query to its `window` nearest keys:
    splash on a TPU (`flexprefill_splash.dense_attention`), the platform's fused attention on a GPU."""
    if platform == "gpu":
        local = (window - 1, 0) if window > 0 else None
        return jax.nn.dot_product_attention(q_BNHh, k_BNKh, v_BNKh, is_causal=True, local_window_size=local)
    return splash.dense_attention(q_BNHh, k_BNKh, v_BNKh, window=window, block=block, interpret=interpret)
