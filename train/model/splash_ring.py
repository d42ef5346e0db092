"""`model.context_exchange: ring`: splash attention over a split sequence with the keys and values passed
around the context axis instead of gathered whole.

With context parallelism each of the c devices holds two chunks of every sequence (places i and 2c − 1 − i
of 2c, `upcycler.train.loop.context_parallel`). The gathering exchange (`splash._context_chunks`) first
collects the whole sequence's keys and values on every device, then attends. The ring keeps only one
device's block at a time: for c steps each device attends its two query chunks to the block it holds and
hands that block on to the next device, so the transfer of the next block overlaps the kernels of this one
and no device ever holds more than two blocks of keys and values.

What it preserves: the result equals the gathering exchange's (and one device's attention) within float
rounding. Each (query chunk, key chunk) pair runs through a splash kernel whose mask is the pair's part of
the causal (or sliding-window) mask: whole (keys all earlier and inside the window), causal (the diagonal),
a window offset by the pair's distance, or nothing (the pair is skipped, no kernel runs). The partial
results carry their log-sum-exp and are merged in fp32 (online softmax). The backward pass goes around the
ring again: each pair's gradients come from splash's backward kernels given the final output and
log-sum-exp (the flash-attention backward), the query gradient stays, the key and value gradients travel
with their block and arrive home after c hops. Packed documents (segment ids) and grouped-query heads are
kept as in `splash`. Every device runs two whole-pair kernels' worth of work per step (the balanced order
makes every step even).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

CONTEXT_AXIS = "context"
_EMPTY_LSE = -1e30  # a skipped pair's log-sum-exp: weighs nothing beside any real one


def attention(q_BLHh, k_BSKh, v_BSKh, q_segments_BL, kv_segments_BS, index, *, windows: tuple[int, ...],
              interpret: bool, context: int, block: int):
    """This device's two query chunks attended over the whole sequence, the keys and values passed around
    the ring of `context` devices; [B, L, H, h] like q (already in the balanced order). `index` (traced)
    is the layer's window's position in `windows`; q is scaled by h^-½ here."""
    h = q_BLHh.shape[-1]
    q_BHLh = jnp.swapaxes(q_BLHh * jnp.asarray(h**-0.5, q_BLHh.dtype), 1, 2)
    k_BKSh, v_BKSh = jnp.swapaxes(k_BSKh, 1, 2), jnp.swapaxes(v_BSKh, 1, 2)
    pairs, infos = _Pairs.build(windows, chunk=q_BLHh.shape[1] // 2, heads=q_BLHh.shape[2], context=context,
                                block=block, interpret=interpret)
    out_BHLh = _ring(pairs, infos, q_BHLh, k_BKSh, v_BKSh, q_segments_BL, kv_segments_BS,
                     jnp.asarray(index, jnp.int32))
    return jnp.swapaxes(out_BHLh, 1, 2).astype(q_BLHh.dtype)


class _Pairs:
    """The kernels of every (window, query place − key place) pair, and which one runs for each.

    `table[w, d + 2c − 1]` is the branch for window `windows[w]` and a query chunk d chunks after the key
    chunk (d < 0: before it); branch 0 skips the pair, branch b > 0 runs kernel b − 1: its static options
    are `options[b − 1]`, its mask tables (arrays of the trace that builds them) travel beside as `infos`,
    an argument of the differentiated function, so its backward pass receives them rather than closes
    over them."""

    def __init__(self, options: list[dict], table: np.ndarray, context: int):
        self.options, self.table, self.context = options, table, context

    @classmethod
    def build(cls, windows: tuple[int, ...], *, chunk: int, heads: int, context: int, block: int,
              interpret: bool) -> tuple[_Pairs, list]:
        from jax.experimental.pallas.ops.tpu import splash_attention as splash

        sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                                  block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block,
                                  block_kv_dq=block)
        places = 2 * context
        masks: dict = {}  # a mask's description -> (its branch, the mask)
        table = np.zeros((len(windows), 2 * places - 1), np.int32)
        for w, window in enumerate(windows):
            for d in range(-(places - 1), places):
                described = _pair_mask(splash, window, d, chunk)
                if described is None:
                    continue
                name, mask = described
                masks.setdefault(name, (len(masks) + 1, mask))
                table[w, d + places - 1] = masks[name][0]
        kernels = [splash.make_splash_mha(splash.MultiHeadMask([mask] * heads), block_sizes=sizes, head_shards=1,
                                          q_seq_shards=1, save_residuals=True, interpret=interpret)
                   for _, mask in masks.values()]
        infos = [(k.fwd_mask_info, k.dq_mask_info, k.dkv_mask_info) for k in kernels]
        return cls([k.kwargs for k in kernels], table, context), infos


def _pair_mask(splash, window: int, d: int, chunk: int):
    """(a description, the mask) of a query chunk d chunks after its key chunk, or None when it sees none of
    them. Query row i and key column j lie d·chunk + i − j tokens apart; causal: 0 ≤ distance; window w: < w."""
    nearest, farthest = d * chunk - (chunk - 1), d * chunk + chunk - 1
    shape = (chunk, chunk)
    if farthest < 0 or (window > 0 and nearest > window - 1):
        return None
    if nearest >= 0 and (window <= 0 or farthest <= window - 1):
        return ("whole",), splash.FullMask(shape)
    if window <= 0:
        return ("causal", d), splash.CausalMask(shape, offset=d * chunk)
    return ("window", window, d), splash.LocalMask(shape, window_size=(window - 1, 0), offset=d * chunk)


def _places(me, step, context: int):
    """The places of this device's query chunks and of the key chunks it holds at `step` (the block of
    device me − step), as ((q0, q1), (k0, k1))."""
    owner = (me - step) % context
    return (me, 2 * context - 1 - me), (owner, 2 * context - 1 - owner)


def _branch(pairs: _Pairs, index, q_place, k_place):
    """The branch (0: skip) of a pair of chunks at these places under the layer's window (traced)."""
    return jnp.asarray(pairs.table)[index, q_place - k_place + 2 * pairs.context - 1]


