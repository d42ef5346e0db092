"""FlexPrefill on a GPU: the selected key blocks computed by a Pallas kernel (Triton backend), batched.

`flexprefill_splash` runs FlexPrefill's selection through TPU splash attention; this is its GPU
counterpart for the attention itself. `block_sparse_attention` takes the same block masks and returns
the same attention, one jit-able function with one compile per prompt length:

1. Per (prompt, head, query block) the selected key blocks are listed, the diagonal first
   (`flexprefill.block_lists`), with their count: a table of [B·H, nb, nb] block ids and [B·H, nb]
   counts, computed on device. Blocks above the diagonal are dropped from the mask.
2. The kernel's grid is (B·H, nb): one program per folded head (prompt b's query head i is head
   b·H + i, reading key head b·K + i // G) and query block. A program holds its query block, computes
   the diagonal block under the causal mask, then walks the `count − 1` other listed blocks in a loop of
   dynamic trip count, each key and value block loaded from its head's whole sequence at a dynamic
   offset. So the work follows the selection row by row, with no static width.
3. Softmax online: a running max and sum per query and an fp32 accumulator, rescaled as blocks come;
   one division at the end. `window` > 0 masks every key at distance ≥ window in every block.

What it preserves: the exact softmax over the selected keys (the diagonal always included), as
`flexprefill.sparse_attention` computes it, up to fp32 rounding (tested against it in Pallas'
interpreter). Scores, softmax and accumulation are fp32; fp32 inputs multiply in full fp32 (Triton's
IEEE mode, not TF32); the probabilities are cast to v's dtype before their product with v, as the
reference's are, but unnormalised (one division at the end), so bf16 results differ by rounding.
Lengths that are not a multiple of the block are padded at the end: padded keys come after every real
query, so causality alone hides them. Triton tiles must have power-of-two sides of at least 16 (its
dot's smallest), so the block and the head dimension must be powers of two ≥ 16.

Shapes: q [B, N, H, h], k and v [B, N, K, h] after RoPE, before the h^-½ scale (applied in the kernel,
to the fp32 scores); mask [B, H, nb, nb] bool with nb = ⌈N / block⌉; n counts blocks, F folded heads
(B·H), P padded positions (nb·block).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from upcycler.train.model.flexprefill import block_lists

MIN_TILE = 16  # Triton's dot needs every side ≥ 16
NUM_WARPS = 4
NUM_STAGES = 2
_MASKED = float(jnp.finfo(jnp.float32).min)  # finite: exp(_MASKED − max) is 0, never NaN
_DOT = partial(jax.lax.dot_general, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def check_tile(block: int, head_dim: int) -> None:
    """The kernel tiles by the FlexPrefill block and the head dimension: powers of two ≥ 16."""
    for name, size in (("prefill_block", block), ("head dimension", head_dim)):
        if size < MIN_TILE or size & (size - 1):
            raise ValueError(f"{name} {size} cannot tile the Triton kernel: use a power of two ≥ {MIN_TILE}")


def block_sparse_attention(q_BNHh, k_BNKh, v_BNKh, mask_BHnn, block: int, *, window: int = 0,
                           interpret: bool = False) -> jax.Array:
    """Causal attention of every query block over the key blocks `mask_BHnn` selects (c ≤ r; the diagonal is
    always computed): [B, N, H, h] in q's dtype, the exact softmax over the selected keys, in fp32.
    `window` > 0 further limits every query to the keys at distance < window. `interpret` runs the kernel
    in Pallas' interpreter (any backend)."""
    B, N, H, h = q_BNHh.shape
    K = k_BNKh.shape[2]
    check_tile(block, h)
    nb = math.ceil(N / block)
    if mask_BHnn.shape != (B, H, nb, nb):
        raise ValueError(f"mask of shape {mask_BHnn.shape} for {B} prompts, {H} heads and {nb} blocks")
    P = nb * block
    fold = lambda x: jnp.pad(x, ((0, 0), (0, P - N), (0, 0), (0, 0))).transpose(0, 2, 1, 3).reshape(-1, P, h)
    q_FPh, k_KPh, v_KPh = fold(q_BNHh), fold(k_BNKh), fold(v_BNKh)
    causal_Fnn = jnp.asarray(mask_BHnn, bool).reshape(B * H, nb, nb) & jnp.tril(jnp.ones((nb, nb), bool))
    ids_Fnn, valid_Fnn = block_lists(causal_Fnn, nb)
    counts_Fn1 = valid_Fnn.sum(-1, dtype=jnp.int32)[..., None]
    G = H // K
    kv_head = lambda f, r: ((f // H) * K + (f % H) // G, 0, 0)
    tile = lambda f, r: (f, r, 0)
    kernel = partial(_kernel, block=block, window=window)
    out_FPh = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q_FPh.shape, q_BNHh.dtype),
        grid=(B * H, nb),
        in_specs=[pl.BlockSpec((None, block, h), tile),
                  pl.BlockSpec((None, P, h), kv_head),  # the head's whole sequence: blocks loaded by offset
                  pl.BlockSpec((None, P, h), kv_head),
                  pl.BlockSpec((None, None, nb), tile),
                  pl.BlockSpec((None, None, 1), tile)],
        out_specs=pl.BlockSpec((None, block, h), tile),
        compiler_params=plt.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
        interpret=interpret,
        name="flexprefill_block_sparse",
    )(q_FPh, k_KPh, v_KPh, ids_Fnn, counts_Fn1)
    return out_FPh.reshape(B, H, P, h)[:, :, :N].transpose(0, 2, 1, 3)


