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

The kernel runs per device on its own rows of the batch (the placement's `per_device`, a `shard_map` on
a mesh). With the sequence split over a context axis (context parallelism, held in the balanced order of
`upcycler.train.loop.context_parallel`: device i holds chunks i and 2c − 1 − i), each device gathers the
keys, values and key segment ids of the whole sequence, puts them back in sequence order, and runs each of
its two query chunks through a kernel whose causal (or window) mask is offset by that chunk's place in the
sequence: one kernel per chunk place, chosen at run time by the device's index. The blocks such a mask
rules out are skipped, so every device does the same work (`exchange` "gather", `model.context_exchange`).
The other exchange, "ring", passes the keys and values around the context axis a block at a time instead
(`upcycler.train.model.splash_ring`). On CPU it runs in the Pallas interpreter (exact but slow, for tests);
other platforms are refused.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from upcycler.train.config import CONTEXT_EXCHANGES
from upcycler.train.model import splash_ring
from upcycler.train.model.gmm import runs_unpartitioned, target_platform
from upcycler.train.model.placement import Placement

QKV_AXES = ("batch", "seq", None, None)  # q [B, L, H, h], k and v [B, S, K, h]: rows and sequence chunks split
CONTEXT_AXIS = "context"  # the mesh axis a split sequence's chunks lie along (`upcycler.train.loop.sharding`)
SEGMENT_AXES = ("batch", "seq")
BLOCKS = (512, 256, 128)  # the kernel's tiles along the sequence, largest first (multiples of 128: TPU lanes)


def block_size(length: int) -> int | None:
    """The tile the kernel uses for a sequence of `length` tokens (the largest of `BLOCKS` dividing it), or
    None when none does: the length must be a multiple of 128, interpreted or not."""
    return next((block for block in BLOCKS if length % block == 0), None)


def attention(q_BLHh: jax.Array, k_BSKh: jax.Array, v_BSKh: jax.Array, *, segment_ids_BL: jax.Array | None,
              window: jax.Array | int, windows: tuple[int, ...], placement: Placement,
              token_index_BL: jax.Array | None = None, exchange: str = "gather") -> jax.Array:
    """Causal grouped-query attention of q over k, v through the splash kernel; [B, L, H, h] like q.

    `segment_ids_BL` None: one document per row. `window` (traced, per layer) is one of `windows` (the
    distinct windows of the layers run together; 0 is full attention); `placement` runs the kernel per
    device on its rows of the batch and, when the mesh splits the sequence, its chunks of it.
    `token_index_BL` not None says the tokens are in context parallelism's balanced order (its values are
    not read: the order follows from the mesh); see the module docstring. `exchange` says how a split
    sequence's keys and values reach every query: "gather" (whole, on every device) or "ring"
    (`upcycler.train.model.splash_ring`: passed around the context axis a block at a time).
    """
    platform = target_platform()
    if platform not in ("tpu", "cpu"):
        raise ValueError(f"attention splash is a TPU kernel (interpreted on CPU for tests); on {platform} use "
                         "attention dot_product")
    interpret = platform != "tpu"
    if segment_ids_BL is None:
        segment_ids_BL = jnp.zeros(q_BLHh.shape[:2], jnp.int32)
    distinct = tuple(sorted(set(windows)))
    mesh = placement.mesh()
    degree = dict(mesh.shape).get(CONTEXT_AXIS, 1) if mesh is not None else 1
    if degree > 1 and token_index_BL is None:
        raise ValueError("a sequence split over the context axis must come in the balanced order (pass "
                         "token_index_BL, as the train step does)")
    if exchange not in CONTEXT_EXCHANGES:
        raise ValueError(f"a split sequence's keys and values are exchanged by one of {CONTEXT_EXCHANGES}, "
                         f"not {exchange!r}")
    run = partial(_per_device, windows=distinct, interpret=interpret, context=degree, exchange=exchange)
    return placement.per_device(run, (q_BLHh, k_BSKh, v_BSKh, segment_ids_BL, _window_index(window, distinct)),
                                (QKV_AXES, QKV_AXES, QKV_AXES, SEGMENT_AXES, ()), (False,) * 5)


def _window_index(window: jax.Array | int, windows: tuple[int, ...]) -> jax.Array:
    """The position of `window` in `windows` (0 when it is not there: `windows` holds every layer's)."""
    window = jnp.asarray(window, jnp.int32)
    return sum(jnp.where(window == w, i, 0) for i, w in enumerate(windows)).astype(jnp.int32)


