"""How long a checkpoint save takes at least on the target, and whether it fits a preempted host's notice.

A checkpoint holds every parameter and optimizer value once: Orbax writes each distinct shard from one
of the devices holding it (replicas write nothing more), every host writing its own devices' shards at the
same time as the others. So a save takes at least (the most bytes one host writes) / (one host's write
bandwidth to the bucket). That is a lower bound: it leaves out the bucket's aggregate limits, metadata,
the commit and the device-to-host copy. The host bandwidth is an assumption the user can replace
(`--save-bandwidth`); the default is a round figure for one host's writes to Cloud Storage, not a
measurement.

The bound is compared with the two windows a Google Cloud job gets before its hosts stop: a Spot or
preemptible VM stops 30 s after its preemption notice (SIGTERM), and a Cloud TPU maintenance event with
Autocheckpoint waits up to 5 minutes for the process to exit. A save that does not fit the notice loses
the steps since the last periodic checkpoint on every preemption: save more often (`checkpoint.every`),
or keep a faster local copy of the state (Orbax's emergency checkpointing; not offered here yet).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

PREEMPTION_NOTICE_S = 30.0  # Compute Engine Spot and preemptible VMs, TPU VMs included: notice → stop
MAINTENANCE_WINDOW_S = 300.0  # Cloud TPU Autocheckpoint: the wait for the process to exit before maintenance
DEFAULT_HOST_BANDWIDTH = 1e9  # bytes/s one host writes to the bucket (an assumption: --save-bandwidth)


@dataclass(frozen=True)
class SaveBound:
    """The checkpoint's size, the most one host writes, and the save time that follows at `host_bandwidth`."""

    state_bytes: int
    hosts: int
    max_host_bytes: int
    host_bandwidth: float
    seconds: float
    preemption_notice_s: float = PREEMPTION_NOTICE_S
    maintenance_window_s: float = MAINTENANCE_WINDOW_S

    @property
    def fits_notice(self) -> bool:
        return self.seconds <= self.preemption_notice_s

    @property
    def fits_maintenance(self) -> bool:
        return self.seconds <= self.maintenance_window_s


def save_bound(state: Any, devices: Any, host_bandwidth: float = DEFAULT_HOST_BANDWIDTH) -> SaveBound:
    """The bound for saving `state` (a tree of `jax.ShapeDtypeStruct` with shardings) from `devices`.

    Each distinct shard of each leaf counts once, for the host of the lowest-numbered device holding it."""
    if not host_bandwidth > 0:
        raise ValueError(f"host_bandwidth must be positive, got {host_bandwidth}")
    per_host: Counter[int] = Counter()
    for leaf in jax.tree.leaves(state):
        itemsize = np.dtype(leaf.dtype).itemsize
        holders = sorted(leaf.sharding.devices_indices_map(leaf.shape).items(), key=lambda item: item[0].id)
        written: set[tuple] = set()
        for device, index in holders:
            bounds = tuple(s.indices(n)[:2] for s, n in zip(index, leaf.shape, strict=True))
            if bounds in written:
                continue
            written.add(bounds)
            per_host[device.process_index] += math.prod(stop - start for start, stop in bounds) * itemsize
    hosts = len({d.process_index for d in np.asarray(devices).flat})
    most = max(per_host.values(), default=0)
    return SaveBound(state_bytes=sum(per_host.values()), hosts=hosts, max_host_bytes=most,
                     host_bandwidth=float(host_bandwidth), seconds=most / host_bandwidth)


def describe(bound: SaveBound) -> str:
    """One line for the compile-only report."""
    verdict = (f"fits a Spot VM's {bound.preemption_notice_s:.0f} s preemption notice" if bound.fits_notice else
               f"does NOT fit a Spot VM's {bound.preemption_notice_s:.0f} s preemption notice"
               + (f" (fits the {bound.maintenance_window_s / 60:.0f}-minute maintenance window)"
                  if bound.fits_maintenance else "")
               + ": a preemption loses the steps since the last checkpoint; lower checkpoint.every")
    return (f"save     checkpoint {bound.state_bytes / 1e9:.1f} GB (parameters and optimizer state, each shard "
            f"once), at most {bound.max_host_bytes / 1e9:.2f} GB from one of {bound.hosts} hosts: ≥ "
            f"{bound.seconds:.1f} s at {bound.host_bandwidth / 1e9:.3g} GB/s per host (--save-bandwidth); {verdict}")