def _halves(x, axis: int):
    n = x.shape[axis] // 2
    return jax.lax.slice_in_dim(x, 0, n, axis=axis), jax.lax.slice_in_dim(x, n, 2 * n, axis=axis)


def _pass_on(tree, context: int):
    """Every array of `tree` sent to the next device of the ring."""
    perm = [(i, (i + 1) % context) for i in range(context)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, CONTEXT_AXIS, perm), tree)


def _pair_forward(pairs: _Pairs, infos, branch, q_BHLh, k_BKSh, v_BKSh, q_seg_BL, kv_seg_BS):
    """(out fp32 [B, H, L, h], lse [B, H, L]) of one pair; zeros and an empty lse when skipped."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib

    def skip(q, k, v, qs, ks):
        return (jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:3], _EMPTY_LSE, jnp.float32))

    def run(kernel, q, k, v, qs, ks):
        out, (lse,) = jax.vmap(lambda *a: kernel(a[0], a[1], a[2], splash.SegmentIds(q=a[3], kv=a[4])))(
            q, k, v, qs, ks)
        return out.astype(jnp.float32), lse.astype(jnp.float32)

    kernels = [kernel_lib.SplashAttentionKernel(*info, **options) for info, options in zip(infos, pairs.options)]
    branches = [skip] + [partial(run, kernel) for kernel in kernels]
    return jax.lax.switch(branch, branches, q_BHLh, k_BKSh, v_BKSh, q_seg_BL, kv_seg_BS)


def _pair_backward(pairs: _Pairs, infos, branch, q_BHLh, k_BKSh, v_BKSh, q_seg_BL, kv_seg_BS, out_BHLh, lse_BHL,
                   dout_BHLh):
    """(dq, dk, dv) of one pair given the final output and log-sum-exp of its queries (zeros when skipped):
    splash's backward kernels, which need only those, the pair's inputs and the output's cotangent."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib

    def skip(q, k, v, *_):
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)

    def run(info, kw, q, k, v, qs, ks, out, lse, dout):
        info = [_collapsed(m) for m in info[1:]]

        def one(q, k, v, qs, ks, out, lse, dout):
            residuals = (q, k, v, kernel_lib.SegmentIds(q=qs, kv=ks), None, out, lse, *info)
            grads = kernel_lib._splash_attention_bwd(
                False, kw["mask_value"], kw["is_mqa"], kw["block_sizes"], kw["residual_checkpoint_name"],
                kw["mask_function"], kw["attn_logits_soft_cap"], kw["interpret"], residuals, dout)
            return grads[3:6]

        return jax.vmap(one)(q, k, v, qs, ks, out, lse, dout)

    branches = [skip] + [partial(run, info, options) for info, options in zip(infos, pairs.options)]
    return jax.lax.switch(branch, branches, q_BHLh, k_BKSh, v_BKSh, q_seg_BL, kv_seg_BS, out_BHLh, lse_BHL,
                          dout_BHLh)


