"""Splash attention over block masks on a TPU: dense causal attention (FlexPrefill's baseline and fallback)
and, for comparison, FlexPrefill's selection computed per query head in splash's fixed-width grid.

`block_sparse_attention` drives JAX's splash kernel (`jax.experimental.pallas.ops.tpu.splash_attention`)
with block metadata written from a block mask directly, never from a token mask: per (head, query block)
the listed key blocks, the diagonal first (`flexprefill.block_lists`), become the kernel's kv steps
(`data_next`). Off-diagonal blocks are whole (no mask is read), the diagonal reads the one causal tile
every head shares. JAX's own dynamic-mask entry point (`process_dynamic_mask`) would materialise a
[heads, N, N] token mask instead: 9.7 GB for SmolLM2's 9 heads at 32k, 155 GB at 128k.

The grid has a static number of kv steps per query block, the narrowest of `step_widths(nb)` that holds
the densest row (`lax.switch`), and the step tables live in the TPU's 1 MiB of scalar memory, so the kernel
is called once per key head's query heads and run of query blocks whose tables fit (`lax.map`: one
compile). For a sparse selection that grid is the problem `flexprefill_tpu` solves (every row pays the
densest row's steps, every step a 128-token tile); for the causal mask in `DENSE_TILE` tiles it is dense
splash attention (`dense_attention`), whose step tables fit scalar memory at any length.

What it preserves: the exact softmax over the listed blocks (tested against `flexprefill.sparse_attention`
in the interpreter). Lengths that are not a multiple of the block are padded at the end: padded keys come
after every real query, so causality alone hides them. The block must be a multiple of 128 (TPU lanes).

Shapes: q [B, N, H, h], k and v [B, N, K, h] after RoPE, before the h^-½ scale (applied here); n counts
blocks, F folded heads (B·H).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

from upcycler.train.model.flexprefill import block_lists
from upcycler.train.model.flexprefill_tpu import LANES, check_block, step_widths

DENSE_TILE = 512  # dense causal attention's tiles (splash's largest: fewer, fuller kernel steps)
SMEM_ENTRIES = 96 * 1024  # step-table entries per kernel call (4 bytes each, in the TPU's 1 MiB scalar memory)


def block_sparse_attention(q_BNHh, k_BNKh, v_BNKh, mask_BHnn, block: int, *, interpret: bool = False,
                           full_rows: bool = False) -> jax.Array:
    """Causal attention of every query block over the key blocks `mask_BHnn` selects (c ≤ r; the diagonal is
    always computed): [B, N, H, h], the exact softmax over the selected keys, in fp32 on chip.

    The grid's kv steps are the narrowest of `step_widths` that holds the densest row, chosen on device
    among kernels of each width; `full_rows` (the mask has a full row, as the causal mask's last) compiles
    the widest kernel alone."""
    check_block(block)
    B, _, H, _ = q_BNHh.shape
    nb = mask_BHnn.shape[-1]
    q_FPh, k_KPh, v_KPh = _fold(q_BNHh, k_BNKh, v_BNKh, nb * block)
    ids_Fns, valid_Fns = block_lists(mask_BHnn.reshape(B * H, nb, nb), nb)
    template = _template(block, interpret)
    widths = step_widths(nb)[-1:] if full_rows else step_widths(nb)
    kernels = [partial(_run, template=template, width=w, block=block) for w in widths]
    densest = valid_Fns.sum(-1).max()
    branch = sum((densest > w).astype(jnp.int32) for w in widths[:-1])
    out_FPh = jax.lax.switch(branch, kernels, q_FPh, k_KPh, v_KPh, ids_Fns, valid_Fns)
    return _unfold(out_FPh, q_BNHh)


def dense_attention(q_BNHh, k_BNKh, v_BNKh, *, window: int = 0, block: int = LANES, interpret: bool = False
                    ) -> jax.Array:
    """Dense causal attention [B, N, H, h] through the splash kernel: causal in tiles of `DENSE_TILE` (the
    causal block mask through `block_sparse_attention`, so its step tables fit scalar memory at any
    length), or a sliding window of `window` keys (distances 0 … window − 1) in tiles of `block` with the
    kernel's static local mask. FlexPrefill's dense fallback, and the baseline its sparsity is measured
    against."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    B, N, H, _ = q_BNHh.shape
    if window <= 0:
        nb = math.ceil(N / DENSE_TILE)
        causal = jnp.broadcast_to(jnp.tril(jnp.ones((nb, nb), bool)), (B, H, nb, nb))
        return block_sparse_attention(q_BNHh, k_BNKh, v_BNKh, causal, DENSE_TILE, interpret=interpret,
                                      full_rows=True)
    check_block(block)
    P = math.ceil(N / block) * block
    local = splash.LocalMask((P, P), window_size=(window - 1, 0), offset=0)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block)
    kernel = splash.make_splash_mha(splash.MultiHeadMask([local] * (B * H)), block_sizes=sizes, head_shards=1,
                                    q_seq_shards=1, interpret=interpret)
    return _unfold(kernel(*_fold(q_BNHh, k_BNKh, v_BNKh, P)), q_BNHh)


