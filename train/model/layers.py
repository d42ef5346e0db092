"""Transformer building blocks as pure functions: RMSNorm, RoPE, attention masks, GQA attention, SwiGLU.

Every function takes arrays and returns arrays; none holds parameters or knows the mesh. Weights arrive in the
canonical Hugging Face `[out, in]` orientation (`upcycler.layout`) and are contracted as such.

Shape suffixes follow the dimension key of `upcycler.train.model` (here: B, L, S, D, H, K, G, N, h, R,
r, F, V, and O, I for a linear layer's output and input width).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from upcycler.spec import ModelSpec
from upcycler.train.model.remat import FFN_HIDDEN

MASKED = float(np.finfo(np.float32).min)  # finite, so a row with nothing visible cannot become NaN
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """`w · x / rms(x)` over the last axis; the statistics in fp32, the result in `x.dtype`."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return w.astype(x.dtype) * normed.astype(x.dtype)


# --- rotary position embeddings ------------------------------------------------------------------
def rotary_dim(spec: ModelSpec) -> int:
    """R: how many leading dims of each head rotate (`partial_rotary_factor` × head dim)."""
    return int(spec.head_dim * spec.partial_rotary_factor)


def rope_frequencies(spec: ModelSpec) -> tuple[np.ndarray, float]:
    """(inverse frequencies [R/2] in fp32, attention factor applied to cos and sin).

    Supports the default RoPE and the `linear`, `llama3` and `yarn` scalings, with partial rotary.
    """
    dim = rotary_dim(spec)
    base = spec.rope_theta
    inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    scaling = spec.rope_scaling_dict or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq.astype(np.float32), 1.0
    if kind == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32), 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(dim, base, spec, scaling)
    raise ValueError(f"rope scaling {kind!r} is not supported (default, linear, llama3, yarn)")


