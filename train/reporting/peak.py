"""The per-device peak FLOP/s that MFU is measured against, and what that peak is.

In order: `metrics.peak_flops` when set; else the chip's published dense bf16 peak from the table of
`upcycler.hardware` (divided among the devices that share a chip); else, on devices the table
does not know (a host CPU), a float32 matmul measured once at start on every device at once, divided by
the device count: MFU is then the share of what this host's matmul reaches, said so in the progress line.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MEASURE_SIZE = 512  # the measured matmul: [n, n] @ [n, n] per device, float32
MEASURE_REPEATS = 5


@dataclass(frozen=True)
class Peak:
    """FLOP/s per device and where the figure comes from (shown to the user)."""

    flops: float
    source: str

    def describe(self) -> str:
        return f"MFU against {self.flops / 1e12:.3g} TFLOP/s per device ({self.source})"


def peak_per_device(configured: float | None, devices: Sequence[Any]) -> Peak:
    """The peak of `devices` (all of one kind); see the module docstring for the order."""
    from upcycler.hardware import for_devices

    if configured:
        return Peak(float(configured), "metrics.peak_flops")
    chip = for_devices(devices)
    if chip is not None:
        return Peak(chip.peak_bf16_flops, f"{chip.name} published bf16 peak")
    import jax

    kind = devices[0].device_kind if devices else "unknown"
    return Peak(measured_matmul_flops(jax.local_devices()),
                f"{kind}: a float32 matmul measured at start, no published peak")


def measured_matmul_flops(devices: Sequence[Any]) -> float:
    """FLOP/s per device of an [n, n] float32 matmul run on all `devices` at once (best of a few)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    n = MEASURE_SIZE
    mesh = Mesh(np.asarray(devices), ("d",))
    spec = NamedSharding(mesh, PartitionSpec("d"))
    x = jax.device_put(np.ones((len(devices) * n, n), np.float32), spec)

    @jax.jit
    def mm(a):
        return jnp.einsum("bij,bjk->bik", a.reshape(-1, n, n), a.reshape(-1, n, n)).reshape(a.shape)

    mm(x).block_until_ready()
    best = float("inf")
    for _ in range(MEASURE_REPEATS):
        t0 = time.perf_counter()
        mm(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best
