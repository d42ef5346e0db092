"""Merges of task vectors τ_i = x_i − base: task arithmetic, TIES, DARE and Model Stock.

Every method here needs `--base`, works tensor by tensor (expert by expert for stacked experts) and
returns `base + (merged task vector)`; with every input equal to the base, each returns the base.

- `task-arithmetic`: base + λ·Σ w_i τ_i. Streams: one input in memory at a time.
- `ties`: trim each τ_i to its `density` largest magnitudes (per tensor), elect the sign of Σ w_i τ_i
  per element, average (weighted by w_i) only the entries that agree with it, scale by λ.
- `dare-linear` / `dare-ties`: drop each entry of τ_i with probability p = 1 − density and rescale the
  survivors by 1/density (so the expected task vector is unchanged), then sum (linear) or elect and
  average (ties). The mask is `rng.random(shape, dtype=float32) < density`, drawn for the inputs in
  order from `rng = numpy.random.default_rng([seed, crc32(name), part + 1])` with `name` the canonical
  tensor name and `part` the expert index (−1 for a whole tensor): the same seed gives the same
  merge, whatever the input format.
- `model-stock`: base + t·mean(τ_i) with t = n·cos / (1 + (n−1)·cos), cos the mean pairwise cosine of
  the τ_i (clipped to [0, 1]). Streams: it keeps Σ τ_i and Σ τ_i/|τ_i| only, since the mean pairwise
  cosine of n unit vectors u_i is (|Σ u_i|² − n) / (n(n−1)).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import numpy as np

from upcycler.merge.registry import Range, Tensors, merge_method

TASK_ARITHMETIC = "https://arxiv.org/abs/2212.04089"
TIES = "https://arxiv.org/abs/2306.01708"
DARE = "https://arxiv.org/abs/2311.03099"
MODEL_STOCK = "https://arxiv.org/abs/2403.19522"

Lambda = Annotated[float, "Scale λ of the merged task vector"]
Density = Annotated[float, Range(0, 1, lo_open=True), "Fraction of each task vector kept: ties keeps the largest magnitudes, dare-* each entry with probability density, rescaled by 1/density"]


@merge_method("task-arithmetic", paper=TASK_ARITHMETIC)
def task_arithmetic(tensors: Tensors, base: np.ndarray, weights: np.ndarray | None = None, *,
                    lambda_: Lambda = 1.0) -> np.ndarray:
    """base + λ·Σ w_i (x_i − base): the inputs' task vectors added to the base."""
    acc = np.zeros_like(base)
    for x, w in zip(tensors, weights, strict=True):
        x -= base
        x *= np.float32(w)
        acc += x
    return _apply(base, acc, lambda_)


@merge_method("ties", paper=TIES, streams=False)
def ties(tensors: Tensors, base: np.ndarray, weights: np.ndarray | None = None, *,
         density: Density = 0.2, lambda_: Lambda = 1.0) -> np.ndarray:
    """TIES: trim each task vector to its largest `density` fraction, elect signs, average what agrees."""
    deltas = [_trim(np.subtract(x, base, out=x), density) for x in tensors]
    return _apply(base, _disjoint_mean(deltas, weights), lambda_)


@merge_method("dare-linear", paper=DARE)
def dare_linear(tensors: Tensors, base: np.ndarray, rng: np.random.Generator, weights: np.ndarray | None = None,
                *, density: Density = 0.5, lambda_: Lambda = 1.0) -> np.ndarray:
    """DARE + task arithmetic: drop entries with probability 1−density, rescale by 1/density, sum."""
    acc = np.zeros_like(base)
    for x, w in zip(tensors, weights, strict=True):
        delta = _drop(np.subtract(x, base, out=x), density, rng)
        delta *= np.float32(w)
        acc += delta
    return _apply(base, acc, lambda_)


@merge_method("dare-ties", paper=DARE, streams=False)
def dare_ties(tensors: Tensors, base: np.ndarray, rng: np.random.Generator, weights: np.ndarray | None = None,
              *, density: Density = 0.5, lambda_: Lambda = 1.0) -> np.ndarray:
    """DARE + TIES: drop and rescale as dare-linear, then elect signs and average what agrees."""
    deltas = [_drop(np.subtract(x, base, out=x), density, rng) for x in tensors]
    return _apply(base, _disjoint_mean(deltas, weights), lambda_)


@merge_method("model-stock", paper=MODEL_STOCK, min_inputs=2)
def model_stock(tensors: Tensors, base: np.ndarray) -> np.ndarray:
    """Model Stock: move from the base toward the inputs' mean by a ratio set by their angle."""
    total, units = np.zeros_like(base), np.zeros_like(base)
    n = nonzero = 0
    for x in tensors:
        x -= base
        total += x
        norm = float(np.linalg.norm(x))
        if norm > 0:
            x *= np.float32(1.0 / norm)
            units += x
            nonzero += 1
        n += 1
    cos = (float(np.dot(units.reshape(-1), units.reshape(-1))) - nonzero) / (n * (n - 1))
    cos = min(max(cos, 0.0), 1.0)
    t = n * cos / (1.0 + (n - 1) * cos)
    return _apply(base, total, t / n)


def _apply(base: np.ndarray, delta: np.ndarray, scale: float) -> np.ndarray:
    """base + scale·delta, reusing `delta`'s memory."""
    delta *= np.float32(scale)
    delta += base
    return delta


def _trim(delta: np.ndarray, density: float) -> np.ndarray:
    """Zero all but the round(density·size) largest-magnitude entries of `delta`, in place."""
    flat = delta.reshape(-1)
    drop = flat.size - round(density * flat.size)
    if drop > 0:
        flat[np.argpartition(np.abs(flat), drop - 1)[:drop]] = 0
    return delta


def _drop(delta: np.ndarray, density: float, rng: np.random.Generator) -> np.ndarray:
    """Keep each entry with probability `density` and rescale it by 1/density, in place."""
    delta *= rng.random(delta.shape, dtype=np.float32) < density
    delta *= np.float32(1.0 / density)
    return delta


def _disjoint_mean(deltas: Sequence[np.ndarray], weights: np.ndarray) -> np.ndarray:
    """Per element, the w-weighted mean of the non-zero deltas whose sign is that of Σ w_i δ_i (else 0)."""
    mass = np.zeros_like(deltas[0])
    for d, w in zip(deltas, weights, strict=True):
        mass += np.float32(w) * d
    elected = np.sign(mass)
    num, den = np.zeros_like(mass), np.zeros_like(mass)
    for d, w in zip(deltas, weights, strict=True):
        agree = (np.sign(d) == elected) & (d != 0)
        num += np.where(agree, np.float32(w) * d, np.float32(0))
        den += np.where(agree, np.float32(w), np.float32(0))
    return np.divide(num, den, out=np.zeros_like(num), where=den != 0)