def _llama3(inv_freq: np.ndarray, s: dict[str, Any]) -> np.ndarray:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(dim: int, base: float, spec: ModelSpec, s: dict[str, Any]) -> tuple[np.ndarray, float]:
    old_len = s["original_max_position_embeddings"]
    factor = s.get("factor") or spec.max_position_embeddings / old_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = s.get("attention_factor")
    if attn is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(fast), correction_dim(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    keep = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq.astype(np.float32), float(attn)


def rope_tables(positions_BL: jax.Array, inv_freq: np.ndarray, factor: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin [B, L, R] in fp32 for integer positions."""
    freqs_BLr = positions_BL.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    angles_BLR = jnp.concatenate([freqs_BLr, freqs_BLr], axis=-1)
    return jnp.cos(angles_BLR) * factor, jnp.sin(angles_BLR) * factor


def apply_rope(x_BLNh: jax.Array, cos_BLR: jax.Array, sin_BLR: jax.Array) -> jax.Array:
    """Rotate the first R dims of every head (rotate-half convention); the rest pass through."""
    r = cos_BLR.shape[-1]
    rot, rest = x_BLNh[..., :r].astype(jnp.float32), x_BLNh[..., r:]
    x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    out = rot * cos_BLR[:, :, None, :] + rotated * sin_BLR[:, :, None, :]
    return jnp.concatenate([out.astype(x_BLNh.dtype), rest], axis=-1)


# --- masks and attention -----------------------------------------------------------------------------
def attention_mask(segment_ids_BL: jax.Array | None, batch: int, length: int,
                   token_index_BL: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(visible_BLS, distance): causal ∧ same segment, and query index − key index for sliding windows.

    Segment ids mark packed documents (and padding, with its own id); a token sees only earlier tokens of
    its own segment, and always itself, so no row is empty. `token_index_BL` gives each token's index in
    its sequence when the tokens are held in another order (context parallelism's balanced chunks): the
    masks follow those indices, so the same keys are visible, and the distance is [B, L, S]; without it
    tokens are in sequence order and the distance is [L, S].
    """
    if token_index_BL is None:
        idx = jnp.arange(length)
        distance = idx[:, None] - idx[None, :]
        visible_BLS = jnp.broadcast_to(distance >= 0, (batch, length, length))
    else:
        distance = token_index_BL[:, :, None] - token_index_BL[:, None, :]
        visible_BLS = distance >= 0
    if segment_ids_BL is not None:
        visible_BLS = visible_BLS & (segment_ids_BL[:, :, None] == segment_ids_BL[:, None, :])
    return visible_BLS, distance


def window_mask(visible_BLS: jax.Array, distance: jax.Array, window: jax.Array) -> jax.Array:
    """Restrict to keys less than `window` positions back (`distance` [L, S] or [B, L, S]); `window` ≤ 0
    means no window."""
    inside = (window <= 0) | (distance < window)
    return visible_BLS & inside


def attention(
    q_BLHh: jax.Array,
    k_BSKh: jax.Array,
    v_BSKh: jax.Array,
    visible_BLS: jax.Array | None,
    *,
    impl: str = "einsum",
    chunk: int = 0,
) -> jax.Array:
    """Grouped-query softmax attention, scaled by h^-½; scores and softmax in fp32. Returns [B, L, H, h].

    `visible_BLS` None means plain causal attention (which lets "dot_product" use a fused kernel).
    "chunked" computes the einsum attention over blocks of `chunk` queries (L a multiple of it), each block
    recomputed in the backward pass: equal to "einsum", with the [L, S] scores of one block alive at a time.
    """
    if impl == "chunked":
        return _chunked_attention(q_BLHh, k_BSKh, v_BSKh, visible_BLS, chunk)
    if impl == "dot_product":
        if visible_BLS is None:
            return jax.nn.dot_product_attention(q_BLHh, k_BSKh, v_BSKh, is_causal=True)
        return jax.nn.dot_product_attention(q_BLHh, k_BSKh, v_BSKh, mask=visible_BLS[:, None])
    if impl != "einsum":
        raise ValueError(f"attention impl must be einsum or dot_product, not {impl!r}")
    if visible_BLS is None:
        L, S = q_BLHh.shape[1], k_BSKh.shape[1]
        visible_BLS = (jnp.arange(L)[:, None] >= jnp.arange(S)[None, :])[None]
    B, L, H, h = q_BLHh.shape
    K = k_BSKh.shape[2]
    q_BLKGh = q_BLHh.reshape(B, L, K, H // K, h)
    scores_BKGLS = jnp.einsum("blkgh,bskh->bkgls", q_BLKGh, k_BSKh, preferred_element_type=jnp.float32)
    scores_BKGLS = jnp.where(visible_BLS[:, None, None], scores_BKGLS * (h**-0.5), MASKED)
    probs_BKGLS = jax.nn.softmax(scores_BKGLS, axis=-1).astype(v_BSKh.dtype)
    out_BLKGh = jnp.einsum("bkgls,bskh->blkgh", probs_BKGLS, v_BSKh)
    return out_BLKGh.reshape(B, L, H, h)


def _chunked_attention(q_BLHh, k_BSKh, v_BSKh, visible_BLS, chunk: int) -> jax.Array:
    B, L, H, h = q_BLHh.shape
    S = k_BSKh.shape[1]
    if chunk <= 0 or chunk >= L:
        return attention(q_BLHh, k_BSKh, v_BSKh, visible_BLS)
    if L % chunk:
        raise ValueError(f"chunked attention wants the length {L} to be a multiple of the chunk {chunk}")
    n = L // chunk
    q_nBcHh = jnp.moveaxis(q_BLHh.reshape(B, n, chunk, H, h), 1, 0)
    if visible_BLS is None:  # causal: block i holds queries i·chunk … i·chunk + chunk − 1
        rows_nc = jnp.arange(L).reshape(n, chunk)
        visible_nBcS = (rows_nc[:, :, None] >= jnp.arange(S)[None, None, :])[:, None]
    else:
        visible_nBcS = jnp.moveaxis(visible_BLS.reshape(visible_BLS.shape[0], n, chunk, S), 1, 0)

    @jax.checkpoint
    def block(args):
        q_BcHh, visible_BcS = args
        return attention(q_BcHh, k_BSKh, v_BSKh, visible_BcS)

    out_nBcHh = jax.lax.map(block, (q_nBcHh, visible_nBcS))
    return jnp.moveaxis(out_nBcHh, 0, 1).reshape(B, L, H, h)


# --- MLP -------------------------------------------------------------------------------------------------
def linear(x: jax.Array, w_OI: jax.Array, b_O: jax.Array | None = None) -> jax.Array:
    """`x @ wᵀ (+ b)` for a weight stored `[out, in]`."""
    y = jnp.einsum("...i,oi->...o", x, w_OI.astype(x.dtype))
    return y if b_O is None else y + b_O.astype(y.dtype)


def gated_mlp(x_BLD: jax.Array, p: dict[str, jax.Array], act: str = "silu") -> jax.Array:
    """`down(act(gate(x)) ⊙ up(x))` with optional biases (`gate_bias`, `up_bias`, `down_bias`)."""
    gate_BLF = checkpoint_name(linear(x_BLD, p["gate_proj"], p.get("gate_bias")), FFN_HIDDEN)
    up_BLF = checkpoint_name(linear(x_BLD, p["up_proj"], p.get("up_bias")), FFN_HIDDEN)
    return linear(ACTIVATIONS[act](gate_BLF) * up_BLF, p["down_proj"], p.get("down_bias"))
