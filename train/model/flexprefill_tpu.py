"""FlexPrefill's TPU kernel: a key head's query heads together, each query block's selected keys walked in
slabs inside one grid step.

Splash attention over FlexPrefill's 128-token blocks pays twice for sparsity (measured in the compile
bound, `bench/prefill_roofline.py`): its grid iterates a fixed number of kv steps per (head, query
block), as many as the densest row holds, so empty steps cost a grid step each (~0.35 µs); and each step
is one 128×128 tile, which at head size 64 does 128 FLOP per byte fetched, under the TPU's ridge. This
kernel is shaped for sparse blocks instead:

- **Grouped query heads.** One grid step is one (key head, query block): the G query heads that read the
  key head attend together, G·block query rows against every key block fetched, so a fetched block is
  used G times (G× the arithmetic intensity of a per-head kernel). It computes the union of the G heads'
  selections; a head that did not select a block has that block masked out of its rows, so each head's
  softmax is over its own selection exactly.
- **A compacted grid.** The grid has one step per (key head, query block) and nothing else. Inside a
  step a loop walks only the row's listed key blocks (`count` of them, read from scalar memory), `SLAB`
  blocks per iteration: their keys and values are copied from HBM into a VMEM slab by DMA, double
  buffered (the next slab, also the next row's first, is in flight while this one is computed), and one
  [G·block, SLAB·block] score tile is computed: with G = 3 and 8 blocks of 128, 384 × 1024 scores, about
  the work of one dense 512 × 512 splash tile (1.5×). Empty steps do not exist; a row pays for its own
  blocks, rounded up to a slab (8 blocks: measured on real selections at 32k, the model's time is 25% under
  4-block slabs; 16 would halve the loop again but pad short rows more and double the VMEM).
- **Online softmax** (running max, sum and fp32 accumulator) over the slabs; the diagonal block is masked
  causally inside, and `window` > 0 masks keys at distance ≥ window (sliding-window layers).

Step tables. Per key head and query block, its listed blocks in `width` slots, each entry the block id
with the G heads' selection bits above it (`_ID_BITS`), and the count; the diagonal comes first, so every
row's running max is finite from the first slab. Tables live in scalar memory (SMEM, 1 MiB on TPU), so the
kernel is called once per key head and run of query blocks whose tables fit `SMEM_ENTRIES` (`lax.map`,
one compile); `width` is the narrowest of `step_widths` holding the densest row, chosen
on device (`lax.switch`), so one compile per prompt length serves every selection.

What it preserves: the output equals `flexprefill.sparse_attention` on the same masks (the exact softmax
over each head's selected key blocks, scores and softmax in fp32), and with a band mask and `window` the
windowed `flexprefill.causal_attention`; tested in the Pallas TPU interpreter. Lengths off the block grid
are padded at the end: padded keys come after every real query, so causality hides them.

Shapes: q [B, N, H, h], k and v [B, N, K, h] after RoPE, before the h^-½ scale (applied here), query head
i reading key head i // G; mask [B, H, nb, nb]. Inside, the batch is folded into the key heads (F = B·K)
and q is [F, G, P, h] (P: the padded length).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from upcycler.train.model.flexprefill import block_lists

LANES = 128  # a tile's sides must be multiples of this
SLAB = 8  # key blocks per loop iteration (module docstring)
SMEM_ENTRIES = 96 * 1024  # step-table entries per kernel call (4 bytes each, in the TPU's 1 MiB scalar memory)
_ID_BITS = 20  # an entry is (block id) | (heads' selection bits << _ID_BITS): nb < 2^20, G ≤ 11
WIDTH_FRACTIONS = (1, 2, 4, 8)  # step-table widths compiled: nb / these
_MASKED = float(np.finfo(np.float32).min) * 0.7  # finite: masked scores give exp(·) = 0, never NaN


def check_block(block: int) -> None:
    """A TPU kernel tiles by the FlexPrefill block: it must be a positive multiple of 128 (the lanes)."""
    if block <= 0 or block % LANES:
        raise ValueError(f"prefill_block {block} cannot tile the TPU kernels: use a multiple of {LANES} "
                         "(128 is the paper's)")


def check_shapes(block: int, heads: int, kv_heads: int, nb: int) -> None:
    """The kernel tiles by the FlexPrefill block (`check_block`) and packs G selection bits and a block id
    into one int32."""
    check_block(block)
    if heads // kv_heads > 31 - _ID_BITS or nb >= 1 << _ID_BITS:
        raise ValueError(f"{heads // kv_heads} query heads per key head and {nb} blocks do not fit the kernel's "
                         f"step tables (at most {31 - _ID_BITS} and {1 << _ID_BITS})")


def step_widths(nb: int) -> tuple[int, ...]:
    """The kv step counts compiled for nb key blocks, smallest first (distinct, each ≥ 1)."""
    return tuple(sorted({max(1, math.ceil(nb / f)) for f in WIDTH_FRACTIONS}))


def step_tables(mask_BHnn: jax.Array, kv_heads: int, width: int, rows: int) -> tuple[jax.Array, jax.Array]:
    """Per folded key head f = b·K + j and query block r: the union of its G query heads' selected key
    blocks (and the diagonal), diagonal first, each entry id | (selection bits of the G heads << _ID_BITS),
    in `width` slots rounded up to whole slabs [F, rows, slots] (unused slots: the last listed block, no
    bits), and the count [F, rows]. Rows past nb (`rows` > nb pads them) list block 0 for every head: they
    compute padding, which is dropped."""
    B, H, nb, _ = mask_BHnn.shape
    G = H // kv_heads
    mask_FGnn = mask_BHnn.reshape(B * kv_heads, G, nb, nb) | jnp.eye(nb, dtype=bool)
    ids_Fns, valid_Fns = block_lists(mask_FGnn.any(1), width)
    bits_Fns = sum((jnp.take_along_axis(mask_FGnn[:, g], ids_Fns, axis=-1) & valid_Fns).astype(jnp.int32) << g
                   for g in range(G))
    count_Fn = valid_Fns.sum(-1).astype(jnp.int32)
    last_Fn1 = jnp.take_along_axis(ids_Fns, jnp.maximum(count_Fn - 1, 0)[..., None], axis=-1)
    entries_Fns = jnp.where(valid_Fns, ids_Fns | (bits_Fns << _ID_BITS), last_Fn1)
    slots = math.ceil(width / SLAB) * SLAB
    entries_Fns = jnp.concatenate([entries_Fns, jnp.broadcast_to(last_Fn1, (*last_Fn1.shape[:2], slots - width))], -1)
    padding = jnp.full((entries_Fns.shape[0], rows - nb, slots), ((1 << G) - 1) << _ID_BITS, jnp.int32)
    return (jnp.concatenate([entries_Fns, padding], 1),
            jnp.pad(count_Fn, ((0, 0), (0, rows - nb)), constant_values=1))


def block_sparse_attention(q_BNHh, k_BNKh, v_BNKh, mask_BHnn, block: int, *, window: int = 0,
                           widths: tuple[int, ...] | None = None, interpret: bool = False) -> jax.Array:
    """Attention of every query block over the key blocks `mask_BHnn` selects (c ≤ r; the diagonal is always
    computed): [B, N, H, h], the exact softmax over each head's selected keys (module docstring).

    `widths`: the step-table widths compiled (default `step_widths(nb)`); the narrowest
    holding the densest row runs."""
    B, N, H, h = q_BNHh.shape
    K = k_BNKh.shape[2]
    nb = mask_BHnn.shape[-1]
    check_shapes(block, H, K, nb)
    widths = step_widths(nb) if widths is None else widths
    P = nb * block
    pad = lambda x: jnp.pad(x, ((0, 0), (0, P - N), (0, 0), (0, 0)))
    scaled = q_BNHh * jnp.asarray(h**-0.5, q_BNHh.dtype)
    q_FGPh = pad(scaled).reshape(B, P, K, H // K, h).transpose(0, 2, 3, 1, 4).reshape(B * K, H // K, P, h)
    k_FPh, v_FPh = (pad(x).transpose(0, 2, 1, 3).reshape(B * K, P, h) for x in (k_BNKh, v_BNKh))
    union_Fnn = mask_BHnn.reshape(B * K, H // K, nb, nb).any(1) | jnp.eye(nb, dtype=bool)
    densest = union_Fnn.sum(-1).max()
    branch = sum((densest > w).astype(jnp.int32) for w in widths[:-1])
    kernels = [partial(_attend, mask_BHnn=mask_BHnn, width=w, block=block, window=window, length=N,
                       interpret=interpret)
               for w in widths]
    return jax.lax.switch(branch, kernels, q_FGPh, k_FPh, v_FPh).astype(q_BNHh.dtype)


def _attend(q_FGPh, k_FPh, v_FPh, *, mask_BHnn, width: int, block: int, window: int, length: int,
            interpret: bool):
    """The kernel over step tables of `width` slots, one call per key head and run of query blocks whose
    tables fit `SMEM_ENTRIES` (`lax.map`, the runs as even as they can be): [B, length, H, h]."""
    F, G, P, h = q_FGPh.shape
    B, nb = mask_BHnn.shape[0], P // block
    slots = math.ceil(width / SLAB) * SLAB
    chunks = math.ceil(nb / max(1, min(nb, SMEM_ENTRIES // slots)))
    rows = math.ceil(nb / chunks)
    entries_Fns, count_Fn = step_tables(mask_BHnn, F // B, width, chunks * rows)
    kernel = _kernel_call(G, rows, block, h, window, q_FGPh.dtype, interpret, last_block=nb - 1)

    def one_call(index):
        head, chunk = index // chunks, index % chunks
        take = lambda t: jax.lax.dynamic_slice_in_dim(t[head], chunk * rows, rows)
        entries, count = take(entries_Fns), take(count_Fn)
        slabs = (count + SLAB - 1) // SLAB
        first = jnp.cumsum(slabs) - slabs  # each row's first slab, counted over the call: its buffer is this mod 2
        place = jnp.stack([head, chunk * rows]).astype(jnp.int32)
        return kernel(place, entries, count, first, q_FGPh, k_FPh, v_FPh)

    out_cGRh = jax.lax.map(one_call, jnp.arange(F * chunks))
    # one transpose to the caller's layout: [B, K, chunks, G, rows·block, h] → [B, chunks·rows·block, K·G, h]
    out = out_cGRh.reshape(B, F // B, chunks, G, rows * block, h).transpose(0, 2, 4, 1, 3, 5)
    return out.reshape(B, chunks * rows * block, F // B * G, h)[:, :length]


def _kernel_call(G: int, rows: int, block: int, h: int, window: int, dtype, interpret: bool, *, last_block: int):
    """The pallas_call of one key head and `rows` query blocks: grid (rows,), q and out by BlockSpec (a row
    past `last_block`, padding, reads the last query block again), k and v left in HBM and copied slab by
    slab."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    kernel = partial(_row_kernel, G=G, block=block, window=window, rows=rows)
    keys = SLAB * block
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,  # place [key head, first row], entries [rows, slots], count [rows], first [rows]
        grid=(rows,),
        in_specs=[pl.BlockSpec((None, G, block, h),
                               lambda i, place, *_: (place[0], 0, jnp.minimum(place[1] + i, last_block), 0)),
                  pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((G, block, h), lambda i, *_: (0, i, 0)),
        scratch_shapes=[pltpu.VMEM((2, keys, h), dtype), pltpu.VMEM((2, keys, h), dtype),
                        pltpu.SemaphoreType.DMA((2, 2, SLAB))],
    )
    return pl.pallas_call(
        kernel, grid_spec=spec, out_shape=jax.ShapeDtypeStruct((G, rows * block, h), dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=pltpu.InterpretParams() if interpret else False, name="flexprefill_grouped")


def _row_kernel(place, entries, count, first, q_ref, k_hbm, v_hbm, o_ref, k_slab, v_slab, sems, *, G: int,
                block: int, window: int, rows: int):
    """One (key head, query block): the G heads' queries against the row's listed key blocks, slab by slab;
    the first slab (holding the diagonal) masked causally, every slab masked per head by its selection
    bits."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    i = pl.program_id(0)
    head, row = place[0], place[1] + i
    h = q_ref.shape[-1]
    keys = SLAB * block
    id_mask = (1 << _ID_BITS) - 1

    def copies(r, slab, buffer):
        """The DMAs of slab `slab` of local row `r` into `buffer`: SLAB key blocks and their values."""
        out = []
        for j in range(SLAB):
            at = pl.ds(pl.multiple_of((entries[r, slab * SLAB + j] & id_mask) * block, block), block)
            into = pl.ds(j * block, block)
            out.append(pltpu.make_async_copy(k_hbm.at[head, at], k_slab.at[buffer, into], sems.at[0, buffer, j]))
            out.append(pltpu.make_async_copy(v_hbm.at[head, at], v_slab.at[buffer, into], sems.at[1, buffer, j]))
        return out

    @pl.when(i == 0)
    def _():
        for copy in copies(0, 0, first[0] % 2):
            copy.start()

    slabs = (count[i] + SLAB - 1) // SLAB
    q = q_ref[...].reshape(G * block, h)
    # fp32 inputs multiply in full fp32 (as the CPU path at the highest precision); bf16 at the MXU's own
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    query_pos = row * block + jax.lax.broadcasted_iota(jnp.int32, (1, block, 1), 1)

    def step(s, carry, *, diagonal: bool):
        m_prev, l_prev, acc_prev = carry
        buffer = (first[i] + s) % 2
        for copy in copies(i, s, buffer):
            copy.wait()

        @pl.when(s + 1 < slabs)
        def _():
            for copy in copies(i, s + 1, 1 - buffer):
                copy.start()

        @pl.when((s + 1 == slabs) & (i + 1 < rows))  # the next row's first slab, while this one computes
        def _():
            for copy in copies(i + 1, 0, 1 - buffer):
                copy.start()

        scores = jax.lax.dot_general(q, k_slab[buffer], (((1,), (1,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)
        scores_Gbk = scores.reshape(G, block, keys)
        entry = [entries[i, s * SLAB + j] for j in range(SLAB)]
        # per head, the slab's key columns its selection covers [G, 1, keys]; unused slots have no bits
        chosen = jnp.concatenate([
            jnp.concatenate([jnp.full((1, 1, block), (e >> (_ID_BITS + g)) & 1, jnp.int32) for e in entry], axis=-1)
            for g in range(G)], axis=0) == 1
        visible = chosen
        if diagonal or window > 0:
            key_pos = jnp.concatenate([(e & id_mask) * block + jax.lax.broadcasted_iota(jnp.int32, (1, 1, block), 2)
                                       for e in entry], axis=-1)
            seen = key_pos <= query_pos
            if window > 0:
                seen = seen & (query_pos - key_pos < window)
            visible = visible & seen
        scores = jnp.where(visible, scores_Gbk, _MASKED).reshape(G * block, keys)
        m_new = jnp.maximum(m_prev, scores.max(-1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(scores - m_new)
        l_new = alpha * l_prev + p.sum(-1, keepdims=True)
        v = v_slab[buffer]
        acc = alpha * acc_prev + jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                                    precision=precision, preferred_element_type=jnp.float32)
        return m_new, l_new, acc

    init = (jnp.full((G * block, 1), _MASKED, jnp.float32), jnp.zeros((G * block, 1), jnp.float32),
            jnp.zeros((G * block, h), jnp.float32))
    # every row lists its diagonal first: the first slab is the only one to mask causally (and is never empty)
    carry = step(0, init, diagonal=True)
    _, l, acc = jax.lax.fori_loop(1, slabs, partial(step, diagonal=False), carry)
    o_ref[...] = (acc / l).reshape(G, block, h).astype(o_ref.dtype)
