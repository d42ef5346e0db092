"""The accelerator chips upcycler knows: published peak figures per chip, and the HBM the TPU compiler
actually lets one program use. The compile-only report (`upcycler.train.aot`) sizes steps with them and
the trainer measures MFU against them (`upcycler.train.reporting.peak`).

Every figure is per chip, as its vendor publishes it (`source`). `usable_hbm_bytes` is what matters for
"does the step fit": a TPU compile that needs more fails with RESOURCE_EXHAUSTED, "... exceeds available
HBM (15.75G)", and that limit (in GiB) is recorded here, measured per chip by compiling an oversized
program for one libtpu topology device of each generation. It is a little under the physical memory, which
the published capacity rounds (v5p publishes 95 GiB, yet a program may use 95.73 GiB). libtpu releases
differ by about 10 MiB (JAX 0.12's gives v5p and v6e 0.01 GiB less than JAX 0.10's): the table keeps the
smaller figure, so a step it lets through fits either.

`ici_bandwidth` is the total bidirectional inter-chip interconnect bandwidth of one chip, summed over all
its links and both directions, as the Cloud TPU pages publish it; the bytes a chip can *receive* per second
are half of it (`ici_ingress_bandwidth`). For GPUs it is the NVLink bandwidth, published the same way.

libtpu describes a v4 chip as two devices (one per TensorCore, `core_on_chip` 0 and 1); v5p's two cores
form one device. `for_devices` returns the per-device share of a chip for such a layout. A host CPU has no
entry: the report then leaves out the HBM fit and the roofline, or takes a budget from the user.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

GiB = 1 << 30
MiB = 1 << 20
GB = 10**9
TFLOPS = 10**12


@dataclass(frozen=True)
class Chip:
    """One accelerator: names JAX gives it (`device.device_kind`) and its published per-chip figures."""

    name: str
    device_kinds: tuple[str, ...]
    peak_bf16_flops: float  # dense (no sparsity) bf16 FLOP/s
    hbm_bytes: int  # published HBM capacity
    usable_hbm_bytes: int | None  # what the compiler lets one program allocate; None: not measured
    hbm_bandwidth: float  # bytes/s
    ici_bandwidth: float  # bytes/s, bidirectional, all links of the chip together
    source: str
    # the VMEM a Pallas kernel may allocate on a TPU core when it asks for no limit of its own (the compiler's
    # default scoped limit, measured: "Scoped allocation with size … and limit 16.00M exceeded"); None: no TPU
    scoped_vmem_bytes: int | None = None
    # a core's whole VMEM where a compile showed it ("would exceed memory (size=…)"), the most any scoped
    # limit can give; None: not measured (no limit raised so far reached it)
    vmem_bytes: int | None = None

    @property
    def hbm_budget_bytes(self) -> int:
        """The HBM a step may use: the measured usable figure when there is one, else the published one."""
        return self.usable_hbm_bytes if self.usable_hbm_bytes is not None else self.hbm_bytes

    @property
    def ici_ingress_bandwidth(self) -> float:
        """Bytes/s the chip can receive over all its links at once: half the bidirectional total."""
        return self.ici_bandwidth / 2

    def per_device(self, devices_per_chip: int) -> Chip:
        """The share of one device when JAX splits the chip into `devices_per_chip` devices: every rate and
        capacity divided evenly (name and source kept); the chip itself for 1."""
        if devices_per_chip < 1:
            raise ValueError(f"devices_per_chip must be at least 1, got {devices_per_chip}")
        if devices_per_chip == 1:
            return self
        k = devices_per_chip
        return dataclasses.replace(
            self,
            name=f"{self.name} (1/{k} chip)",
            peak_bf16_flops=self.peak_bf16_flops / k,
            hbm_bytes=self.hbm_bytes // k,
            usable_hbm_bytes=None if self.usable_hbm_bytes is None else self.usable_hbm_bytes // k,
            hbm_bandwidth=self.hbm_bandwidth / k,
            ici_bandwidth=self.ici_bandwidth / k,
        )


_TPU_PAGES = "https://cloud.google.com/tpu/docs/"
_USABLE = "; usable HBM: the limit a RESOURCE_EXHAUSTED compile error names for one libtpu device"

CHIPS: tuple[Chip, ...] = (
    Chip(
        name="TPU v4",
        device_kinds=("TPU v4",),
        peak_bf16_flops=275 * TFLOPS,
        hbm_bytes=32 * GiB,
        usable_hbm_bytes=int(2 * 15.25 * GiB),  # 15.25 GiB for each of the chip's two TensorCore devices
        hbm_bandwidth=1200 * GB,
        ici_bandwidth=6 * 2 * 50 * GB,  # 6 links, 50 GB/s each way (the v4 page gives no per-chip figure)
        source=f"{_TPU_PAGES}v4 (275 TFLOPs bf16, 32 GiB, 1200 GBps); ICI: 6 links of 50 GB/s per direction, "
        f"TPU v4 paper, https://arxiv.org/abs/2304.01433{_USABLE} (a TensorCore), times two",
        scoped_vmem_bytes=16 * MiB,
        vmem_bytes=16 * MiB,
    ),
    Chip(
        name="TPU v5e",
        device_kinds=("TPU v5 lite",),
        peak_bf16_flops=197 * TFLOPS,
        hbm_bytes=16 * GiB,  # the page writes "16 GB"; the 15.75 GiB a program may use says GiB
        usable_hbm_bytes=int(15.75 * GiB),
        hbm_bandwidth=819 * GB,
        ici_bandwidth=400 * GB,
        source=f"{_TPU_PAGES}v5e (197 TFLOPs bf16, 16 GB, 819 GBps, bidirectional ICI 400 GBps per chip)"
        + _USABLE,
        scoped_vmem_bytes=16 * MiB,
    ),
    Chip(
        name="TPU v5p",
        device_kinds=("TPU v5",),
        peak_bf16_flops=459 * TFLOPS,
        hbm_bytes=95 * GiB,
        usable_hbm_bytes=int(95.73 * GiB),  # more than published: the chip has 96 GiB
        hbm_bandwidth=2765 * GB,
        ici_bandwidth=1200 * GB,
        source=f"{_TPU_PAGES}v5p (459 TFLOPs bf16, 95 GiB, 2765 GBps, bidirectional ICI 1200 GBps per chip)"
        + _USABLE,
        scoped_vmem_bytes=16 * MiB,
    ),
    Chip(
        name="TPU v6e",
        device_kinds=("TPU v6 lite",),
        peak_bf16_flops=918 * TFLOPS,
        hbm_bytes=32 * GiB,  # the page writes "32 GB"; the 31.24 GiB a program may use says GiB
        usable_hbm_bytes=int(31.24 * GiB),
        hbm_bandwidth=1638 * GB,
        ici_bandwidth=800 * GB,
        source=f"{_TPU_PAGES}v6e (918 TFLOPs bf16, 32 GB, 1638 GBps, bidirectional ICI 800 GBps per chip)"
        + _USABLE,
        scoped_vmem_bytes=32 * MiB,
    ),
    Chip(
        name="H100 SXM",
        device_kinds=("NVIDIA H100 80GB HBM3",),
        peak_bf16_flops=989 * TFLOPS,  # 1979 is the figure with 2:4 sparsity
        hbm_bytes=80 * GB,
        usable_hbm_bytes=None,
        hbm_bandwidth=3350 * GB,
        ici_bandwidth=900 * GB,  # NVLink, bidirectional total
        source="https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM: bf16 1979 TFLOPS with sparsity, "
        "989 dense; 80 GB; 3.35 TB/s; NVLink 900 GB/s)",
    ),
    Chip(
        name="H200 SXM",
        device_kinds=("NVIDIA H200",),
        peak_bf16_flops=989 * TFLOPS,  # the H100's tensor cores; 1979 is the figure with 2:4 sparsity
        hbm_bytes=141 * GB,
        usable_hbm_bytes=None,
        hbm_bandwidth=4800 * GB,
        ici_bandwidth=900 * GB,  # NVLink, bidirectional total
        source="https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM: bf16 1979 TFLOPS with sparsity, "
        "989 dense; 141 GB HBM3e; 4.8 TB/s; NVLink 900 GB/s)",
    ),
    Chip(
        name="A100 SXM 80GB",
        device_kinds=("NVIDIA A100-SXM4-80GB",),
        peak_bf16_flops=312 * TFLOPS,
        hbm_bytes=80 * GB,
        usable_hbm_bytes=None,
        hbm_bandwidth=2039 * GB,
        ici_bandwidth=600 * GB,
        source="https://www.nvidia.com/en-us/data-center/a100/ (A100 80GB SXM: bf16 312 TFLOPS dense; 80 GB "
        "HBM2e; 2039 GB/s; NVLink 600 GB/s)",
    ),
    Chip(
        name="A100 SXM 40GB",
        device_kinds=("NVIDIA A100-SXM4-40GB",),
        peak_bf16_flops=312 * TFLOPS,
        hbm_bytes=40 * GB,
        usable_hbm_bytes=None,
        hbm_bandwidth=1555 * GB,
        ici_bandwidth=600 * GB,
        source="https://www.nvidia.com/en-us/data-center/a100/ (A100 40GB SXM: bf16 312 TFLOPS dense; 40 GB "
        "HBM2; 1555 GB/s; NVLink 600 GB/s)",
    ),
)


def chips() -> tuple[Chip, ...]:
    """Every chip in the table, in table order."""
    return CHIPS


def chip_for(device_kind: str) -> Chip | None:
    """The chip JAX calls `device_kind` (exactly, ignoring case and outer spaces); None when unknown."""
    kind = device_kind.strip().lower()
    for chip in CHIPS:
        if kind in (k.lower() for k in chip.device_kinds):
            return chip
    return None


def devices_per_chip(devices: Sequence[Any]) -> int:
    """How many of `devices` share one chip: the most devices found at one set of chip coordinates within
    one slice (1 for devices without coordinates, such as CPUs; every slice of a multislice target repeats
    the same coordinates)."""
    per_chip: dict[tuple, int] = {}
    for d in devices:
        coords = getattr(d, "coords", None)
        if coords is None:
            return 1
        key = (getattr(d, "slice_index", 0), *coords)
        per_chip[key] = per_chip.get(key, 0) + 1
    return max(per_chip.values(), default=1)


def for_devices(devices: Sequence[Any]) -> Chip | None:
    """What one of `devices` (all of one kind) has: its chip's figures divided among the devices sharing
    that chip (a v4 TensorCore gets half a v4). None for an unknown kind or no devices."""
    if not devices:
        return None
    chip = chip_for(devices[0].device_kind)
    return None if chip is None else chip.per_device(devices_per_chip(devices))