def _kernel(q_ref, k_ref, v_ref, ids_ref, count_ref, out_ref, *, block: int, window: int):
    """One (folded head, query block r): the diagonal block under the causal mask, then the other listed
    blocks (`ids_ref[1:count]`), online softmax in fp32."""
    r = pl.program_id(1)
    q_bh = q_ref[...]
    scale = q_bh.shape[-1] ** -0.5  # on the fp32 scores, as the reference scales them
    rows_b1 = r * block + jnp.arange(block, dtype=jnp.int32)[:, None]
    offsets_1b = jnp.arange(block, dtype=jnp.int32)[None, :]

    def step(c, carry, *, diagonal: bool):
        max_b1, sum_b1, acc_bh = carry
        start = pl.multiple_of(c * block, block)
        k_bh, v_bh = k_ref[pl.ds(start, block), :], v_ref[pl.ds(start, block), :]
        scores_bb = _DOT(q_bh, k_bh, (((1,), (1,)), ((), ()))) * scale
        if diagonal or window > 0:  # other blocks lie wholly before their queries: no causal mask
            distance_bb = rows_b1 - (start + offsets_1b)
            visible_bb = distance_bb < window if window > 0 else distance_bb >= 0
            if diagonal and window > 0:
                visible_bb &= distance_bb >= 0
            scores_bb = jnp.where(visible_bb, scores_bb, _MASKED)
        new_max_b1 = jnp.maximum(max_b1, scores_bb.max(axis=1, keepdims=True))
        probs_bb = jnp.exp(scores_bb - new_max_b1)
        rescale_b1 = jnp.exp(max_b1 - new_max_b1)
        sum_b1 = sum_b1 * rescale_b1 + probs_bb.sum(axis=1, keepdims=True)
        acc_bh = acc_bh * rescale_b1 + _DOT(probs_bb.astype(v_bh.dtype), v_bh, (((1,), (0,)), ((), ())))
        return new_max_b1, sum_b1, acc_bh

    init = (jnp.full((block, 1), _MASKED, jnp.float32), jnp.zeros((block, 1), jnp.float32),
            jnp.zeros(q_bh.shape, jnp.float32))
    # the diagonal (slot 0) sees each query's own key, so every row's max is finite from here on
    carry = step(r, init, diagonal=True)
    others = lambda s, carry: step(ids_ref[s], carry, diagonal=False)
    _, sum_b1, acc_bh = jax.lax.fori_loop(1, count_ref[0], others, carry)
    out_ref[...] = (acc_bh / sum_b1).astype(out_ref.dtype)
