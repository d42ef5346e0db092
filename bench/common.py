"""Shared pieces of the benchmarks: synthetic real-shaped checkpoints, a cold page cache, interleaved timing."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import numpy as np

from upcycler.io.checkpoint import Checkpoint
from upcycler.io.hf_write import write_hf
from upcycler.layout import declare_params
from upcycler.spec import ModelSpec
from upcycler.tensors import BF16, LazyTensor, TensorMap

POOL_ELEMENTS = 32 * 1024 * 1024  # 64 MiB of bf16 values, reused (rotated) to fill every tensor


def write_synthetic(spec: ModelSpec, out: Path, seed: int = 0) -> None:
    """A bf16 HF checkpoint of `spec` with random values |x| in [2^-7, 2^-6) (no NaN, no subnormals).

    Fast: one random pool, rotated by a different offset for each tensor, instead of a random draw per value.
    """
    bits = np.random.default_rng(seed).integers(0, 1 << 16, size=POOL_ELEMENTS, dtype=np.uint16)
    pool = ((bits & 0x807F) | 0x3C00).view(BF16)  # sign and mantissa random, exponent fixed

    def filled(shape: tuple[int, ...], offset: int) -> LazyTensor:
        def load() -> np.ndarray:
            n = int(np.prod(shape))
            flat = np.empty(n, BF16)
            done = 0
            while done < n:
                start = (offset + done) % POOL_ELEMENTS
                take = min(n - done, POOL_ELEMENTS - start)
                flat[done:done + take] = pool[start:start + take]
                done += take
            return flat.reshape(shape)

        return LazyTensor(shape, BF16, load)

    tensors = TensorMap({d.name: filled(d.shape, 7919 * k) for k, d in enumerate(declare_params(spec))})
    write_hf(Checkpoint(spec, tensors), out, progress=False)


def evict(root: Path) -> None:
    """Drop the (clean) files under `root` from the page cache, so the next reader goes to disk."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def time_round_robin(calls: dict[str, tuple], repeats: int) -> dict[str, dict[str, float]]:
    """Median wall and CPU seconds per call: one warm-up each, then `repeats` rounds over all calls."""
    import jax

    for fn, params in calls.values():
        jax.block_until_ready(fn(*params))
    wall: dict[str, list[float]] = {name: [] for name in calls}
    cpu: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, (fn, params) in calls.items():
            w0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn(*params))
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - w0)
    return {
        name: {"wall": statistics.median(wall[name]), "cpu": statistics.median(cpu[name])} for name in calls
    }
