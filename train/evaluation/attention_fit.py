"""Fit the q/k norms a target family adds to a dense model's attention, and measure how far the result is.

`dense-to-moe --target qwen3_moe --allow-approximate` from a parent without q/k norms (Llama, Mistral,
SmolLM2) must insert them: every head's query and key are then divided by their own RMS over the head
before RoPE, which no choice of the norms' weights undoes exactly (the weights are per channel, shared by
the heads, and the RMS changes from token to token). With unit weights the model is unusable (on the real
SmolLM2-135M-Instruct, 28% top-1 agreement with its parent on held-out text). `fit_qk_norms` chooses the
weights from calibration data instead, one layer at a time, from the first:

- the layer's queries and keys before the norm, q and k, are computed by the *approximated* model (biases
  it drops are gone) on the calibration tokens as they reach this layer of it (so each layer makes up for
  what the earlier ones changed);
- the weights start at the per-channel least-squares fit of q ≈ w ⊙ q / rms(q) (w_j = Σ q_j²/r ÷ Σ q_j²/r²,
  summed over tokens and heads; the same for k), then `STEPS` steps of Adam on their logarithms (they stay
  positive) bring the layer's attention output (per head, before o_proj) close to the parent layer's on
  the same inputs, in relative mean squared error. Most of what is lost is the keys': a head's attention
  sink (the first token) has a key several times shorter than the others, which the norm lengthens.

`agreement(reference, approximated, ids)` runs both models on held-out tokens and returns the mean
KL(reference ‖ approximated) per token and the share of tokens whose top-1 prediction is the same.
`AttentionFit` is the service `dense-to-moe` borrows for both (a `transforms.registry.TransformContext` field), with the
tokens: calibration windows of every training source of a prepared directory, held-out windows from the
sources' `NAME.heldout` (else from between the calibration windows).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from upcycler.errors import UpcyclerError
from upcycler.spec import LIMITS_ENV, ModelSpec, limits_on
from upcycler.train.data.format import HELDOUT_SUFFIX
from upcycler.train.data.sources import prepared_names
from upcycler.train.evaluation.calibration import (
    attention_bytes,
    calibration_tokens,
    checked_tokens,
    chunk_for,
)
from upcycler.train.evaluation.layerwise import FP32, hidden_trace, layer_params
from upcycler.train.model import layers as nn
from upcycler.train.model.params import layer_kind
from upcycler.train.model.transformer import attention_of, layer_windows, one_layer
from upcycler.untrusted import shown_path

STEPS = 100  # Adam steps per layer
LEARNING_RATE = 0.1  # on the log weights
FIT_BYTES = 2 * 1024**3  # bound on one layer's fit: the attention of every calibration sequence at once


@dataclass(frozen=True)
class Tokens:
    """Calibration and held-out windows [n, L] int32, and where the held-out ones come from (for people)."""

    calibration: np.ndarray
    heldout: np.ndarray
    heldout_from: str


@dataclass(frozen=True)
class AttentionFit:
    """The service `dense-to-moe` borrows to fit inserted q/k norms and measure an approximate attention;
    `measures` False (--dry-run) checks the calibration data and computes nothing."""

    measures: bool = True

    def tokens(self, data: Path, model: Any, sequences: int, length: int) -> Tokens:
        """`sequences` windows of `length` tokens spread over the training sources of `data` (prepared with
        the model's tokenizer), and as many held-out ones; refused before any computation when missing."""
        data = Path(data)
        if not data.is_dir():
            kind = "not a directory" if data.exists() else "no such directory"
            raise UpcyclerError(f"--calibration {shown_path(data)}: {kind}; pass a directory `upcycle "
                                "prepare-data --out` wrote with the source model's tokenizer")
        names = [n for n in prepared_names(data) if not n.endswith(HELDOUT_SUFFIX)]
        if not names:
            raise UpcyclerError(f"--calibration {shown_path(data)}: no prepared source; run `upcycle prepare-data "
                                f"--source NAME=FILES --out {shown_path(data)}`")
        if length > model.spec.max_position_embeddings:
            raise UpcyclerError(f"--calibration-length {length} is longer than the model's context "
                                f"(max_position_embeddings {model.spec.max_position_embeddings:,})")
        if limits_on() and attention_bytes(model.spec, length) * sequences > FIT_BYTES:
            most = FIT_BYTES // attention_bytes(model.spec, length)
            fix = (f"--calibration-sequences {most} or less" if most else
                   f"--calibration-length {int((FIT_BYTES / attention_bytes(model.spec, 1)) ** 0.5)} or less")
            raise UpcyclerError(f"--calibration-sequences {sequences} × --calibration-length {length}: fitting a "
                                f"layer's attention on them takes over {FIT_BYTES:,} bytes; use {fix} "
                                f"(or set {LIMITS_ENV}=off)")
        per = [sequences // len(names) + (k < sequences % len(names)) for k in range(len(names))]
        calibration, heldout, held_names = [], [], []
        for name, count in zip(names, per, strict=True):
            if count == 0:
                continue
            held = name + HELDOUT_SUFFIX
            if held in prepared_names(data):
                calibration.append(calibration_tokens(data, name, count, length, model))
                heldout.append(calibration_tokens(data, held, count, length, model))
                held_names.append(held)
            else:
                both = _interleaved(data, name, count, length, model)
                calibration.append(both[0::2])
                heldout.append(both[1::2])
                held_names.append(f"{name} (between the calibration windows)")
        return Tokens(np.concatenate(calibration), np.concatenate(heldout), ", ".join(held_names))

    def fit_qk_norms(self, reference: Any, approximated: Any, ids_BL: np.ndarray) -> dict[str, np.ndarray]:
        """{canonical name: weight [head_dim] float32} of every layer's q_norm and k_norm (module docstring)."""
        return fit_qk_norms(reference, approximated, ids_BL)

    def agreement(self, reference: Any, approximated: Any, ids_BL: np.ndarray) -> tuple[float, float]:
        return agreement(reference, approximated, ids_BL)


def _interleaved(data: Path, name: str, count: int, length: int, model: Any) -> np.ndarray:
    """2·count evenly spaced windows of source `name` that do not overlap (calibration and held-out alternate)."""
    tokens = checked_tokens(data, name, length, model).tokens
    if len(tokens) < 2 * count * length:
        raise UpcyclerError(f"{shown_path(data)}: source {name} has {len(tokens):,} tokens, fewer than the "
                            f"{2 * count * length:,} that {count} calibration and {count} held-out windows of "
                            f"{length} need; prepare more data, a held-out split ({name}{HELDOUT_SUFFIX}), or "
                            "lower --calibration-sequences")
    return calibration_tokens(data, name, 2 * count, length, model)


def fit_qk_norms(reference: Any, approximated: Any, ids_BL: np.ndarray) -> dict[str, np.ndarray]:
    """The q/k norm weights of every layer of `approximated` (`reference` with q/k norms inserted, and maybe
    biases dropped) fitted on `ids_BL` so that each layer's attention output is `reference`'s on its inputs."""
    spec, normed = reference.spec, approximated.spec
    windows = layer_windows(spec)
    x = jnp.asarray(reference.tensors["embed"].load()[ids_BL].astype(np.float32))
    out: dict[str, np.ndarray] = {}
    with jax.default_matmul_precision("highest"):
        for i in range(spec.num_layers):
            want = _attention_jit(*_raw_qkv(x, _fp32(layer_params(spec, reference.tensors, i)), spec), None, spec,
                                  windows[i])
            p = _fp32(layer_params(normed, approximated.tensors, i))
            q, k, v = _raw_qkv(x, p, normed)
            log_w = jnp.log(jnp.stack([_least_squares(q, spec), _least_squares(k, spec)]))
            w_q, w_k = np.exp(np.asarray(_fit(log_w, q, k, v, want, spec, windows[i]))).astype(np.float32)
            out[f"layers.{i}.attn.q_norm"], out[f"layers.{i}.attn.k_norm"] = w_q, w_k
            fitted = {**p, "attn": {**p["attn"], "q_norm": jnp.asarray(w_q), "k_norm": jnp.asarray(w_k)}}
            x = _layer(x, fitted, normed, layer_kind(normed, i), windows[i])
    return out


def _fp32(params: dict) -> dict:
    return jax.tree.map(lambda w: w.astype(jnp.float32), params)


def agreement(reference: Any, approximated: Any, ids_BL: np.ndarray) -> tuple[float, float]:
    """(mean KL(reference ‖ approximated) per token in nats, share of tokens with the same top-1), both
    models run in fp32 one layer at a time, a few sequences at a time."""
    chunk = max(1, min(chunk_for(reference.spec, ids_BL.shape[1]), (256 * 1024**2) // (4 * ids_BL.shape[1]
                                                                                         * reference.spec.vocab_size)))
    kl, same = 0.0, 0
    for lo in range(0, len(ids_BL), chunk):
        ids = ids_BL[lo:lo + chunk]
        want, got = (_last(hidden_trace(m, ids)) for m in (reference, approximated))
        kl += float(_kl_sum(want, got))
        same += int((want.argmax(-1) == got.argmax(-1)).sum())
    return kl / ids_BL.size, same / ids_BL.size


def _last(trace) -> np.ndarray:
    last = None
    for last in trace:
        pass
    return last[0]


@jax.jit
def _kl_sum(want_BLV, got_BLV):
    p, q = jax.nn.log_softmax(want_BLV, -1), jax.nn.log_softmax(got_BLV, -1)
    return jnp.sum(jnp.exp(p) * (p - q))


def _least_squares(v: jax.Array, spec: ModelSpec) -> jax.Array:
    """Per channel, the w minimising Σ (w·v/rms(v) − v)² over tokens and heads."""
    v = v.reshape(-1, v.shape[-1])
    r = jnp.sqrt(jnp.mean(v * v, -1, keepdims=True) + spec.rms_norm_eps)
    return jnp.sum(v * v / r, 0) / jnp.maximum(jnp.sum(v * v / (r * r), 0), 1e-30)


@partial(jax.jit, static_argnames=("spec",))
def _raw_qkv(x_BLD, p, spec: ModelSpec):
    """The layer's queries, keys and values before any q/k norm and RoPE."""
    B, L, _ = x_BLD.shape
    a, h_BLD = p["attn"], nn.rms_norm(x_BLD, p["attn_norm"], spec.rms_norm_eps)
    return (nn.linear(h_BLD, a["q_proj"], a.get("q_bias")).reshape(B, L, spec.num_heads, spec.head_dim),
            nn.linear(h_BLD, a["k_proj"], a.get("k_bias")).reshape(B, L, spec.num_kv_heads, spec.head_dim),
            nn.linear(h_BLD, a["v_proj"], a.get("v_bias")).reshape(B, L, spec.num_kv_heads, spec.head_dim))


def _attention(q, k, v, w, spec: ModelSpec, window: int):
    """Per-head attention output [B, L, H, h] of raw q, k, v, with q/k norms of weights w = (w_q, w_k) or none."""
    if w is not None:
        q, k = nn.rms_norm(q, w[0], spec.rms_norm_eps), nn.rms_norm(k, w[1], spec.rms_norm_eps)
    return attention_of(q, k, v, spec, window=window)


_attention_jit = jax.jit(_attention, static_argnames=("spec", "window"))
_OPTIMIZER = optax.adam(LEARNING_RATE)


@partial(jax.jit, static_argnames=("spec", "window"))
def _fit(log_w, q_BLHh, k_BLKh, v_BLKh, want_BLHh, spec: ModelSpec, window: int):
    """`STEPS` Adam steps on the log weights from `log_w`, minimising the relative mean squared error of the
    layer's attention output against `want` (the fitted weights' logarithms, [2, h]).

    The loop runs as one program on `_NormedAttention`, which computes `_attention` with the weights as its
    only varying input: the unit-weight norms and the rotations are done once, not once per step."""
    attend = _NormedAttention.of(q_BLHh, k_BLKh, v_BLKh, spec, window)
    want = heads_first(want_BLHh, q_BLHh.shape[2] // k_BLKh.shape[2])
    scale = jnp.mean(want ** 2)

    def step(_, carry):
        log_w, state = carry
        grads = jax.grad(lambda lw: jnp.mean((attend(jnp.exp(lw)) - want) ** 2) / scale)(log_w)
        updates, state = _OPTIMIZER.update(grads, state)
        return optax.apply_updates(log_w, updates), state

    return jax.lax.fori_loop(0, STEPS, step, (log_w, _OPTIMIZER.init(log_w)))[0]


def heads_first(x_BLHh: jax.Array, groups: int) -> jax.Array:
    """[B, L, H, h] → [B, K, G·L, h] for G = `groups` query heads per kv head (head k·G + g at row g·L + i)."""
    B, L, H, h = x_BLHh.shape
    return x_BLHh.reshape(B, L, H // groups, groups, h).transpose(0, 2, 3, 1, 4).reshape(B, H // groups,
                                                                                          groups * L, h)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class _NormedAttention:
    """`_attention(q, k, v, w, spec, window)` as a function of w alone, laid out heads first ([B, K, G·L, h]
    queries against [B, K, L, h] keys: one batched matmul per kv head, which CPUs run several times faster
    than the model's [B, L, H, h] einsums).

    RoPE is linear and the norm's weight scales channels before it, so with x̂ = x / rms(x) and
    swap(w) = (w[R/2:R], w[:R/2], w[R:]): rope(w ⊙ x̂) = w ⊙ (x̂ ⊙ cos) + swap(w) ⊙ (rotate_half(x̂) ⊙ sin),
    where both bracketed terms are fixed (cos = 1 and sin = 0 on the dims that do not rotate)."""

    q_cos: jax.Array  # [B, K, G·L, h], each is x̂ ⊙ cos or rotate_half(x̂) ⊙ sin
    q_sin: jax.Array
    k_cos: jax.Array  # [B, K, L, h]
    k_sin: jax.Array
    v: jax.Array  # [B, K, L, h]
    visible: jax.Array  # [G·L, L]
    rotary: int = field(metadata={"static": True})  # R

    @classmethod
    def of(cls, q_BLHh, k_BLKh, v_BLKh, spec: ModelSpec, window: int) -> _NormedAttention:
        B, L, H, h = q_BLHh.shape
        G = H // k_BLKh.shape[2]
        inv_freq, factor = nn.rope_frequencies(spec)
        cos_BLR, sin_BLR = nn.rope_tables(jnp.broadcast_to(jnp.arange(L), (B, L)), inv_freq, factor)
        r = cos_BLR.shape[-1]
        ones = jnp.ones((B, L, h - r), jnp.float32)
        cos, sin = (jnp.concatenate([t, rest], -1)[:, :, None] for t, rest in ((cos_BLR, ones), (sin_BLR, 0 * ones)))

        def parts(x):
            x = nn.rms_norm(x.astype(jnp.float32), jnp.ones((h,), jnp.float32), spec.rms_norm_eps)
            return x * cos, jnp.concatenate([-x[..., r // 2:r], x[..., :r // 2], x[..., r:]], -1) * sin

        visible_BLS, distance_LS = nn.attention_mask(None, B, L)
        if window:
            visible_BLS = nn.window_mask(visible_BLS, distance_LS, window)
        q_cos, q_sin = (heads_first(part, G) for part in parts(q_BLHh))
        k_cos, k_sin = (jnp.swapaxes(part, 1, 2) for part in parts(k_BLKh))
        return cls(q_cos, q_sin, k_cos, k_sin, jnp.swapaxes(v_BLKh, 1, 2), jnp.tile(visible_BLS[0], (G, 1)), r)

    def __call__(self, w: jax.Array) -> jax.Array:
        """The attention output [B, K, G·L, h] with q/k norm weights w = (w_q, w_k)."""
        r = self.rotary
        swap = lambda w: jnp.concatenate([w[r // 2:r], w[:r // 2], w[r:]])
        q = w[0] * self.q_cos + swap(w[0]) * self.q_sin
        k = w[1] * self.k_cos + swap(w[1]) * self.k_sin
        h = q.shape[-1]
        scores = jnp.einsum("bkmh,bksh->bkms", q, k, preferred_element_type=jnp.float32)
        scores = jnp.where(self.visible, scores * (h**-0.5), nn.MASKED)
        return jnp.einsum("bkms,bksh->bkmh", jax.nn.softmax(scores, -1), self.v)


@partial(jax.jit, static_argnames=("spec", "kind", "window"))
def _layer(x_BLD, p, spec: ModelSpec, kind: str, window: int):
    return one_layer(x_BLD, p, spec, FP32, kind=kind, window=window)
