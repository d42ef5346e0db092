"""The chip table against libtpu's own devices and compiler, and the roofline arithmetic on a made-up chip.

The usable HBM recorded for each TPU generation is checked against the limit its compiler names when a
program does not fit; every expected number is worked out here by hand.
"""

from __future__ import annotations

import os
import re

import pytest

from upcycler.hardware import Chip, GiB, chip_for, chips, for_devices
from upcycler.train.aot.roofline import estimate

SLICES = {"v4-8": "TPU v4", "v5e-4": "TPU v5e", "v5p-8": "TPU v5p", "v6e-4": "TPU v6e"}


def tpu_devices_of(slice_name: str) -> list:
    """The devices of a TPU slice as libtpu describes them; skips without libtpu."""
    pytest.importorskip("libtpu", reason="the TPU compiler (libtpu) is not installed")
    # no chip is opened, so another process holding libtpu at the same time is no conflict
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from upcycler.train.aot.topology import parse_slice, tpu_devices

    return tpu_devices(parse_slice(slice_name))


def compiler_hbm_limit_gib(device) -> float:
    """The HBM (GiB) the TPU compiler says it has for one device, from the error of a 256 GiB program."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray([device]), ("x",))
    too_big = jax.jit(lambda: jnp.zeros((1 << 38,), jnp.uint8) + 1, out_shardings=NamedSharding(mesh, P()))
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED") as err:
        too_big.lower().compile()
    limit = re.search(r"exceeds available HBM \(([\d.]+)G\)", str(err.value))
    assert limit is not None, str(err.value)[:500]
    return float(limit.group(1))


@pytest.mark.parametrize("slice_name", SLICES)
def test_chip_for_topology_devices(slice_name):
    devices = tpu_devices_of(slice_name)
    chip = chip_for(devices[0].device_kind)
    assert chip is not None and chip.name == SLICES[slice_name]
    per_device = for_devices(devices)
    if slice_name == "v4-8":  # libtpu gives a v4 chip as two devices, one per TensorCore
        assert len(devices) == 8
        assert per_device.peak_bf16_flops == 275e12 / 2
        assert per_device.hbm_bandwidth == 1200e9 / 2
    else:
        assert per_device == chip


@pytest.mark.parametrize("slice_name", SLICES)
def test_usable_hbm_is_the_compilers_limit(slice_name):
    """What the table records as usable per device is what the compiler refuses to exceed (the error
    prints GiB to two decimals), or 0.01 GiB under it: the table keeps the smaller figure of the libtpu
    releases that differ (JAX 0.10's and 0.12's, on v5p and v6e)."""
    devices = tpu_devices_of(slice_name)
    budget = for_devices(devices).hbm_budget_bytes / GiB
    assert budget - 0.006 <= compiler_hbm_limit_gib(devices[0]) <= budget + 0.016


def test_table():
    names = [c.name for c in chips()]
    kinds = [k for c in chips() for k in c.device_kinds]
    assert len(set(names)) == len(names) and len(set(kinds)) == len(kinds)
    assert all("https://" in c.source for c in chips())
    assert chip_for(" tpu v5 LITE ").name == "TPU v5e"
    assert chip_for("cpu") is None and chip_for("TPU v7") is None
    assert for_devices([]) is None
    v5e = chip_for("TPU v5 lite")
    assert (v5e.hbm_budget_bytes, v5e.ici_ingress_bandwidth) == (int(15.75 * GiB), 200e9)


# a made-up chip: 100 FLOP/s, HBM 10 B/s, links 4 B/s both ways together (2 B/s in)
TOY = Chip(
    name="toy", device_kinds=("toy",), peak_bf16_flops=100.0, hbm_bytes=1000, usable_hbm_bytes=None,
    hbm_bandwidth=10.0, ici_bandwidth=4.0, source="https://example.org",
)


@pytest.mark.parametrize(
    ("executed", "hbm", "traffic", "times", "bound"),
    [
        (200, 30, 4, (2, 3, 2), "memory"),
        (200, 30, 10, (2, 3, 5), "communication"),
        (1000, 30, 4, (10, 3, 2), "compute"),
        (300, 30, 6, (3, 3, 3), "compute"),  # a tie goes to the first term
    ],
)
def test_roofline(executed, hbm, traffic, times, bound):
    r = estimate(
        model_flops=50, executed_flops=executed, hbm_bytes=hbm, collective_traffic_bytes=traffic, chip=TOY
    )
    assert (r.compute_s, r.memory_s, r.communication_s) == pytest.approx(times)
    assert r.step_s == pytest.approx(max(times)) and r.bound == bound
    assert r.mfu == pytest.approx(50 / (max(times) * 100))


def test_roofline_edges():
    half = TOY.per_device(2)  # half a chip: every rate halved, so every time doubles
    r = estimate(50, 200, 30, 4, half)
    assert (r.compute_s, r.memory_s, r.communication_s, r.mfu) == pytest.approx((4, 6, 4, 50 / (6 * 50)))
    empty = estimate(0, 0, 0, 0, TOY)
    assert (empty.step_s, empty.mfu, empty.bound) == (0, 0, "compute")
    for bad in (-1, float("nan")):
        with pytest.raises(ValueError, match="hbm_bytes"):
            estimate(1, 1, bad, 1, TOY)