def _collapsed(mask_info):
    """A mask info as splash's kernels take it (its partial blocks as one list of tiles)."""
    if mask_info is None or mask_info.partial_mask_blocks is None:
        return mask_info
    blocks = mask_info.partial_mask_blocks
    return mask_info._replace(partial_mask_blocks=blocks.reshape(-1, *blocks.shape[-2:]))


def _merge(out_a, lse_a, out_b, lse_b):
    """Two partial attentions of the same queries over disjoint keys merged (online softmax, fp32)."""
    lse = jnp.logaddexp(lse_a, lse_b)
    return (out_a * jnp.exp(lse_a - lse)[..., None] + out_b * jnp.exp(lse_b - lse)[..., None]), lse


def _step_forward(pairs: _Pairs, infos, index, me, step, q_BHLh, q_seg_BL, held, acc):
    """`acc` (per query chunk: out, lse) after attending to the block `held` (k, v, key segment ids)."""
    k_BKSh, v_BKSh, kv_seg_BS = held
    q_places, k_places = _places(me, step, pairs.context)
    qs, q_segs = _halves(q_BHLh, 2), _halves(q_seg_BL, 1)
    ks, vs, k_segs = _halves(k_BKSh, 2), _halves(v_BKSh, 2), _halves(kv_seg_BS, 1)
    acc = list(acc)
    for a in range(2):
        for b in range(2):
            out, lse = _pair_forward(pairs, infos, _branch(pairs, index, q_places[a], k_places[b]), qs[a], ks[b], vs[b],
                                     q_segs[a], k_segs[b])
            acc[a] = _merge(*acc[a], out, lse)
    return tuple(acc)