def _fold(q_BNHh, k_BNKh, v_BNKh, padded: int):
    """q scaled by h^-½, then q, k, v padded to `padded` positions with the batch folded into the heads:
    [B·H, P, h], [B·K, P, h] (prompt b's query head i reads kernel key head b·K + i // G)."""
    h = q_BNHh.shape[-1]
    fold = lambda x: jnp.pad(x, ((0, 0), (0, padded - x.shape[1]), (0, 0), (0, 0))).transpose(0, 2, 1, 3).reshape(
        -1, padded, h)
    return fold(q_BNHh * jnp.asarray(h**-0.5, q_BNHh.dtype)), fold(k_BNKh), fold(v_BNKh)


def _unfold(out_FPh, q_BNHh) -> jax.Array:
    B, N, H, h = q_BNHh.shape
    return out_FPh.reshape(B, H, -1, h)[:, :, :N].transpose(0, 2, 1, 3).astype(q_BNHh.dtype)


def _template(block: int, interpret: bool):
    """A splash kernel of the right tiles and options, whose settings the selection's kernels reuse."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block)
    return splash.make_splash_mha(splash.MultiHeadMask([splash.CausalMask((block, block))]), block_sizes=sizes,
                                  head_shards=1, q_seq_shards=1, interpret=interpret)


def _run(q_FPh, k_KPh, v_KPh, ids_Fns, valid_Fns, *, template, width: int, block: int) -> jax.Array:
    """The splash kernel over `width` kv steps per query block: step s of (head f, query block r) computes
    key block ids[f, r, s] if valid (the diagonal through the shared causal tile, others whole).

    The kernel keeps its step tables in scalar memory (1 MiB on TPU), so it runs once per kv head's query
    heads and per run of query blocks whose tables fit `SMEM_ENTRIES` (`lax.map`, one compile)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as mask_info

    F, P, h = q_FPh.shape
    groups, nb = k_KPh.shape[0], ids_Fns.shape[1]
    G = F // groups
    rows = max(1, min(nb, SMEM_ENTRIES // (G * width)))
    chunks = math.ceil(nb / rows)
    ids = jnp.pad(ids_Fns[..., :width], ((0, 0), (0, chunks * rows - nb), (0, 0)))
    valid = jnp.pad(valid_Fns[..., :width], ((0, 0), (0, chunks * rows - nb), (0, 0)))
    q_FPh = jnp.pad(q_FPh, ((0, 0), (0, chunks * rows * block - P), (0, 0)))
    row_ids = jnp.arange(chunks * rows)[None, :, None]
    # unused steps repeat the last listed block, so the kernel's pipeline fetches nothing new for them
    last = jnp.take_along_axis(ids, jnp.maximum(valid.sum(-1, keepdims=True) - 1, 0), axis=-1)
    small = jnp.int16 if nb <= jnp.iinfo(jnp.int16).max else jnp.int32
    data_next = jnp.where(valid, ids, last).astype(small)
    block_mask = jnp.where(valid, jnp.where(ids == row_ids, 1, 2), 0).astype(jnp.int8)
    diagonal = jnp.tril(jnp.ones((1, block, block), bool))
    kwargs = {**template.kwargs, "mask_function": None}

    def one_call(index):
        group, chunk = index // chunks, index % chunks
        heads = jax.lax.dynamic_slice_in_dim(jnp.arange(F), group * G, G)
        pick = lambda t: jax.lax.dynamic_slice_in_dim(t[heads], chunk * rows, rows, axis=1)
        info = mask_info.MaskInfo(data_next=pick(data_next), mask_next=jnp.zeros((G, rows, width), jnp.int8),
                                  block_mask=pick(block_mask), partial_mask_blocks=diagonal, q_sequence=None,
                                  is_dynamic_mask=False)
        q = jax.lax.dynamic_slice_in_dim(q_FPh[heads], chunk * rows * block, rows * block, axis=1)
        k, v = (jax.lax.dynamic_slice_in_dim(x, group, 1) for x in (k_KPh, v_KPh))
        return kernel.SplashAttentionKernel(info, None, None, **kwargs)(q, k, v)

    out_cGRh = jax.lax.map(one_call, jnp.arange(groups * chunks))
    out_FPh = out_cGRh.reshape(groups, chunks, G, rows * block, h).transpose(0, 2, 1, 3, 4).reshape(F, -1, h)
    return out_FPh[:, :P]
