"""`attention: splash`: causal attention through JAX's splash attention, a Pallas TPU flash-attention kernel.

The einsum and dot_product paths (`layers.attention`) write the [L, S] scores of every head to HBM and
read them back, forward and backward: at 4096 tokens that traffic, not the matmuls, bounds a step (the
compile report's memory term). Splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`)
keeps each block of scores on chip, skips the key blocks a mask rules out (above the causal diagonal,
outside a sliding window) and has its own backward kernels. The result is the same attention: it equals
`layers.attention` within float rounding (softmax in fp32 on chip; tested in the interpreter here).

What it preserves of the model: grouped-query heads (each key/value head serves H/K query heads),
packed documents (segment ids: a token sees only its own document), sliding windows (a window of w keys
sees distances 0 … w−1), and layers of different windows in one scan (one kernel per distinct window,
chosen by the layer's window at run time). q is scaled by h^-½ before the kernel, which does not scale.

The kernel is whole-sequence per device: it runs per device on its own rows of the batch (the
placement's `per_device`, a `shard_map` on a mesh), never across a split sequence. On CPU it runs in the
Pallas interpreter (exact but slow, for tests); other platforms are refused.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from upcycler.train.model.gmm import runs_unpartitioned, target_platform
from upcycler.train.model.placement import Placement

QKV_AXES = ("batch", "seq", None, None)  # q [B, L, H, h], k and v [B, S, K, h]: the batch rows split, no more
SEGMENT_AXES = ("batch", "seq")
BLOCKS = (512, 256, 128)  # the kernel's tiles along the sequence, largest first (multiples of 128: TPU lanes)


def block_size(length: int) -> int | None:
    """The tile the kernel uses for a sequence of `length` tokens (the largest of `BLOCKS` dividing it), or
    None when none does: the length must be a multiple of 128, interpreted or not."""
    return next((block for block in BLOCKS if length % block == 0), None)


def attention(q_BLHh: jax.Array, k_BSKh: jax.Array, v_BSKh: jax.Array, *, segment_ids_BL: jax.Array | None,
              window: jax.Array | int, windows: tuple[int, ...], placement: Placement) -> jax.Array:
    """Causal grouped-query attention of q over k, v through the splash kernel; [B, L, H, h] like q.

    `segment_ids_BL` None: one document per row. `window` (traced, per layer) is one of `windows` (the
    distinct windows of the layers run together; 0 is full attention); `placement` runs the kernel per
    device on its rows of the batch.
    """
    platform = target_platform()
    if platform not in ("tpu", "cpu"):
        raise ValueError(f"attention splash is a TPU kernel (interpreted on CPU for tests); on {platform} use "
                         "attention dot_product")
    interpret = platform != "tpu"
    if segment_ids_BL is None:
        segment_ids_BL = jnp.zeros(q_BLHh.shape[:2], jnp.int32)
    distinct = tuple(sorted(set(windows)))
    run = partial(_per_device, windows=distinct, interpret=interpret)
    return placement.per_device(run, (q_BLHh, k_BSKh, v_BSKh, segment_ids_BL, _window_index(window, distinct)),
                                (QKV_AXES, QKV_AXES, QKV_AXES, SEGMENT_AXES, ()), (False,) * 5)


def _window_index(window: jax.Array | int, windows: tuple[int, ...]) -> jax.Array:
    """The position of `window` in `windows` (0 when it is not there: `windows` holds every layer's)."""
    window = jnp.asarray(window, jnp.int32)
    return sum(jnp.where(window == w, i, 0) for i, w in enumerate(windows)).astype(jnp.int32)


def _per_device(q_BLHh, k_BSKh, v_BSKh, segment_ids_BL, index, *, windows: tuple[int, ...], interpret: bool):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    if not interpret and not runs_unpartitioned():
        raise ValueError("splash attention is a Pallas kernel XLA cannot partition: run it through a placement "
                         "that splits only the batch rows (every mesh axis manual), or on one device")
    _, L, H, h = q_BLHh.shape
    S, K = k_BSKh.shape[1], k_BSKh.shape[2]
    if H % K:
        raise ValueError(f"splash attention needs the query heads ({H}) to be a multiple of the key heads ({K})")
    block = block_size(L)
    if block is None or block_size(S) is None:
        raise ValueError(f"splash attention needs the sequence length ({L}) to be a multiple of 128")
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)

    def kernel_for(window: int):
        one = (splash.CausalMask((L, S)) if window <= 0
               else splash.LocalMask((L, S), window_size=(window - 1, 0), offset=0))
        return splash.make_splash_mha(splash.MultiHeadMask([one] * H), block_sizes=sizes, head_shards=1,
                                      q_seq_shards=1, interpret=interpret)

    kernels = [kernel_for(w) for w in windows]
    q_BHLh = jnp.swapaxes(q_BLHh * jnp.asarray(h**-0.5, q_BLHh.dtype), 1, 2)
    k_BKSh, v_BKSh = jnp.swapaxes(k_BSKh, 1, 2), jnp.swapaxes(v_BSKh, 1, 2)

    segments = splash.SegmentIds(q=segment_ids_BL, kv=segment_ids_BL)
    branches = [partial(lambda kern, *a: jax.vmap(kern)(*a), kern) for kern in kernels]
    out_BHLh = (branches[0](q_BHLh, k_BKSh, v_BKSh, segments) if len(branches) == 1
                else jax.lax.switch(index, branches, q_BHLh, k_BKSh, v_BKSh, segments))
    return jnp.swapaxes(out_BHLh, 1, 2).astype(q_BLHh.dtype)