def _forward(pairs: _Pairs, infos, q_BHLh, k_BKSh, v_BKSh, q_seg_BL, kv_seg_BS, index):
    me = jax.lax.axis_index(CONTEXT_AXIS)
    B, H, L, h = q_BHLh.shape
    empty = (jnp.zeros((B, H, L // 2, h), jnp.float32), jnp.full((B, H, L // 2), _EMPTY_LSE, jnp.float32))
    acc = (empty, empty)
    held = (k_BKSh, v_BKSh, kv_seg_BS)

    def body(carry, step):
        held, acc = carry
        passed = _pass_on(held, pairs.context)  # independent of this step's kernels: the transfer overlaps them
        return (passed, _step_forward(pairs, infos, index, me, step, q_BHLh, q_seg_BL, held, acc)), None

    (held, acc), _ = jax.lax.scan(body, (held, acc), jnp.arange(pairs.context - 1))
    acc = _step_forward(pairs, infos, index, me, pairs.context - 1, q_BHLh, q_seg_BL, held, acc)
    out = jnp.concatenate([acc[0][0], acc[1][0]], axis=2)
    lse = jnp.concatenate([acc[0][1], acc[1][1]], axis=2)
    return out, lse


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(pairs: _Pairs, infos, q_BHLh, k_BKSh, v_BKSh, q_seg_BL, kv_seg_BS, index):
    return _forward(pairs, infos, q_BHLh, k_BKSh, v_BKSh, q_seg_BL, kv_seg_BS, index)[0].astype(q_BHLh.dtype)


def _ring_fwd(pairs, infos, q_BHLh, k_BKSh, v_BKSh, q_seg_BL, kv_seg_BS, index):
    out, lse = _forward(pairs, infos, q_BHLh, k_BKSh, v_BKSh, q_seg_BL, kv_seg_BS, index)
    out = out.astype(q_BHLh.dtype)
    return out, (infos, q_BHLh, k_BKSh, v_BKSh, q_seg_BL, kv_seg_BS, index, out, lse)


def _ring_bwd(pairs, residuals, dout_BHLh):
    infos, q_BHLh, k_BKSh, v_BKSh, q_seg_BL, kv_seg_BS, index, out_BHLh, lse_BHL = residuals
    me = jax.lax.axis_index(CONTEXT_AXIS)
    qs, q_segs = _halves(q_BHLh, 2), _halves(q_seg_BL, 1)
    outs, lses, douts = _halves(out_BHLh, 2), _halves(lse_BHL, 2), _halves(dout_BHLh.astype(q_BHLh.dtype), 2)

    def grads(step, held, dq_acc, dkv_acc):
        """This step's pairs' gradients added: the query chunks' to `dq_acc`, the held block's to `dkv_acc`."""
        k_BKSh, v_BKSh, kv_seg_BS = held
        q_places, k_places = _places(me, step, pairs.context)
        ks, vs, k_segs = _halves(k_BKSh, 2), _halves(v_BKSh, 2), _halves(kv_seg_BS, 1)
        dq = list(_halves(dq_acc, 2))
        dk, dv = list(_halves(dkv_acc[0], 2)), list(_halves(dkv_acc[1], 2))
        for a in range(2):
            for b in range(2):
                branch = _branch(pairs, index, q_places[a], k_places[b])
                gq, gk, gv = _pair_backward(pairs, infos, branch, qs[a], ks[b], vs[b], q_segs[a], k_segs[b], outs[a],
                                            lses[a], douts[a])
                dq[a] = dq[a] + gq.astype(jnp.float32)
                dk[b], dv[b] = dk[b] + gk.astype(jnp.float32), dv[b] + gv.astype(jnp.float32)
        return jnp.concatenate(dq, axis=2), (jnp.concatenate(dk, axis=2), jnp.concatenate(dv, axis=2))

    def body(carry, step):
        held, dq, dkv = carry
        dq, dkv = grads(step, held, dq, dkv)
        return (_pass_on(held, pairs.context), dq, _pass_on(dkv, pairs.context)), None

    held = (k_BKSh, v_BKSh, kv_seg_BS)
    dq = jnp.zeros(q_BHLh.shape, jnp.float32)
    dkv = (jnp.zeros(k_BKSh.shape, jnp.float32), jnp.zeros(v_BKSh.shape, jnp.float32))
    (held, dq, dkv), _ = jax.lax.scan(body, (held, dq, dkv), jnp.arange(pairs.context - 1))
    dq, dkv = grads(pairs.context - 1, held, dq, dkv)
    dk, dv = _pass_on(dkv, pairs.context)  # the last hop brings each block's gradients home
    no_infos = jax.tree.map(lambda _: None, infos)
    return (no_infos, dq.astype(q_BHLh.dtype), dk.astype(k_BKSh.dtype), dv.astype(v_BKSh.dtype), None, None,
            None)


_ring.defvjp(_ring_fwd, _ring_bwd)
