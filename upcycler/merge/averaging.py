"""Weighted averages of checkpoints (PMA-style pretraining averages and model soups), streamed.

Every method here only chooses weights; `weighted_average` does the work for all of them with one fp32
accumulator and one input in memory at a time, so merging 100 checkpoints takes the memory of merging 2.
Inputs are ordered oldest → newest (the order given; a run directory expands in step order).

- `sma`: w_i = 1/n (PMA, Eq. 3).
- `ema`: w_i ∝ α(1−α)^(n−1−i), normalised to sum 1: the newest checkpoint (i = n−1) weighs most, each
  older one (1−α) times less. This is the EMA recursion M ← α·M_i + (1−α)·M of PMA Eq. 4 with its
  weights renormalised over the n checkpoints at hand (the recursion seeded with M_0 would give the
  oldest checkpoint weight (1−α)^(n−1) instead of α(1−α)^(n−1)).
- `wma`: w_i ∝ i+1, i.e. 1, 2, …, n (PMA, Eq. 5).
- `minus-sqrt`: w_i = g(i/n) − g((i+1)/n) with the decay g(x) = 1 − √x, i.e. √((i+1)/n) − √(i/n) (WSM):
  the merge that emulates a 1 − √x learning-rate decay over the window; the oldest checkpoint weighs most.
- `linear`: explicit weights (model soups); they must sum to 1 unless the caller opts out of that check.

Papers: PMA, https://arxiv.org/abs/2505.12082; WSM, https://arxiv.org/abs/2507.17634; model soups,
https://arxiv.org/abs/2203.05482.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Annotated

import numpy as np

from upcycler.merge.registry import Range, averaging

PMA = "https://arxiv.org/abs/2505.12082"
SOUPS = "https://arxiv.org/abs/2203.05482"
WSM = "https://arxiv.org/abs/2507.17634"
_CHUNK = 1 << 17  # elements per step of the blend: 512 KiB of fp32 stays in cache
_WORKERS = max(1, min(4, os.cpu_count() or 1))
_POOL = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="merge")


@averaging("sma", paper=PMA)
def sma(n: int) -> np.ndarray:
    """Simple moving average: every checkpoint weighs 1/n."""
    return np.full(n, 1.0 / n)


@averaging("ema", paper=PMA)
def ema(n: int, *, alpha: Annotated[float, Range(0, 1, lo_open=True), "EMA factor α; the newest checkpoint weighs most"] = 0.2,
        ) -> np.ndarray:
    """Exponential moving average: w_i ∝ α(1−α)^(n−1−i) over checkpoints oldest → newest, normalised."""
    w = alpha * (1.0 - alpha) ** np.arange(n - 1, -1, -1, dtype=np.float64)
    return w / w.sum()


@averaging("wma", paper=PMA)
def wma(n: int) -> np.ndarray:
    """Weighted moving average: w_i ∝ i+1, so the newest checkpoint weighs n times the oldest."""
    w = np.arange(1, n + 1, dtype=np.float64)
    return w / w.sum()


@averaging("minus-sqrt", paper=WSM)
def minus_sqrt(n: int) -> np.ndarray:
    """WSM merge emulating a 1 − √x learning-rate decay: w_i = √((i+1)/n) − √(i/n); the oldest weighs most.

    WSM ("decay to merge", https://arxiv.org/abs/2507.17634) turns a decay schedule g, g(0) = 1 and
    g(1) = 0, into merge weights over checkpoints θ_0 … θ_{n−1} (oldest → newest): with
    w_i = g(i/n) − g((i+1)/n), Σ w_i·θ_i = θ_0 + Σ_k g(k/n)·(θ_k − θ_{k−1}), i.e. each update of the
    window applied at the fraction g(k/n) of the learning rate it was taken with. Here g(x) = 1 − √x
    (the `minus-sqrt` style of Megatron-LM's tools/checkpoint/weighted_merge.py), so
    w_i = √((i+1)/n) − √(i/n) = 1 / (√n·(√i + √(i+1))):
    all positive, strictly decreasing, and summing to g(0) − g(1) = 1 (telescoping). The oldest
    checkpoint weighs 1/√n, the newest 1 − √(1 − 1/n). n = 1 gives [1].
    """
    i = np.arange(n, dtype=np.float64)
    w = 1.0 / (math.sqrt(n) * (np.sqrt(i) + np.sqrt(i + 1.0)))  # the difference of roots, without cancellation
    return w / w.sum()


@averaging("linear", paper=SOUPS)
def linear(n: int, weights: np.ndarray) -> np.ndarray:
    """Weighted average with explicit --weights (a model soup); they must sum to 1 unless --no-normalize."""
    return np.asarray(weights, dtype=np.float64)


def weighted_average(arrays: Iterable[np.ndarray], weights: Sequence[float],
                     dtype: np.dtype | None = None) -> np.ndarray:
    """Σ w_i·x_i accumulated in fp32 and returned as `dtype` (default fp32), consuming `arrays` one at a
    time (any float dtype); inputs of weight 0 are passed over (the caller can avoid reading them).

    With non-negative weights this is a running weighted mean, acc ← acc − (w_i/W_i)·(acc − x_i) with
    W_i the weight seen so far, scaled by Σw at the end; so averaging identical fp32 inputs returns the
    input bit for bit (signed zeros included), whatever n. Negative weights fall back to a plain running
    sum. The last input's pass writes `dtype` directly: no second pass over the accumulator.
    """
    pairs = [(k, float(w)) for k, w in enumerate(weights) if w != 0]
    if not pairs:
        raise ValueError("weighted_average needs at least one non-zero weight")
    total = math.fsum(w for _, w in pairs)
    running = total > 0 and all(w >= 0 for _, w in pairs)
    scale = np.float32(total) if running else np.float32(1)
    first, last = pairs[0][0], pairs[-1][0]
    acc: np.ndarray | None = None
    seen = 0.0
    inputs = iter(arrays)  # next() by hand: zip() would keep the previous array alive in its result tuple
    for k, w in enumerate(weights):
        x = next(inputs)
        if w == 0:
            del x
            continue
        seen += w
        out = np.empty(x.shape, dtype or np.float32) if k == last else None
        if k == first and out is None:
            acc = np.empty(x.shape, np.float32)
        step = partial(_step, c=np.float32(w / seen if running else w), scale=scale, running=running,
                       first=k == first)
        _over_chunks(step, x, acc, out)
        del x  # before the next input is requested, so at most two inputs are ever alive
        if out is not None:
            return out
    raise AssertionError("the last non-zero weight returns")


def _step(x: np.ndarray, acc: np.ndarray | None, out: np.ndarray | None, d: np.ndarray, *, c: np.float32,
          scale: np.float32, running: bool, first: bool) -> None:
    """One input on one chunk (`d` is fp32 scratch): acc ← acc − c·(acc − x) (running mean) or
    acc + c·x (sum), the first input starting the accumulator; into acc, or times `scale` into out."""
    d[...] = x
    if not first and running:
        np.subtract(acc, d, out=d)
        d *= c
        np.subtract(acc, d, out=d)
    elif not first:
        d *= c
        d += acc
    elif not running:
        d *= c
    if out is None:
        acc[...] = d
        return
    if scale != 1:
        d *= scale
    out[...] = d


def _over_chunks(fn: Callable[..., None], *arrays: np.ndarray | None) -> None:
    """`fn(*chunks, scratch)` over cache-sized chunks of the flattened arrays (None stays None), split
    between worker threads; `scratch` is an fp32 array of the chunk's size, one per thread."""
    flat = [a.reshape(-1) if a is not None else None for a in arrays]
    size = flat[0].size
    bounds = list(range(0, size, _CHUNK))

    def run(starts: Sequence[int]) -> None:
        scratch = np.empty(min(_CHUNK, size), np.float32)
        for s in starts:
            chunks = [a[s:s + _CHUNK] if a is not None else None for a in flat]
            fn(*chunks, scratch[:min(_CHUNK, size - s)])

    if len(bounds) < 2 * _WORKERS:
        run(bounds)
        return
    step = -(-len(bounds) // _WORKERS)
    list(_POOL.map(run, [bounds[i:i + step] for i in range(0, len(bounds), step)]))