def _per_device(q_BLHh, k_BSKh, v_BSKh, segment_ids_BL, index, *, windows: tuple[int, ...], interpret: bool,
                context: int = 1, exchange: str = "gather"):
    if context > 1 and exchange == "ring":
        block = _checked_block(q_BLHh.shape[1] // 2, q_BLHh, k_BSKh, interpret)
        return splash_ring.attention(q_BLHh, k_BSKh, v_BSKh, segment_ids_BL, segment_ids_BL, index,
                                     windows=windows, interpret=interpret, context=context, block=block)
    if context > 1:
        return _context_chunks(q_BLHh, k_BSKh, v_BSKh, segment_ids_BL, index, windows=windows,
                               interpret=interpret, context=context)
    return _kernel_call(q_BLHh, k_BSKh, v_BSKh, segment_ids_BL, segment_ids_BL, index, windows=windows,
                        interpret=interpret)


def _context_chunks(q_BLHh, k_BSKh, v_BSKh, segment_ids_BL, index, *, windows, interpret, context: int):
    """This device's two query chunks (places i and 2c − 1 − i of the sequence) over the whole sequence's
    keys, each through the kernel whose mask starts at its chunk's place."""
    me = jax.lax.axis_index(CONTEXT_AXIS)
    n = 2 * context
    chunk = q_BLHh.shape[1] // 2

    def whole(x):  # every device's block gathered, then its chunks put back in sequence order
        x = jax.lax.all_gather(x, CONTEXT_AXIS, axis=1, tiled=True)
        held = x.reshape(x.shape[0], n, chunk, *x.shape[2:])
        order = [place for i in range(context) for place in (i, n - 1 - i)]
        return jnp.take(held, jnp.asarray(_inverse(order)), axis=1).reshape(x.shape)

    k_BSKh, v_BSKh, kv_segments_BS = whole(k_BSKh), whole(v_BSKh), whole(segment_ids_BL)
    halves = []
    for half, place in ((0, me), (1, n - 1 - me)):
        rows = slice(half * chunk, (half + 1) * chunk)
        kernel_index = index * n + place  # one kernel per (window, place)
        halves.append(_kernel_call(q_BLHh[:, rows], k_BSKh, v_BSKh, segment_ids_BL[:, rows], kv_segments_BS,
                                   kernel_index, windows=windows, interpret=interpret, places=n))
    return jnp.concatenate(halves, axis=1)


def _inverse(order: list[int]) -> list[int]:
    """The permutation that undoes `order` (position j of the result: where place j is held)."""
    out = [0] * len(order)
    for held, place in enumerate(order):
        out[place] = held
    return out


def _checked_block(length: int, q_BLHh, k_BSKh, interpret: bool) -> int:
    """The kernel's tile for query chunks of `length` tokens; refuse what the kernel cannot run."""
    if not interpret and not runs_unpartitioned():
        raise ValueError("splash attention is a Pallas kernel XLA cannot partition: run it through a placement "
                         "that splits only the batch rows (every mesh axis manual), or on one device")
    H, K = q_BLHh.shape[2], k_BSKh.shape[2]
    if H % K:
        raise ValueError(f"splash attention needs the query heads ({H}) to be a multiple of the key heads ({K})")
    block = block_size(length)
    if block is None or block_size(k_BSKh.shape[1]) is None:
        raise ValueError(f"splash attention needs the sequence length ({length}) to be a multiple of 128")
    return block


def _kernel_call(q_BLHh, k_BSKh, v_BSKh, q_segments_BL, kv_segments_BS, index, *, windows: tuple[int, ...],
                 interpret: bool, places: int = 1):
    """The kernel for (window `index // places`, query place `index % places`) on q over k, v: queries at
    place p start at p·L of the keys (`places` 1: q and k start together)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    _, L, H, h = q_BLHh.shape
    S = k_BSKh.shape[1]
    block = _checked_block(L, q_BLHh, k_BSKh, interpret)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)

    def kernel_for(window: int, offset: int):
        one = (splash.CausalMask((L, S), offset=offset) if window <= 0
               else splash.LocalMask((L, S), window_size=(window - 1, 0), offset=offset))
        return splash.make_splash_mha(splash.MultiHeadMask([one] * H), block_sizes=sizes, head_shards=1,
                                      q_seq_shards=1, interpret=interpret)

    kernels = [kernel_for(w, place * L) for w in windows for place in range(places)]
    q_BHLh = jnp.swapaxes(q_BLHh * jnp.asarray(h**-0.5, q_BLHh.dtype), 1, 2)
    k_BKSh, v_BKSh = jnp.swapaxes(k_BSKh, 1, 2), jnp.swapaxes(v_BSKh, 1, 2)

    segments = splash.SegmentIds(q=q_segments_BL, kv=kv_segments_BS)
    branches = [partial(lambda kern, *a: jax.vmap(kern)(*a), kern) for kern in kernels]
    out_BHLh = (branches[0](q_BHLh, k_BKSh, v_BKSh, segments) if len(branches) == 1
                else jax.lax.switch(index, branches, q_BHLh, k_BKSh, v_BKSh, segments))
    return jnp.swapaxes(out_BHLh, 1, 2).astype(q_BLHh.dtype)
